// CUDA fused optimizers: each state block's states are dequantized, the element rule of optim_math.h
// applied, the block's min/max reduced, the states requantized with quant_map.h and the parameter
// written. Two kernels do it for 8-bit states (CudaQuantKernels in dispatch.h): one CUDA block per state
// block, or one warp per state block with the maps in shared memory; 32-bit states take a plain
// grid-stride kernel over vectors. Same element math as the CPU reference (nvcc --fmad=false), so CPU
// tests vouch for it.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "device_ptr.h"
#include "quant_common.cuh"
#include "zero8/error.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/optim_math.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::optim {
namespace {

using cuda_detail::kWarpThreads;
using cuda_detail::load_codes;
using cuda_detail::load_vec;
using cuda_detail::minmax_fold;
using cuda_detail::resident_blocks;
using cuda_detail::SmemMap;
using cuda_detail::smem_map_load;
using cuda_detail::store_codes;
using cuda_detail::store_vec;
using cuda_detail::warp_minmax;

constexpr int kMaxThreads = 256;
constexpr int kMaxPerThread = 4096 / kMaxThreads;  // elements per thread at the largest block

// Index of the segment holding element i (seg_offsets sorted, nseg + 1 entries).
__device__ int64_t segment_of(const int64_t* offs, int64_t nseg, int64_t i) {
  int64_t lo = 0, hi = nseg;  // offs[lo] <= i < offs[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offs[mid] <= i) lo = mid;
    else hi = mid;
  }
  return lo;
}

// LAMB's and LARS's trust ratio is per segment: for elements lo..hi, the ratio when they lie in one segment
// (the usual case; one = true), else one = false and the caller looks each element's up. 1 without ratios.
__device__ __forceinline__ float range_trust(const StepArgs& a, bool trust_algo, int64_t lo, int64_t hi, bool& one) {
  one = true;
  if (!trust_algo || !a.seg_trust) return 1.0f;
  const int64_t s0 = a.nseg > 0 ? segment_of(a.seg_offsets, a.nseg, lo) : 0;
  one = a.nseg <= 0 || segment_of(a.seg_offsets, a.nseg, hi) == s0;
  return a.seg_trust[s0];
}

// Block-wide min/max/finite of the threads' values, combined as the reference does: accumulators
// start at +0 and a value replaces one only when strictly smaller (larger), so partial results are
// +0 or of one sign and any combination order gives the reference's answer.
__device__ void block_minmax(float& vmin, float& vmax, int& finite) {
  __shared__ float smin[kMaxThreads], smax[kMaxThreads];
  __shared__ int sfin[kMaxThreads];
  smin[threadIdx.x] = vmin;
  smax[threadIdx.x] = vmax;
  sfin[threadIdx.x] = finite;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float a = smin[threadIdx.x + s], b = smax[threadIdx.x + s];
      if (a < smin[threadIdx.x]) smin[threadIdx.x] = a;
      if (b > smax[threadIdx.x]) smax[threadIdx.x] = b;
      sfin[threadIdx.x] &= sfin[threadIdx.x + s];
    }
    __syncthreads();
  }
  vmin = smin[0];
  vmax = smax[0];
  finite = sfin[0];
  __syncthreads();
}

// Encode the block's new fp32 values x[k] (element lo + threadIdx.x + k * blockDim.x).
__device__ void block_encode(const float* x, int per, int64_t lo, int32_t len, const quant::QuantTable& t,
                             uint8_t* codes, float* absmax_out) {
  float vmin = 0.0f, vmax = 0.0f;
  int finite = 1;
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int32_t j = int32_t(threadIdx.x) + k * int32_t(blockDim.x);
    if (k >= per || j >= len) break;
    minmax_fold(x[k], vmin, vmax, finite);
  }
  block_minmax(vmin, vmax, finite);
  const float scale = finite ? quant::quant_block_scale(vmin, vmax, t) : f32_from_bits(0x7fc00000u);
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int32_t j = int32_t(threadIdx.x) + k * int32_t(blockDim.x);
    if (k >= per || j >= len) break;
    codes[lo + j] = uint8_t(quant::quant_encode_one(x[k], scale, t, false, 0.0f));
  }
  if (threadIdx.x == 0) *absmax_out = scale;
}

