// CUDA side of zero8/kernels/vec.h: grid-stride element-wise kernels, and the fixed-order sum of squares
// (one thread block of kSumLanes threads per kSumBlock elements, the lanes and the fold exactly as the
// host's sum_block in kernels/src/vec.cpp). Built with --fmad=false, so every product and sum rounds as
// on the CPU and the results are the same bits.
#include <cuda_runtime.h>

#include "device_ptr.h"
#include "zero8/error.h"
#include "zero8/kernels/vec.h"

namespace zero8::vec {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return unsigned(want < (int64_t(1) << 20) ? want : (int64_t(1) << 20));  // grid-stride beyond
}

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ZERO8_THROW(internal, kernel << " launch failed: " << cudaGetErrorString(e));
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

#define ZERO8_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void convert_kernel(void* y, DType yt, const void* x, DType xt, int64_t n) {
  ZERO8_GRID_STRIDE(i, n) dtype_store(y, yt, i, dtype_load(x, xt, i));
}

__global__ void add_kernel(void* y, DType yt, const void* x, DType xt, int64_t n) {
  ZERO8_GRID_STRIDE(i, n) dtype_store(y, yt, i, dtype_load(y, yt, i) + dtype_load(x, xt, i));
}

__global__ void sum_kernel(float* z, const float* a, const float* b, int64_t n) {
  ZERO8_GRID_STRIDE(i, n) z[i] = a[i] + b[i];
}

__global__ void diff_kernel(float* z, const float* a, const void* x, DType xt, int64_t n) {
  ZERO8_GRID_STRIDE(i, n) z[i] = a[i] - dtype_load(x, xt, i);
}

__global__ void residual_update_kernel(float* e, const float* v, const float* d, int64_t n, const float* scales,
                                       int32_t block) {
  ZERO8_GRID_STRIDE(i, n) {
    const bool keep = block > 0 ? scales[i / block] != scales[i / block] : !(v[i] - v[i] == 0.0f);
    if (!keep) e[i] = v[i] - d[i];
  }
}

template <bool Square, class T>
__global__ void __launch_bounds__(kSumLanes) sum_level_kernel(const T* x, int64_t n, double* out) {
  __shared__ double lane[kSumLanes];
  const int t = int(threadIdx.x);
  const int64_t lo = int64_t(blockIdx.x) * kSumBlock;
  double acc = 0.0;
#pragma unroll
  for (int k = 0; k < kSumBlock / kSumLanes; ++k) {
    const int64_t i = lo + t + int64_t(k) * kSumLanes;
    if (i < n) {
      const double v = double(x[i]);
      acc = acc + (Square ? v * v : v);
    }
  }
  lane[t] = acc;
  __syncthreads();
  for (int s = kSumLanes / 2; s > 0; s >>= 1) {
    if (t < s) lane[t] = lane[t] + lane[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = lane[0];
}

__global__ void store_zero_kernel(double* out) { *out = 0.0; }

int64_t level_count(int64_t n) { return (n + kSumBlock - 1) / kSumBlock; }

}  // namespace

void convert_cuda(void* y, DType yt, const void* x, DType xt, int64_t n, void* stream) {
  if (n <= 0) return;
  cuda_detail::check_device_ptrs("vec::convert", {{y, "y"}, {x, "x"}});
  if (yt == xt) {
    device::copy(y, x, n * dtype_size(xt), stream, "vec::convert");
    return;
  }
  convert_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(y, yt, x, xt, n);
  check_launch("convert_kernel");
}

void add_cuda(void* y, DType yt, const void* x, DType xt, int64_t n, void* stream) {
  if (n <= 0) return;
  cuda_detail::check_device_ptrs("vec::add", {{y, "y"}, {x, "x"}});
  add_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(y, yt, x, xt, n);
  check_launch("add_kernel");
}

void sum_cuda(float* z, const float* a, const float* b, int64_t n, void* stream) {
  if (n <= 0) return;
  cuda_detail::check_device_ptrs("vec::sum", {{z, "z"}, {a, "a"}, {b, "b"}});
  sum_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(z, a, b, n);
  check_launch("sum_kernel");
}

void diff_cuda(float* z, const float* a, const void* x, DType xt, int64_t n, void* stream) {
  if (n <= 0) return;
  cuda_detail::check_device_ptrs("vec::diff", {{z, "z"}, {a, "a"}, {x, "x"}});
  diff_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(z, a, x, xt, n);
  check_launch("diff_kernel");
}

void residual_update_cuda(float* e, const float* v, const float* d, int64_t n, const float* scales, int32_t block,
                          void* stream) {
  if (n <= 0) return;
  cuda_detail::check_device_ptrs("vec::residual_update",
                                 {{e, "e"}, {v, "v"}, {d, "d"}, {block > 0 ? scales : nullptr, "scales"}});
  residual_update_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(e, v, d, n, scales, block);
  check_launch("residual_update_kernel");
}

void sum_squares_cuda(const float* x, int64_t n, double* out, double* work, void* stream) {
  const cudaStream_t st = as_stream(stream);
  int64_t c = level_count(n);
  cuda_detail::check_device_ptrs("vec::sum_squares", {{n > 0 ? x : nullptr, "x"}, {out, "out"}, {c > 1 ? work : nullptr, "work"}});
  if (n <= 0) {
    store_zero_kernel<<<1, 1, 0, st>>>(out);
    check_launch("store_zero_kernel");
    return;
  }
  if (c > 0x7fffffff) ZERO8_THROW(unsupported, "vec::sum_squares: " << n << " elements exceed the grid limit");
  double* level = c > 1 ? work : out;
  sum_level_kernel<true, float><<<unsigned(c), kSumLanes, 0, st>>>(x, n, level);
  check_launch("sum_level_kernel");
  while (c > 1) {
    const int64_t next = level_count(c);
    double* dst = next > 1 ? level + c : out;
    sum_level_kernel<false, double><<<unsigned(next), kSumLanes, 0, st>>>(level, c, dst);
    check_launch("sum_level_kernel");
    level = dst;
    c = next;
  }
}

}  // namespace zero8::vec
