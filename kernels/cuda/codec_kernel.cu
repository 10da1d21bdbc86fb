// CUDA kernels of the block-wise codec: one thread block per quantization block (block-wide min/max,
// then one code per element), and an element-wise decode. The element math is the ZERO8_HD code the
// CPU reference runs (built with --fmad=false), so the device produces the same codes and scales.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include "device_ptr.h"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

constexpr int kEncodeThreads = 256;
constexpr int kDecodeThreads = 256;

// std::min / std::max as the reference folds them (the accumulator wins ties and NaN). Partial
// results are +0 or one-signed nonzero values only, so any combination order gives the same value.
struct MinOp {
  __device__ __forceinline__ float operator()(float acc, float x) const { return x < acc ? x : acc; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float acc, float x) const { return acc < x ? x : acc; }
};

__global__ void __launch_bounds__(kEncodeThreads) quant_encode_kernel(EncodeArgs a) {
  using Reduce = cub::BlockReduce<float, kEncodeThreads>;
  __shared__ typename Reduce::TempStorage tmp_min, tmp_max;
  __shared__ float block_scale;
  const QuantTable& t = *a.table;
  const int64_t b = blockIdx.x;
  const int64_t lo = b * a.block;
  const int len = int(a.n - lo < a.block ? a.n - lo : a.block);

  float vmin = 0.0f, vmax = 0.0f;
  int finite = 1;
  for (int i = threadIdx.x; i < len; i += kEncodeThreads) {
    const float x = dtype_load(a.x, a.dtype, lo + i);
    finite &= (x - x == 0.0f) ? 1 : 0;
    vmin = MinOp()(vmin, x);
    vmax = MaxOp()(vmax, x);
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

// block_shift = log2(block) (blocks are powers of two).
__global__ void __launch_bounds__(kDecodeThreads) quant_decode_kernel(DecodeArgs a, int block_shift) {
  const QuantTable& t = *a.table;
  const int64_t stride = int64_t(gridDim.x) * kDecodeThreads;
  for (int64_t i = int64_t(blockIdx.x) * kDecodeThreads + threadIdx.x; i < a.n; i += stride) {
    const float v = quant_decode_one(a.codes[i], a.absmax[i >> block_shift], t);
    if (a.accumulate)
      static_cast<float*>(a.y)[i] += v;
    else
      dtype_store(a.y, a.dtype, i, v);
  }
}

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ZERO8_THROW(internal, kernel << " launch failed: " << cudaGetErrorString(e));
}

}  // namespace

void quant_encode_cuda(const EncodeArgs& a, void* stream) {
  if (a.n <= 0) return;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  if (nblocks > 0x7fffffff) ZERO8_THROW(unsupported, "quant_encode_cuda: " << nblocks << " blocks exceed the grid limit");
  cuda_detail::check_device_ptrs("quant_encode_cuda",
                                 {{a.x, "x"}, {a.table, "table"}, {a.codes, "codes"}, {a.absmax, "absmax"}});
  quant_encode_kernel<<<unsigned(nblocks), kEncodeThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  check_launch("quant_encode_kernel");
}

void quant_decode_cuda(const DecodeArgs& a, void* stream) {
  if (a.n <= 0) return;
  cuda_detail::check_device_ptrs("quant_decode_cuda",
                                 {{a.codes, "codes"}, {a.absmax, "absmax"}, {a.table, "table"}, {a.y, "y"}});
  const int64_t want = (a.n + kDecodeThreads - 1) / kDecodeThreads;
  const unsigned grid = unsigned(want < (int64_t(1) << 20) ? want : (int64_t(1) << 20));  // grid-stride beyond
  int shift = 0;
  while ((1 << shift) < a.block) ++shift;
  quant_decode_kernel<<<grid, kDecodeThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, shift);
  check_launch("quant_decode_kernel");
}

}  // namespace zero8::quant