// Element i's update from its decoded states s1, s2 (replaced by the new ones): the parameter (and the
// master) written, 32-bit states stored; 8-bit ones are left to the caller's block encoding.
__device__ __forceinline__ void step_element(const StepArgs& a, const OptimConsts& c, bool use1, bool use2,
                                             bool trust_algo, int64_t i, float& s1, float& s2) {
  float trust = 1.0f;
  if (trust_algo && a.seg_trust) trust = a.seg_trust[a.nseg > 0 ? segment_of(a.seg_offsets, a.nseg, i) : 0];
  const float g = dtype_load(a.grad, a.grad_dtype, i);
  const float p0 = a.master ? a.master[i] : static_cast<const float*>(a.param)[i];
  const float p = optim_update_one(a.algo, c, g, p0, s1, s2, trust);
  if (a.update_params) {
    if (a.master) a.master[i] = p;
    dtype_store(a.param, a.param_dtype, i, p);
  }
  if (a.bits != 8) {
    if (use1) a.state1[i] = s1;
    if (use2) a.state2[i] = s2;
  }
}

// 8-bit states (32-bit ones take optim_step32_kernel).
__global__ void optim_step_kernel(StepArgs a, OptimConsts c, bool use1, bool use2, bool trust_algo) {
  const int64_t b = blockIdx.x;
  const int64_t lo = b * a.block;
  const int32_t len = int32_t(a.n - lo < a.block ? a.n - lo : a.block);
  const int per = (a.block + int(blockDim.x) - 1) / int(blockDim.x);
  const float scale1 = use1 ? a.absmax1[b] : 0.0f;
  const float scale2 = use2 ? a.absmax2[b] : 0.0f;
  // New states stay in registers until the block's scale is known (fully unrolled: no local memory).
  float s1v[kMaxPerThread], s2v[kMaxPerThread];
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int32_t j = int32_t(threadIdx.x) + k * int32_t(blockDim.x);
    s1v[k] = s2v[k] = 0.0f;
    if (k >= per || j >= len) continue;
    const int64_t i = lo + j;
    float s1 = 0.0f, s2 = 0.0f;
    if (use1) s1 = quant::quant_decode_one(a.code1[i], scale1, *a.map1);
    if (use2) s2 = quant::quant_decode_one(a.code2[i], scale2, *a.map2);
    step_element(a, c, use1, use2, trust_algo, i, s1, s2);
    s1v[k] = optim_state_finite(s1);
    s2v[k] = optim_state_finite(s2);
  }
  if (use1) block_encode(s1v, per, lo, len, *a.map1, a.code1, a.absmax1 + b);
  if (use2) block_encode(s2v, per, lo, len, *a.map2, a.code2, a.absmax2 + b);
}

// ---- The warp kernel (CudaQuantKernels::warp) ----

constexpr int kWarpMaxBlock = 256;  // 8 elements per lane: a block stays in registers until encoded (16
                                    // spill at sm_90)
constexpr size_t kWarpSmem = 2 * sizeof(SmemMap);  // both states' maps

// Which elements a lane holds: kW (up to 4) consecutive ones per vector, kPer / kW vectors a warp's width
// apart, so that a whole block with aligned arrays moves in vector accesses of whole lines per warp.
// For each lane the element index grows with k, so a partial block's lanes hold a prefix of their k.
template <int kPer>
struct WarpElems {
  static constexpr int kW = kPer < 4 ? kPer : 4;
  static constexpr int kVecs = kPer / kW;
  __device__ static int32_t at(int lane, int k) { return (k / kW) * 32 * kW + lane * kW + k % kW; }
  __device__ static int32_t vec(int lane, int v) { return v * 32 * kW + lane * kW; }
};

// A map's constants, read once from its table in global memory.
struct WarpMap {
  const quant::QuantTable* t;  // global: zero_code and the rare keep-sign rule read it
  const SmemMap* m;
  uint32_t steps;
  bool packed;
};

