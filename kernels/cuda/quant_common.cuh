// What the CUDA 8-bit kernels share (optim_kernel.cu: the step; codec_kernel.cu: quantize, dequantize):
// their CUDA error check, and for their warp form (CudaQuantKernels::warp, dispatch.h) a map copied to
// shared memory, the warp's min/max by shuffles, vector loads and stores of elements and codes, and how
// many CUDA blocks of a persistent kernel fit on the device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "zero8/error.h"
#include "zero8/kernels/hd.h"
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

// One value folded into a block's running min, max and finite flag, with the references' rules (below).
__device__ __forceinline__ void minmax_fold(float v, float& vmin, float& vmax, int& finite) {
  finite &= (v - v == 0.0f) ? 1 : 0;
  if (v < vmin) vmin = v;
  if (v > vmax) vmax = v;
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

// ---- Vector access: kW consecutive elements (kW = 1, 2 or 4) in one load or store instruction ----
// A warp whose lanes take kW consecutive elements each moves whole 128-byte lines per instruction and has
// kW times fewer memory instructions in flight for the same bytes: what lets a memory-bound kernel reach
// the device's bandwidth. Each address must be aligned to the access's size (vec_aligned for the arrays'
// bases; the kernels start vectors at multiples of kW elements).

// kBytes (1, 2, 4, 8 or 16) at p as little-endian 32-bit words (1 or 2 bytes: the low bits of w[0]).
template <int kBytes>
__device__ __forceinline__ void ld_words(const void* p, uint32_t* w) {
  static_assert(kBytes == 1 || kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16,
                "one load of 1, 2, 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    const uint4 v = *static_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *static_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    w[0] = *static_cast<const uint32_t*>(p);
  } else if constexpr (kBytes == 2) {
    w[0] = *static_cast<const uint16_t*>(p);
  } else {
    w[0] = *static_cast<const uint8_t*>(p);
  }
}
template <int kBytes>
__device__ __forceinline__ void st_words(void* p, const uint32_t* w) {
  static_assert(kBytes == 1 || kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16,
                "one store of 1, 2, 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    *static_cast<uint4*>(p) = uint4{w[0], w[1], w[2], w[3]};
  } else if constexpr (kBytes == 8) {
    *static_cast<uint2*>(p) = uint2{w[0], w[1]};
  } else if constexpr (kBytes == 4) {
    *static_cast<uint32_t*>(p) = w[0];
  } else if constexpr (kBytes == 2) {
    *static_cast<uint16_t*>(p) = uint16_t(w[0]);
  } else {
    *static_cast<uint8_t*>(p) = uint8_t(w[0]);
  }
}

// Elements i..i+kW-1 of an array of dtype t, as dtype_load / dtype_store would move them one by one.
template <int kW>
__device__ __forceinline__ void load_vec(const void* base, DType t, int64_t i, float* x) {
  if (t == DType::f32) {
    uint32_t w[kW];
    ld_words<4 * kW>(static_cast<const float*>(base) + i, w);
#pragma unroll
    for (int k = 0; k < kW; ++k) x[k] = f32_from_bits(w[k]);
  } else {
    uint32_t w[(kW + 1) / 2];
    ld_words<2 * kW>(static_cast<const uint16_t*>(base) + i, w);
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      const uint16_t h = uint16_t(w[k / 2] >> (16 * (k & 1)));
      x[k] = t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
}
template <int kW>
__device__ __forceinline__ void store_vec(void* base, DType t, int64_t i, const float* x) {
  if (t == DType::f32) {
    uint32_t w[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = f32_bits(x[k]);
    st_words<4 * kW>(static_cast<float*>(base) + i, w);
  } else {
    uint32_t w[(kW + 1) / 2] = {};
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      const uint32_t h = t == DType::bf16 ? f32_to_bf16(x[k]) : f32_to_f16(x[k]);
      w[k / 2] |= h << (16 * (k & 1));
    }
    st_words<2 * kW>(static_cast<uint16_t*>(base) + i, w);
  }
}
// Codes i..i+kW-1.
template <int kW>
__device__ __forceinline__ void load_codes(const uint8_t* base, int64_t i, uint32_t* c) {
  uint32_t w[1];
  ld_words<kW>(base + i, w);
#pragma unroll
  for (int k = 0; k < kW; ++k) c[k] = (w[0] >> (8 * k)) & 0xffu;
}
template <int kW>
__device__ __forceinline__ void store_codes(uint8_t* base, int64_t i, const uint32_t* c) {
  uint32_t w[1] = {0};
#pragma unroll
  for (int k = 0; k < kW; ++k) w[0] |= (c[k] & 0xffu) << (8 * k);
  st_words<kW>(base + i, w);
}

// Whether p (null: an unused array) is aligned to `bytes`: the vector accesses above start there.
inline bool vec_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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
