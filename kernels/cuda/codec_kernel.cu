// CUDA kernels of the block-wise codec in two forms (CudaQuantKernels, dispatch.h). block: one thread
// block per quantization block (block-wide min/max, then one code per element), and an element-wise
// decode. warp: persistent thread blocks holding the map in shared memory, one warp per quantization
// block (min/max by shuffles, codes by the accelerator), and a decode of two quads per thread in
// flight, both in vector accesses where the arrays' alignment allows. The element math is the ZERO8_HD
// code the CPU reference runs (built with --fmad=false), so the device produces the same codes and scales
// in either form. Rows (EncodeArgs::row) whose blocks do not line up across rows are encoded in one launch
// of either form and decoded by a kernel of their own.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cub/block/block_reduce.cuh>

#include "device_ptr.h"
#include "quant_common.cuh"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"

namespace zero8::quant {
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

constexpr int kEncodeThreads = 256;
constexpr int kDecodeThreads = 256;
static_assert(kDecodeThreads == kWarpThreads, "resident_blocks sizes the warp decode's grid for kWarpThreads");

// std::min / std::max as the reference folds them (the accumulator wins ties and NaN). Partial
// results are +0 or one-signed nonzero values only, so any combination order gives the same value.
struct MinOp {
  __device__ __forceinline__ float operator()(float acc, float x) const { return x < acc ? x : acc; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float acc, float x) const { return acc < x ? x : acc; }
};

// Quantization block b's elements [lo, lo + len): of one row of n, or with rows (EncodeArgs::row) block bi
// of row r, each row blocked on its own (the scale's index is b either way).
__device__ __forceinline__ void block_span(const EncodeArgs& a, int64_t b, int64_t& lo, int& len) {
  if (a.row <= 0) {
    lo = b * a.block;
    len = int(a.n - lo < a.block ? a.n - lo : a.block);
    return;
  }
  const int64_t per_row = (a.row + a.block - 1) / a.block, r = b / per_row, bi = b - r * per_row;
  lo = r * a.row + bi * a.block;
  len = int(a.row - bi * a.block < a.block ? a.row - bi * a.block : a.block);
}

__global__ void __launch_bounds__(kEncodeThreads) quant_encode_kernel(EncodeArgs a) {
  using Reduce = cub::BlockReduce<float, kEncodeThreads>;
  __shared__ typename Reduce::TempStorage tmp_min, tmp_max;
  __shared__ float block_scale;
  const QuantTable& t = *a.table;
  const int64_t b = blockIdx.x;
  int64_t lo;
  int len;
  block_span(a, b, lo, len);

  float vmin = 0.0f, vmax = 0.0f;
  int finite = 1;
  for (int i = threadIdx.x; i < len; i += kEncodeThreads) {
    minmax_fold(dtype_load(a.x, a.dtype, lo + i), vmin, vmax, finite);
  }
  finite = __syncthreads_and(finite);
  const float bmin = Reduce(tmp_min).Reduce(vmin, MinOp());
  const float bmax = Reduce(tmp_max).Reduce(vmax, MaxOp());
  if (threadIdx.x == 0) {
    const float s = finite ? quant_block_scale(bmin, bmax, t) : f32_from_bits(0x7fc00000u);
    block_scale = s;
    a.absmax[b] = s;
  }
  __syncthreads();
  const float scale = block_scale;
  for (int i = threadIdx.x; i < len; i += kEncodeThreads) {
    const float x = dtype_load(a.x, a.dtype, lo + i);
    const float u = a.stochastic ? rng_uniform(a.seed, a.index_base + uint64_t(lo + i)) : 0.0f;
    a.codes[lo + i] = uint8_t(quant_encode_one(x, scale, t, a.stochastic, u));
  }
}

// Element i of the decode's output: y[i] = v, or y[i] += v (float32) when accumulating.
__device__ __forceinline__ void decode_store(const DecodeArgs& a, int64_t i, float v) {
  if (a.accumulate)
    static_cast<float*>(a.y)[i] += v;
  else
    dtype_store(a.y, a.dtype, i, v);
}

// block_shift = log2(block) (blocks are powers of two).
__global__ void __launch_bounds__(kDecodeThreads) quant_decode_kernel(DecodeArgs a, int block_shift) {
  const QuantTable& t = *a.table;
  const int64_t stride = int64_t(gridDim.x) * kDecodeThreads;
  for (int64_t i = int64_t(blockIdx.x) * kDecodeThreads + threadIdx.x; i < a.n; i += stride) {
    decode_store(a, i, quant_decode_one(a.codes[i], a.absmax[i >> block_shift], t));
  }
}

// The decode of rows (DecodeArgs::row) whose blocks do not line up across rows: element j of every row
// (grid-stride over j; the rows over the grid's y), or with sum_rows the rows' values of element j added
// in row order by one thread. The map's values in shared memory.
__global__ void __launch_bounds__(kDecodeThreads) quant_decode_rows_kernel(DecodeArgs a, int block_shift) {
  __shared__ float values[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) values[i] = a.table->values[i];
  __syncthreads();
  const int64_t rows = a.n / a.row, per_row = (a.row + (int64_t(1) << block_shift) - 1) >> block_shift;
  const int64_t stride = int64_t(gridDim.x) * kDecodeThreads;
  for (int64_t j = int64_t(blockIdx.x) * kDecodeThreads + threadIdx.x; j < a.row; j += stride) {
    const int64_t sj = j >> block_shift;
    if (a.sum_rows) {
      float* y = static_cast<float*>(a.y);
      float acc = values[a.codes[j]] * a.absmax[sj];  // quant_decode_one
      if (a.accumulate) acc = y[j] + acc;
      for (int64_t r = 1; r < rows; ++r) acc = acc + values[a.codes[r * a.row + j]] * a.absmax[r * per_row + sj];
      y[j] = acc;
    } else {
      for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        decode_store(a, r * a.row + j, values[a.codes[r * a.row + j]] * a.absmax[r * per_row + sj]);
      }
    }
  }
}