// Encode the warp's block of new states x[k] (element lo + WarpElems::at(lane, k)) and write its scale;
// `whole`: a full block in vector stores.
template <int kPer>
__device__ __forceinline__ void warp_block_encode(const float* x, int lane, int64_t lo, int32_t len, bool whole,
                                                  const WarpMap& w, uint8_t* codes, float* absmax_out) {
  using E = WarpElems<kPer>;
  float vmin = 0.0f, vmax = 0.0f;
  int finite = 1;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (!whole && E::at(lane, k) >= len) break;
    minmax_fold(x[k], vmin, vmax, finite);
  }
  warp_minmax(vmin, vmax, finite);
  const float scale = finite ? quant::quant_block_scale(vmin, vmax, *w.t) : f32_from_bits(0x7fc00000u);
  const quant::QuantBlockDivisor d = quant::quant_block_divisor(scale, *w.t);
  uint32_t q[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    q[k] = quant::quant_encode_accel(x[k], d, *w.t, w.m->lut, w.m->thresholds, w.steps, w.packed);
  if (whole) {
#pragma unroll
    for (int v = 0; v < E::kVecs; ++v) store_codes<E::kW>(codes, lo + E::vec(lane, v), q + v * E::kW);
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int32_t j = E::at(lane, k);
      if (j >= len) break;
      codes[lo + j] = uint8_t(q[k]);
    }
  }
  if (lane == 0) *absmax_out = scale;
}

// 8-bit states, block = 32 kPer elements. Persistent CUDA blocks: each copies the maps to shared memory
// once, then its warps take state blocks in turn. Per block every load is issued before the first store
// (the update runs in registers), so a warp has its whole block in flight rather than one element at a
// time (the arrays may alias for all the compiler knows, which would order each load after the previous
// element's stores). `vec`: the arrays are aligned for WarpElems' vectors (partial blocks go element-wise).
// Three CUDA blocks per SM (of 8 warps, 256 elements of each array in flight per warp): ptxas then keeps the
// step in at most 85 registers without a spill, where left to itself it spilled around the division's slow
// path at kPer = 4 (which the build refuses, CMakeLists.txt of kernels/).
template <int kPer>
__global__ void __launch_bounds__(kWarpThreads, 3)
    optim_step_warp_kernel(StepArgs a, OptimConsts c, bool use1, bool use2, bool trust_algo, int64_t nblocks,
                           bool vec) {
  using E = WarpElems<kPer>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SmemMap* maps = reinterpret_cast<SmemMap*>(smem_raw);
  if (use1) smem_map_load(*a.map1, maps[0]);
  if (use2) smem_map_load(*a.map2, maps[1]);
  __syncthreads();
  auto warp_map = [&](const quant::QuantTable* t, const SmemMap* m) {
    return WarpMap{t, m, t ? uint32_t(t->lut_steps) : 0u, t && t->lut_packed != 0};
  };
  const WarpMap w1 = warp_map(use1 ? a.map1 : nullptr, &maps[0]), w2 = warp_map(use2 ? a.map2 : nullptr, &maps[1]);
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (kWarpThreads / 32);
  const float* p_in = a.master ? a.master : static_cast<const float*>(a.param);  // fp32 without a master
  for (int64_t b = int64_t(blockIdx.x) * (kWarpThreads / 32) + (threadIdx.x >> 5); b < nblocks; b += warps) {
    const int64_t lo = b * a.block;
    const int32_t len = int32_t(a.n - lo < a.block ? a.n - lo : a.block);
    const bool whole = vec && len == a.block;
    const float scale1 = use1 ? a.absmax1[b] : 0.0f, scale2 = use2 ? a.absmax2[b] : 0.0f;
    // 1. The block's loads.
    uint32_t c1[kPer], c2[kPer];
    float g[kPer], p[kPer];
    if (whole) {
#pragma unroll
      for (int v = 0; v < E::kVecs; ++v) {
        const int64_t i = lo + E::vec(lane, v);
        if (use1) load_codes<E::kW>(a.code1, i, c1 + v * E::kW);
        if (use2) load_codes<E::kW>(a.code2, i, c2 + v * E::kW);
        load_vec<E::kW>(a.grad, a.grad_dtype, i, g + v * E::kW);
        load_vec<E::kW>(p_in, DType::f32, i, p + v * E::kW);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int32_t j = E::at(lane, k);
        c1[k] = c2[k] = 0;
        g[k] = p[k] = 0.0f;
        if (j >= len) continue;
        if (use1) c1[k] = a.code1[lo + j];
        if (use2) c2[k] = a.code2[lo + j];
        g[k] = dtype_load(a.grad, a.grad_dtype, lo + j);
        p[k] = p_in[lo + j];
      }
    }
    // 2. The update (quant_decode_one from shared memory, then the element rule).
    bool one_segment;
    const float block_trust = range_trust(a, trust_algo, lo, lo + len - 1, one_segment);
    float s1v[kPer], s2v[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int32_t j = E::at(lane, k);
      s1v[k] = s2v[k] = 0.0f;
      if (!whole && j >= len) continue;
      float s1 = use1 ? w1.m->values[c1[k]] * scale1 : 0.0f;
      float s2 = use2 ? w2.m->values[c2[k]] * scale2 : 0.0f;
      const float trust = one_segment ? block_trust : a.seg_trust[segment_of(a.seg_offsets, a.nseg, lo + j)];
      p[k] = optim_update_one(a.algo, c, g[k], p[k], s1, s2, trust);
      s1v[k] = optim_state_finite(s1);
      s2v[k] = optim_state_finite(s2);
    }
    // 3. The parameters, then 4. the states.
    if (a.update_params) {
      if (whole) {
#pragma unroll
        for (int v = 0; v < E::kVecs; ++v) {
          const int64_t i = lo + E::vec(lane, v);
          if (a.master) store_vec<E::kW>(a.master, DType::f32, i, p + v * E::kW);
          store_vec<E::kW>(a.param, a.param_dtype, i, p + v * E::kW);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const int32_t j = E::at(lane, k);
          if (j >= len) break;
          if (a.master) a.master[lo + j] = p[k];
          dtype_store(a.param, a.param_dtype, lo + j, p[k]);
        }
      }
    }
    if (use1) warp_block_encode<kPer>(s1v, lane, lo, len, whole, w1, a.code1, a.absmax1 + b);
    if (use2) warp_block_encode<kPer>(s2v, lane, lo, len, whole, w2, a.code2, a.absmax2 + b);
  }
}

