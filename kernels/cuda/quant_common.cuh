// What the CUDA 8-bit kernels share (optim_kernel.cu: the step; codec_kernel.cu: quantize, dequantize):
// their CUDA error check, and for their warp form (CudaQuantKernels::warp, dispatch.h) a map copied to
// shared memory, the warp's min/max by shuffles, and how many CUDA blocks of a persistent kernel fit on
// the device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "zero8/error.h"
#include "zero8/kernels/quant_map.h"

#define ZERO8_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                  \
    const cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) ZERO8_THROW(internal, "CUDA error in " #expr ": " << cudaGetErrorString(e_)); \
  } while (0)

namespace zero8::cuda_detail {

constexpr int kWarpThreads = 256;  // 8 warps per CUDA block
constexpr unsigned kFullMask = 0xffffffffu;

// One map in shared memory: what decoding and the accelerated nearest-code search read per element.
struct SmemMap {
  float values[256];
  float thresholds[256];
  uint32_t lut[quant::kQuantLutBuckets];
};

// Copies t's map into m (every thread of the CUDA block takes part; the caller syncs after).
__device__ inline void smem_map_load(const quant::QuantTable& t, SmemMap& m) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    m.values[i] = t.values[i];
    m.thresholds[i] = t.thresholds[i];
  }
  for (int i = threadIdx.x; i < int(quant::kQuantLutBuckets); i += blockDim.x) m.lut[i] = t.lut[i];
}

// Min/max/finite over the warp's lanes, with the references' rules: accumulators start at +0 and take a
// value only when it is strictly smaller (larger), so partial results are +0 or of one sign and any order
// of combination gives the same answer. Every lane gets the result.
__device__ __forceinline__ void warp_minmax(float& vmin, float& vmax, int& finite) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float a = __shfl_xor_sync(kFullMask, vmin, off), b = __shfl_xor_sync(kFullMask, vmax, off);
    if (a < vmin) vmin = a;
    if (b > vmax) vmax = b;
  }
  finite = __all_sync(kFullMask, finite);
}

// CUDA blocks of `kernel` (kWarpThreads threads, dyn_smem bytes of dynamic shared memory) resident on the
// current device at once: the grid of a persistent kernel with enough work. 0 where it does not fit.
// `cache` (64 entries, one per device, zero-initialized) keeps the answer; above 48 KiB of dynamic shared
// memory the kernel's opt-in (a property of the kernel in each device's context) is made once per device.
template <class Kernel>
int resident_blocks(Kernel* kernel, size_t dyn_smem, std::atomic<int>* cache) {
  int dev = 0;
  ZERO8_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v != 0) return v > 0 ? v : 0;
  }
  int per_sm = 0, sms = 0;
  const bool fits = dyn_smem <= 48 * 1024 ||
                    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dyn_smem)) ==
                        cudaSuccess;
  if (fits) {
    ZERO8_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarpThreads, dyn_smem));
  } else {
    (void)cudaGetLastError();  // the device offers less shared memory: the caller runs the block form
  }
  ZERO8_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int v = per_sm * sms;
  if (dev < 64) cache[dev].store(v > 0 ? v : -1, std::memory_order_relaxed);
  return v;
}

}  // namespace zero8::cuda_detail