// The warp form of the encode (nearest rounding): each warp takes whole quantization blocks in turn,
// reading a block twice (min/max, then the codes: the second read comes from the caches). `vec`: x and
// the codes are aligned for vectors of kW elements, and a full block moves in them (lane l the kW
// elements from kW l on, a warp's width apart), kBatch vectors per lane loaded before their codes are
// stored; a partial block (the range's last) goes element by element.
// Four CUDA blocks per SM: at most 64 registers, none spilled (unbounded, ptxas spilled at kW = 2).
template <int kW>
__global__ void __launch_bounds__(kWarpThreads, 4) quant_encode_warp_kernel(EncodeArgs a, int64_t nblocks, bool vec) {
  constexpr int kBatch = 4;
  __shared__ SmemMap m;
  smem_map_load(*a.table, m);
  __syncthreads();
  const QuantTable& t = *a.table;
  const uint32_t steps = t.lut_steps;
  const bool packed = t.lut_packed != 0;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (kWarpThreads / 32);
  for (int64_t b = int64_t(blockIdx.x) * (kWarpThreads / 32) + (threadIdx.x >> 5); b < nblocks; b += warps) {
    int64_t lo;
    int len;
    block_span(a, b, lo, len);
    const bool whole = vec && len == a.block;
    float vmin = 0.0f, vmax = 0.0f;
    int finite = 1;
    if (whole) {
#pragma unroll 4
      for (int j = lane * kW; j < len; j += 32 * kW) {
        float x[kW];
        load_vec<kW>(a.x, a.dtype, lo + j, x);
#pragma unroll
        for (int k = 0; k < kW; ++k) minmax_fold(x[k], vmin, vmax, finite);
      }
    } else {
#pragma unroll 8
      for (int i = lane; i < len; i += 32) minmax_fold(dtype_load(a.x, a.dtype, lo + i), vmin, vmax, finite);
    }
    warp_minmax(vmin, vmax, finite);
    const float scale = finite ? quant_block_scale(vmin, vmax, t) : f32_from_bits(0x7fc00000u);
    if (lane == 0) a.absmax[b] = scale;
    const QuantBlockDivisor d = quant_block_divisor(scale, t);
    if (whole) {
      for (int j0 = lane * kW; j0 < len; j0 += kBatch * 32 * kW) {
        float x[kBatch][kW];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (j0 + u * 32 * kW < len) load_vec<kW>(a.x, a.dtype, lo + j0 + u * 32 * kW, x[u]);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (j0 + u * 32 * kW >= len) break;
          uint32_t q[kW];
#pragma unroll
          for (int k = 0; k < kW; ++k) q[k] = quant_encode_accel(x[u][k], d, t, m.lut, m.thresholds, steps, packed);
          store_codes<kW>(a.codes, lo + j0 + u * 32 * kW, q);
        }
      }
    } else {
#pragma unroll 8
      for (int i = lane; i < len; i += 32) {
        const float x = dtype_load(a.x, a.dtype, lo + i);
        a.codes[lo + i] = uint8_t(quant_encode_accel(x, d, t, m.lut, m.thresholds, steps, packed));
      }
    }
  }
}