// Whether the gradient, parameter and master (those of them given) are aligned for kW-element vectors, as the
// warp and 32-bit kernels access them; each kernel adds its states' arrays.
bool step_arrays_aligned(const StepArgs& a, size_t kW) {
  return cuda_detail::vec_aligned(a.grad, kW * dtype_size(a.grad_dtype)) &&
         cuda_detail::vec_aligned(a.param, kW * dtype_size(a.param_dtype)) &&
         cuda_detail::vec_aligned(a.master, kW * 4);
}

// ---- 32-bit states ----

constexpr int kStep32Threads = 256;
constexpr int kStep32W = 4;  // elements per vector access

// 32-bit states: no blocks to reduce, so plain grid-stride over vectors of kStep32W elements, each thread's
// loads all issued before its stores (the arrays may alias for all the compiler knows, which would order
// each element's loads after the previous one's stores). Per thread 4 elements of up to 4 arrays in flight:
// an H200 needs tens of KiB of loads in flight per SM to stream (quant_common.cuh), which one element per
// thread of the block kernel did not give. `vec`: every array is aligned for the vectors; the elements after
// the last whole vector (all of them when not vec) go one per thread through step_element.
__global__ void __launch_bounds__(kStep32Threads)
    optim_step32_kernel(StepArgs a, OptimConsts c, bool use1, bool use2, bool trust_algo, bool vec) {
  constexpr int kW = kStep32W;
  const int64_t nvec = vec ? a.n / kW : 0, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const float* p_in = a.master ? a.master : static_cast<const float*>(a.param);  // fp32 without a master
  for (int64_t v = first; v < nvec; v += stride) {
    const int64_t i = v * kW;
    float g[kW], p[kW], s1[kW] = {}, s2[kW] = {};
    load_vec<kW>(a.grad, a.grad_dtype, i, g);
    load_vec<kW>(p_in, DType::f32, i, p);
    if (use1) load_vec<kW>(a.state1, DType::f32, i, s1);
    if (use2) load_vec<kW>(a.state2, DType::f32, i, s2);
    bool one_segment;
    const float trust = range_trust(a, trust_algo, i, i + kW - 1, one_segment);
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      const float tr = one_segment ? trust : a.seg_trust[segment_of(a.seg_offsets, a.nseg, i + k)];
      p[k] = optim_update_one(a.algo, c, g[k], p[k], s1[k], s2[k], tr);
    }
    if (a.update_params) {
      if (a.master) store_vec<kW>(a.master, DType::f32, i, p);
      store_vec<kW>(a.param, a.param_dtype, i, p);
    }
    if (use1) store_vec<kW>(a.state1, DType::f32, i, s1);
    if (use2) store_vec<kW>(a.state2, DType::f32, i, s2);
  }
  for (int64_t i = nvec * kW + first; i < a.n; i += stride) {
    float s1 = use1 ? a.state1[i] : 0.0f, s2 = use2 ? a.state2[i] : 0.0f;
    step_element(a, c, use1, use2, trust_algo, i, s1, s2);
  }
}

