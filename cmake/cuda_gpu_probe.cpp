// Configure-time probe for ZERO8_CUDA=IF_GPU (cmake/Zero8Options.cmake): exits 0 and prints the count
// when the CUDA driver sees at least one GPU, 1 otherwise (no driver library, no device, or a driver
// error), printing why. Loads the driver with dlopen, so it builds without the CUDA toolkit, and counts
// as CUDA_VISIBLE_DEVICES leaves it, as the CUDA runtime will.
#include <dlfcn.h>

#include <cstdio>

int main() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::printf("no CUDA driver (libcuda.so.1: %s)", dlerror());
    return 1;
  }
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  const auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  const auto count_fn = reinterpret_cast<CountFn>(dlsym(lib, "cuDeviceGetCount"));
  if (!init || !count_fn) {
    std::printf("libcuda.so.1 lacks cuInit/cuDeviceGetCount");
    return 1;
  }
  const int e = init(0);
  if (e != 0) {
    std::printf("cuInit failed with CUresult %d (no device, or a driver problem)", e);
    return 1;
  }
  int count = 0;
  if (count_fn(&count) != 0 || count <= 0) {
    std::printf("the CUDA driver sees no GPU");
    return 1;
  }
  std::printf("%d", count);
  return 0;
}