// The warp form of the decode: the map's values in shared memory, grid-stride. `vec`: the codes and y
// aligned for quads (four consecutive elements, always in one block), each thread two quads in flight
// (their loads issued before any store), in vector accesses; the last n % 4 elements one by one.
__global__ void __launch_bounds__(kDecodeThreads) quant_decode_warp_kernel(DecodeArgs a, int block_shift, bool vec) {
  __shared__ float values[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) values[i] = a.table->values[i];
  __syncthreads();
  const int64_t stride = int64_t(gridDim.x) * kDecodeThreads;
  const int64_t first = int64_t(blockIdx.x) * kDecodeThreads + threadIdx.x;
  if (!vec) {
    for (int64_t i = first; i < a.n; i += stride) decode_store(a, i, values[a.codes[i]] * a.absmax[i >> block_shift]);
    return;
  }
  const int64_t quads = a.n / 4;
  for (int64_t q0 = first; q0 < quads; q0 += 2 * stride) {
    uint32_t c[2][4];
    float s[2], y[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t q = q0 + u * stride;
      if (q >= quads) break;
      load_codes<4>(a.codes, 4 * q, c[u]);
      s[u] = a.absmax[(4 * q) >> block_shift];
      if (a.accumulate) load_vec<4>(a.y, DType::f32, 4 * q, y[u]);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t q = q0 + u * stride;
      if (q >= quads) break;
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[k] = values[c[u][k]] * s[u];  // quant_decode_one
        if (a.accumulate) v[k] = y[u][k] + v[k];
      }
      store_vec<4>(a.y, a.accumulate ? DType::f32 : a.dtype, 4 * q, v);
    }
  }
  for (int64_t i = 4 * quads + first; i < a.n; i += stride) {
    decode_store(a, i, values[a.codes[i]] * a.absmax[i >> block_shift]);
  }
}

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ZERO8_THROW(internal, kernel << " launch failed: " << cudaGetErrorString(e));
}

}  // namespace

void quant_encode_cuda(const EncodeArgs& args, void* stream) {
  if (args.n <= 0) return;
  EncodeArgs a = args;
  if (a.row >= a.n || a.row % a.block == 0) a.row = 0;  // rows of whole blocks: blocked as one row of n
  const int64_t nblocks =
      a.row > 0 ? a.n / a.row * ((a.row + a.block - 1) / a.block) : (a.n + a.block - 1) / a.block;
  if (nblocks > 0x7fffffff) ZERO8_THROW(unsupported, "quant_encode_cuda: " << nblocks << " blocks exceed the grid limit");
  cuda_detail::check_device_ptrs("quant_encode_cuda",
                                 {{a.x, "x"}, {a.table, "table"}, {a.codes, "codes"}, {a.absmax, "absmax"}});
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (cuda_quant_kernels() == CudaQuantKernels::warp && !a.stochastic) {
    // Vectors of 4 elements, 2 for blocks of 64 (a warp's width of vectors fits in every block); rows keep
    // the vectors' alignment when their length is a multiple of the vector.
    const bool four = a.block % (32 * 4) == 0;
    const int kw = four ? 4 : 2;
    const bool vec = a.block % (32 * kw) == 0 && a.row % kw == 0 &&
                     cuda_detail::vec_aligned(a.x, size_t(kw) * dtype_size(a.dtype)) &&
                     cuda_detail::vec_aligned(a.codes, size_t(kw));
    static std::atomic<int> resident2[64] = {}, resident4[64] = {};
    // At least 4 blocks per warp: filling a thread block's shared memory reads 26 KiB (from L2).
    const int64_t per_cta = 4 * (kWarpThreads / 32);
    const int64_t want = (nblocks + per_cta - 1) / per_cta;
    const int64_t grid = std::min<int64_t>(want, four ? resident_blocks(quant_encode_warp_kernel<4>, 0, resident4)
                                                      : resident_blocks(quant_encode_warp_kernel<2>, 0, resident2));
    if (grid > 0) {
      if (four)
        quant_encode_warp_kernel<4><<<unsigned(grid), kWarpThreads, 0, st>>>(a, nblocks, vec);
      else
        quant_encode_warp_kernel<2><<<unsigned(grid), kWarpThreads, 0, st>>>(a, nblocks, vec);
      check_launch("quant_encode_warp_kernel");
      return;
    }
  }
  quant_encode_kernel<<<unsigned(nblocks), kEncodeThreads, 0, st>>>(a);
  check_launch("quant_encode_kernel");
}