void step32_launch(const StepArgs& a, const OptimConsts& c, bool use1, bool use2, cudaStream_t st) {
  constexpr size_t kW = kStep32W;
  const bool vec = step_arrays_aligned(a, kW) && cuda_detail::vec_aligned(a.state1, kW * 4) &&
                   cuda_detail::vec_aligned(a.state2, kW * 4);
  const int64_t work = vec ? a.n / int64_t(kW) + a.n % int64_t(kW) : a.n;  // vectors, then the rest
  const int64_t grid = std::min<int64_t>((work + kStep32Threads - 1) / kStep32Threads, int64_t(1) << 20);
  optim_step32_kernel<<<unsigned(grid), kStep32Threads, 0, st>>>(a, c, use1, use2, algo_has_trust_ratio(a.algo), vec);
  ZERO8_CUDA_CHECK(cudaGetLastError());
}

// Phase 1: for each piece (segment s within state block b) the block-reduced sums of p^2 and u^2,
// stored at parts[b + s] (b + s is distinct for every piece since both only grow along the range).
__global__ void optim_norms_kernel(StepArgs a, OptimConsts c, double* parts) {
  __shared__ double sw[kMaxThreads], su[kMaxThreads];
  const int64_t b = blockIdx.x;
  const int64_t lo = b * a.block;
  const int32_t len = int32_t(a.n - lo < a.block ? a.n - lo : a.block);
  const bool lamb = a.algo == Algo::lamb, q8 = a.bits == 8;
  const int64_t hi = lo + len;
  int64_t s = a.nseg > 0 ? segment_of(a.seg_offsets, a.nseg, lo) : 0;
  for (int64_t start = lo; start < hi; ++s) {
    const int64_t end = a.nseg > 0 ? (a.seg_offsets[s + 1] < hi ? a.seg_offsets[s + 1] : hi) : hi;
    double w = 0.0, u = 0.0;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      float s1 = 0.0f, s2 = 0.0f;
      if (lamb) {
        s1 = q8 ? quant::quant_decode_one(a.code1[i], a.absmax1[b], *a.map1) : a.state1[i];
        s2 = q8 ? quant::quant_decode_one(a.code2[i], a.absmax2[b], *a.map2) : a.state2[i];
      }
      const float g = dtype_load(a.grad, a.grad_dtype, i);
      const float p = a.master ? a.master[i] : static_cast<const float*>(a.param)[i];
      const float d = optim_direction_one(a.algo, c, g, p, s1, s2);
      w += double(p) * double(p);
      u += double(d) * double(d);
    }
    sw[threadIdx.x] = w;
    su[threadIdx.x] = u;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
      if (threadIdx.x < k) {
        sw[threadIdx.x] += sw[threadIdx.x + k];
        su[threadIdx.x] += su[threadIdx.x + k];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      parts[2 * (b + s)] = sw[0];
      parts[2 * (b + s) + 1] = su[0];
    }
    __syncthreads();
    start = end;
  }
}

