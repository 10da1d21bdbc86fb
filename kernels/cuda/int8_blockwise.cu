// CUDA kernel of the per-block (Jetfire) int8 product (BlockGemmArgs in zero8/kernels/int8.h): each CUDA
// block computes a 32 x 32 output tile; per reduction slice its threads form exact int32 dot products from
// shared-memory tiles, then accumulate them with int8_block_accumulate (ZERO8_HD, built with --fmad=false)
// in slice order, so the result is bit for bit the CPU reference's. A plain tiled kernel, not tuned (no
// dp4a or tensor cores). Compiled in CI; no GPU has run it yet (docs/INT8.md).
#include <cuda_runtime.h>

#include "device_ptr.h"
#include "zero8/error.h"
#include "zero8/kernels/int8.h"

namespace zero8::int8 {
namespace {

constexpr int kTile = 32;                       // output tile side and k step of the shared-memory tiles
constexpr int kThreadRows = 8;                  // a CUDA block is kTile x kThreadRows threads
constexpr int kRowsPerThread = kTile / kThreadRows;

// Elements and scales of the logical A (m x k) and B (k x n), however they are stored (as the reference).
__device__ int32_t a_at(const BlockGemmArgs& g, int64_t i, int64_t kk) {
  return g.a_trans ? g.a[kk * g.m + i] : g.a[i * g.k + kk];
}
__device__ int32_t b_at(const BlockGemmArgs& g, int64_t kk, int64_t j) {
  return g.b_trans ? g.b[j * g.k + kk] : g.b[kk * g.n + j];
}

__global__ void block_gemm_kernel(BlockGemmArgs g, int64_t nmb, int64_t nnb, int64_t nkb) {
  __shared__ int32_t as[kTile][kTile + 1];  // [row][k], padded against bank conflicts
  __shared__ int32_t bs[kTile][kTile + 1];  // [k][column]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t i0 = int64_t(blockIdx.y) * kTile, j0 = int64_t(blockIdx.x) * kTile, j = j0 + tx;
  float acc[kRowsPerThread];
  for (int q = 0; q < kRowsPerThread; ++q) acc[q] = 0.0f;
  for (int64_t s = 0; s < nkb; ++s) {
    const int64_t k0 = s * g.block, k1 = min(g.k, k0 + g.block);
    int32_t dot[kRowsPerThread];
    for (int q = 0; q < kRowsPerThread; ++q) dot[q] = 0;
    for (int64_t kc = k0; kc < k1; kc += kTile) {
      for (int r = ty; r < kTile; r += kThreadRows) {
        const int64_t i = i0 + r, ka = kc + tx, kb = kc + r, jb = j0 + tx;
        as[r][tx] = i < g.m && ka < k1 ? a_at(g, i, ka) : 0;
        bs[r][tx] = kb < k1 && jb < g.n ? b_at(g, kb, jb) : 0;
      }
      __syncthreads();
      for (int t = 0; t < kTile; ++t) {
        const int32_t b = bs[t][tx];
        for (int q = 0; q < kRowsPerThread; ++q) dot[q] += as[ty + q * kThreadRows][t] * b;
      }
      __syncthreads();
    }
    for (int q = 0; q < kRowsPerThread; ++q) {
      const int64_t i = i0 + ty + q * kThreadRows;
      if (i >= g.m || j >= g.n) continue;
      const int64_t ib = i / g.block, jb = j / g.block;
      const float sa = g.a_trans ? g.a_scale[s * nmb + ib] : g.a_scale[ib * nkb + s];
      const float sb = g.b_trans ? g.b_scale[jb * nkb + s] : g.b_scale[s * nnb + jb];
      acc[q] = int8_block_accumulate(acc[q], dot[q], sa, sb);
    }
  }
  for (int q = 0; q < kRowsPerThread; ++q) {
    const int64_t i = i0 + ty + q * kThreadRows;
    if (i >= g.m || j >= g.n) continue;
    float v = acc[q];
    if (g.bias) v = v + g.bias[j];
    dtype_store(g.out, g.out_dtype, i * g.n + j, v);
  }
}

}  // namespace

void int8_block_gemm_cuda(const BlockGemmArgs& a, void* stream) {
  const int64_t bs = a.block, nmb = (a.m + bs - 1) / bs, nnb = (a.n + bs - 1) / bs, nkb = (a.k + bs - 1) / bs;
  const int64_t tiles_m = (a.m + kTile - 1) / kTile, tiles_n = (a.n + kTile - 1) / kTile;
  if (tiles_m > 65535 || tiles_n > 2147483647)
    ZERO8_THROW(unsupported, "int8_block_gemm_cuda: " << a.m << " x " << a.n << " outputs exceed the launch grid");
  cuda_detail::check_device_ptrs("int8_block_gemm_cuda", {{a.a, "a"}, {a.a_scale, "a_scale"}, {a.b, "b"},
                                                           {a.b_scale, "b_scale"}, {a.bias, "bias"}, {a.out, "out"}});
  const dim3 grid{unsigned(tiles_n), unsigned(tiles_m), 1u}, block{unsigned(kTile), unsigned(kThreadRows), 1u};
  block_gemm_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(a, nmb, nnb, nkb);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ZERO8_THROW(internal, "int8_block_gemm_cuda: " << cudaGetErrorString(e));
}

}  // namespace zero8::int8