void quant_decode_cuda(const DecodeArgs& args, void* stream) {
  if (args.n <= 0) return;
  DecodeArgs a = args;
  if (a.row <= 0 || a.row >= a.n) a.row = a.n;  // one row (a sum of one row: its decode, after y)
  if (a.row == a.n || (!a.sum_rows && a.row % a.block == 0)) {  // blocked as one row of n
    a.row = 0;
    a.sum_rows = false;
  }
  cuda_detail::check_device_ptrs("quant_decode_cuda",
                                 {{a.codes, "codes"}, {a.absmax, "absmax"}, {a.table, "table"}, {a.y, "y"}});
  int shift = 0;
  while ((1 << shift) < a.block) ++shift;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a.row > 0) {
    // x over a row's elements, y over the rows: about 4 elements per thread in all (short rows leave most of
    // a thread block's x idle), at most 2^20 thread blocks, 65535 in y (the grid-stride loops go on past).
    const int64_t rows = a.n / a.row;
    const int64_t gx = std::min<int64_t>((a.row + kDecodeThreads - 1) / kDecodeThreads, int64_t(1) << 16);
    const int64_t busy = std::max<int64_t>(1, (a.n + 4 * kDecodeThreads - 1) / (4 * kDecodeThreads));
    const int64_t gy = a.sum_rows ? 1 : std::min<int64_t>({rows, 65535, std::max<int64_t>(1, (int64_t(1) << 20) / gx),
                                                           std::max<int64_t>(1, busy / gx)});
    quant_decode_rows_kernel<<<dim3(unsigned(gx), unsigned(gy)), kDecodeThreads, 0, st>>>(a, shift);
    check_launch("quant_decode_rows_kernel");
    return;
  }
  const int64_t want = (a.n + kDecodeThreads - 1) / kDecodeThreads;
  const unsigned grid = unsigned(want < (int64_t(1) << 20) ? want : (int64_t(1) << 20));  // grid-stride beyond
  if (cuda_quant_kernels() == CudaQuantKernels::warp) {
    static std::atomic<int> resident[64] = {};
    const bool vec = a.block % 4 == 0 && cuda_detail::vec_aligned(a.codes, 4) &&
                     cuda_detail::vec_aligned(a.y, 4 * size_t(a.accumulate ? 4 : dtype_size(a.dtype)));
    const int64_t per8 = (a.n + 8 * kDecodeThreads - 1) / (8 * kDecodeThreads);  // two quads per thread
    const int64_t wgrid = std::min<int64_t>(per8, resident_blocks(quant_decode_warp_kernel, 0, resident));
    if (wgrid > 0) {
      quant_decode_warp_kernel<<<unsigned(wgrid), kDecodeThreads, 0, st>>>(a, shift, vec);
      check_launch("quant_decode_warp_kernel");
      return;
    }
  }
  quant_decode_kernel<<<grid, kDecodeThreads, 0, st>>>(a, shift);
  check_launch("quant_decode_kernel");
}

}  // namespace zero8::quant