// Per segment, the sum of its pieces in a fixed order (a warp: lane-strided partial sums, then a
// fixed shuffle tree), so the result does not depend on scheduling.
__global__ void optim_norms_reduce_kernel(const double* parts, int64_t nseg_eff, const int64_t* offs, int32_t block,
                                          int64_t n, NormSums* out) {
  const int64_t s = blockIdx.x;
  if (s >= nseg_eff) return;
  const int64_t first = offs ? offs[s] : 0, last = offs ? offs[s + 1] : n;  // element range of segment s
  const int64_t b0 = first / block, b1 = (last - 1) / block;
  double w = 0.0, u = 0.0;
  for (int64_t bb = b0 + threadIdx.x; bb <= b1; bb += 32) {
    w += parts[2 * (bb + s)];
    u += parts[2 * (bb + s) + 1];
  }
  for (int k = 16; k > 0; k >>= 1) {
    w += __shfl_down_sync(0xffffffffu, w, k);
    u += __shfl_down_sync(0xffffffffu, u, k);
  }
  if (threadIdx.x == 0) {
    out[s].w_sq = w;
    out[s].u_sq = u;
  }
}

// Phase 1 -> phase 2 on the device: one trust ratio per segment from its reduced norms.
__global__ void optim_trust_kernel(const NormSums* sums, int64_t nseg_eff, Algo algo, Hyper h, float* trust) {
  const int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s < nseg_eff) trust[s] = optim_trust_ratio_of(algo, h, sums[s].w_sq, sums[s].u_sq);
}

int threads_for_block(int32_t block) { return block < kMaxThreads ? int(block) : kMaxThreads; }

// Every pointer the kernels read or write (null ones are unused: the validated API decides).
void check_step_ptrs(const StepArgs& a, const char* where) {
  cuda_detail::check_device_ptrs(where, {{a.param, "param"}, {a.master, "master"}, {a.grad, "grad"},
                                         {a.code1, "code1"}, {a.absmax1, "absmax1"}, {a.map1, "map1"},
                                         {a.code2, "code2"}, {a.absmax2, "absmax2"}, {a.map2, "map2"},
                                         {a.state1, "state1"}, {a.state2, "state2"},
                                         {a.seg_offsets, "seg_offsets"}, {a.seg_trust, "seg_trust"}});
}

// Phase 1 into out_dev (nseg or 1 NormSums, device memory), queued on st: per-piece sums, then the
// fixed-order reduction per segment. Its scratch is a stream-ordered allocation.
void norms_to_device(const StepArgs& a, const OptimConsts& c, NormSums* out_dev, cudaStream_t st) {
  const int64_t nseg = a.nseg > 0 ? a.nseg : 1;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  const size_t nparts = size_t(nblocks + nseg);
  double* parts = nullptr;
  ZERO8_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&parts), 2 * nparts * sizeof(double), st));
  ZERO8_CUDA_CHECK(cudaMemsetAsync(parts, 0, 2 * nparts * sizeof(double), st));
  optim_norms_kernel<<<unsigned(nblocks), threads_for_block(a.block), 0, st>>>(a, c, parts);
  ZERO8_CUDA_CHECK(cudaGetLastError());
  optim_norms_reduce_kernel<<<unsigned(nseg), 32, 0, st>>>(parts, nseg, a.nseg > 0 ? a.seg_offsets : nullptr,
                                                          a.block, a.n, out_dev);
  ZERO8_CUDA_CHECK(cudaGetLastError());
  ZERO8_CUDA_CHECK(cudaFreeAsync(parts, st));
}

template <int kPer>
bool warp_launch(const StepArgs& a, const OptimConsts& c, bool use1, bool use2, cudaStream_t st) {
  static std::atomic<int> resident[64] = {};
  const int limit = resident_blocks(optim_step_warp_kernel<kPer>, kWarpSmem, resident);
  if (limit == 0) return false;
  // At least kWarpMinRounds state blocks per warp: filling a CUDA block's shared memory reads 52 KiB (from
  // L2), which a smaller share of the range would not repay.
  constexpr int64_t kWarpMinRounds = 4;
  const int64_t nblocks = (a.n + a.block - 1) / a.block, per_cta = kWarpMinRounds * (kWarpThreads / 32);
  const int64_t grid = std::min<int64_t>((nblocks + per_cta - 1) / per_cta, limit);
  constexpr int kW = WarpElems<kPer>::kW;
  const bool vec =
      step_arrays_aligned(a, kW) && cuda_detail::vec_aligned(a.code1, kW) && cuda_detail::vec_aligned(a.code2, kW);
  optim_step_warp_kernel<kPer><<<unsigned(grid), kWarpThreads, kWarpSmem, st>>>(
      a, c, use1, use2, algo_has_trust_ratio(a.algo), nblocks, vec);
  ZERO8_CUDA_CHECK(cudaGetLastError());
  return true;
}

// The warp kernel where it applies (8-bit states, blocks of 64..256); false: the caller runs the block one.
bool step_launch_warp(const StepArgs& a, const OptimConsts& c, bool use1, bool use2, cudaStream_t st) {
  if (a.bits != 8 || !(use1 || use2)) return false;
  switch (a.block) {
    case 64: return warp_launch<2>(a, c, use1, use2, st);
    case 128: return warp_launch<4>(a, c, use1, use2, st);
    case kWarpMaxBlock: return warp_launch<8>(a, c, use1, use2, st);
    default: return false;
  }
}

void step_launch(const StepArgs& a, cudaStream_t st) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const bool use1 = optim_uses_state(a.algo, a.h, 1), use2 = optim_uses_state(a.algo, a.h, 2);
  if (a.bits != 8) return step32_launch(a, c, use1, use2, st);
  if (cuda_quant_kernels() == CudaQuantKernels::warp && step_launch_warp(a, c, use1, use2, st)) return;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  optim_step_kernel<<<unsigned(nblocks), threads_for_block(a.block), 0, st>>>(a, c, use1, use2,
                                                                               algo_has_trust_ratio(a.algo));
  ZERO8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void optim_step_cuda(const StepArgs& a, void* stream) {
  if (a.n <= 0) return;
  check_step_ptrs(a, "optim_step_cuda");
  step_launch(a, static_cast<cudaStream_t>(stream));
}

void optim_norms_cuda(const StepArgs& a, NormSums* out_dev, void* stream) {
  const int64_t nseg = a.nseg > 0 ? a.nseg : 1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  cuda_detail::check_device_ptrs("optim_norms_cuda", {{out_dev, "out_dev"}});
  if (a.n <= 0) {
    ZERO8_CUDA_CHECK(cudaMemsetAsync(out_dev, 0, size_t(nseg) * sizeof(NormSums), st));
    return;
  }
  check_step_ptrs(a, "optim_norms_cuda");
  norms_to_device(a, optim_consts(a.algo, a.h, a.bits), out_dev, st);
}

void optim_step_tensor_cuda(const StepArgs& args, void* stream) {
  if (args.n <= 0) return;
  if (!algo_has_trust_ratio(args.algo)) {
    optim_step_cuda(args, stream);
    return;
  }
  StepArgs a = args;
  a.seg_trust = nullptr;  // any given ratios are ignored: computed below, in device memory
  check_step_ptrs(a, "optim_step_tensor_cuda");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t nseg = a.nseg > 0 ? a.nseg : 1;
  NormSums* sums = nullptr;
  float* trust = nullptr;
  ZERO8_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&sums), size_t(nseg) * sizeof(NormSums), st));
  ZERO8_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&trust), size_t(nseg) * sizeof(float), st));
  norms_to_device(a, optim_consts(a.algo, a.h, a.bits), sums, st);
  optim_trust_kernel<<<unsigned((nseg + 127) / 128), 128, 0, st>>>(sums, nseg, a.algo, a.h, trust);
  ZERO8_CUDA_CHECK(cudaGetLastError());
  a.seg_trust = trust;
  step_launch(a, st);
  ZERO8_CUDA_CHECK(cudaFreeAsync(sums, st));
  ZERO8_CUDA_CHECK(cudaFreeAsync(trust, st));
}

}  // namespace zero8::optim
