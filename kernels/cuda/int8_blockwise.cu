// CUDA kernels of the per-block (Jetfire) int8 product (BlockGemmArgs in zero8/kernels/int8.h). Per output
// element the int32 dot product of each block-wide reduction slice is exact, and the slices are accumulated
// with int8_block_accumulate (ZERO8_HD, built with --fmad=false) in ascending order, so either kernel gives
// the CPU reference's bits.
// - The tensor-core kernel (blocks that are multiples of 16): 128 x 128 output tiles, each of 8 warps
//   holding 64 x 32 of them in wmma int32 fragments; the operands go through shared memory in 16 x 16
//   tiles, double-buffered, transposed on the way where stored so, and at the end of every slice each
//   fragment's int32 sums are scaled into float32 accumulators in registers, as Jetfire's kernel does (one
//   tile product per slice, dequantized).
// - A plain tiled kernel for other blocks (32 x 32 output tile per CUDA block, int32 sums on CUDA cores).
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>

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

// ---- the tensor-core kernel ----

namespace wmma = nvcuda::wmma;

constexpr int kTcTile = 128;                   // output tile side (rows and columns)
constexpr int kTcThreads = 256;                // 8 warps: 2 along the rows x 4 along the columns
constexpr int kFragsM = 4, kFragsN = 2;        // a warp's 64 x 32 outputs in 16 x 16 fragments
constexpr int kTiles16 = kTcTile / 16;         // 16 x 16 operand tiles along an operand's outer axis
constexpr int kChunk = 64;                     // reduction values per shared-memory stage
constexpr int kKT = kChunk / 16;               // 16-wide k-tiles per stage
constexpr int kVecsPerThread = kChunk * kTcTile / 16 / kTcThreads;
// A 16 x 16 int8 tile is 256 bytes; they sit 288 apart (32-byte aligned, as wmma's pointers must be), so
// that the byte stores of a transposed operand (below) from one warp's lanes, 8 tiles apart, fall in 4 banks
// 2 ways instead of 1 bank 8 ways.
constexpr int kTileStride = 288;
constexpr int kStageBytes = kKT * kTiles16 * kTileStride;  // one operand's stage
// Output tiles in groups of kGroupRows row panels: consecutive CUDA blocks walk down a group's rows before
// moving one column panel on, so the blocks resident at once share a few panels of A and of B in L2
// instead of all reading one row panel and every column panel (B read again from DRAM for each row panel
// once A and B exceed L2, which at a layer's shapes they do).
constexpr int kGroupRows = 8;
// Every slice's int32 sums must become float32 (exactly: |sum| < 2^24), one per output and slice, which at a
// 32-wide slice is more CUDA-core work than the tensor cores' own; the CUDA C++ Programming Guide's table of
// arithmetic instruction throughput lists type conversions at a fraction of the rate of a float32 add. So
// each slice's accumulation starts at kBias, the bits of 1.5 * 2^23: for |sum| < 2^22 the int32 result is
// then the float 1.5 * 2^23 + sum (the mantissa's low bits hold it), and one exact float subtraction gives
// float(sum). |sum| <= 127 * 127 * block < 2^22 needs block <= 256; larger blocks start at 0 and convert.
constexpr int32_t kBias = 0x4B400000;
constexpr float kBiasValue = 12582912.0f;  // 1.5 * 2^23
constexpr int32_t kBiasMaxBlock = 256;

// One operand as the kernel reads it: the row-major matrix it is stored as. Its reduction axis is the
// contiguous one (kContig: A stored m x k, B stored n x k) or not (A stored k x m, B stored k x n).
struct TcOperand {
  const int8_t* p;
  int64_t ld;     // elements between stored rows
  int64_t outer;  // extent of the non-reduction axis (m for A, n for B)
  bool vec;       // p and ld allow 16-byte loads
};

// 16 bytes from (row, col) of a rows x cols matrix, one by one, zero past its edges: the vectors of edge tiles
// and of matrices whose rows are not 16-byte aligned. Not inlined: inlined, its 16 addresses per vector were
// hoisted out of the stage loop, and the kernel spilled.
__device__ __noinline__ uint4 tc_load_bytes(const TcOperand& o, int64_t row, int64_t col, int64_t rows, int64_t cols) {
  uint32_t w[4] = {0, 0, 0, 0};
  if (row < rows)
    for (int t = 0; t < 16; ++t)
      if (col + t < cols) w[t / 4] |= uint32_t(uint8_t(o.p[row * o.ld + col + t])) << (8 * (t % 4));
  return uint4{w[0], w[1], w[2], w[3]};
}

// The 16 bytes of vector v of the stage [kc, kc + kChunk) of the tile starting at e0 (outer axis), zero
// beyond the matrix, and where they go in the stage's shared memory (tc_put): kKT x kTiles16 tiles of
// 16 x 16 bytes, tile (kt, eb) at (kt * kTiles16 + eb) * kTileStride, each holding 16 outer indices' 16
// reduction values in rows of 16 bytes (ldm 16): A's fragments load row-major and B's column-major, the
// forms the tensor cores take (ldmatrix); read the other way, the fragments load byte by byte. With the
// reduction axis contiguous (kContig) a vector is such a row; otherwise it holds 16 outer indices at one
// reduction index and goes in as a column, byte by byte: *tile_off is the row's start, or the column's.
template <bool kContig>
__device__ __forceinline__ uint4 tc_load(const TcOperand& o, int64_t k, int64_t e0, int64_t kc, int v, int* tile_off) {
  int64_t row, col;  // of the stored matrix
  bool full;
  if (kContig) {  // rows along the outer axis, 16 reduction values per vector
    const int e = v / kKT, kt = v % kKT;
    row = e0 + e;
    col = kc + 16 * kt;
    full = row < o.outer && col + 16 <= k;
    *tile_off = (kt * kTiles16 + e / 16) * kTileStride + (e % 16) * 16;
  } else {  // rows along the reduction axis, 16 outer values per vector
    const int q = v / kTiles16, eb = v % kTiles16;
    row = kc + q;
    col = e0 + 16 * eb;
    full = row < k && col + 16 <= o.outer;
    *tile_off = ((q / 16) * kTiles16 + eb) * kTileStride + q % 16;
  }
  if (full && o.vec) return *reinterpret_cast<const uint4*>(o.p + row * o.ld + col);
  return tc_load_bytes(o, row, col, kContig ? o.outer : k, kContig ? k : o.outer);
}

// Vector w into the stage at off (from tc_load): one 16-byte store, or 16 byte stores down a column.
template <bool kContig>
__device__ __forceinline__ void tc_put(signed char* stage, int off, uint4 w) {
  if (kContig) {
    *reinterpret_cast<uint4*>(stage + off) = w;
  } else {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int t = 0; t < 16; ++t) stage[off + 16 * t] = static_cast<signed char>(words[t / 4] >> (8 * (t % 4)));
  }
}

template <bool kAContig, bool kBContig>
__global__ void __launch_bounds__(kTcThreads, 1)
    block_gemm_tc_kernel(BlockGemmArgs g, TcOperand oa, TcOperand ob, int64_t nmb, int64_t nnb, int64_t nkb,
                         int tiles_m, int tiles_n) {
  // [stage buffer][operand: A, B][bytes]; at the end, each warp's 16 x 16 int32 for the way out.
  __shared__ __align__(128) signed char tiles[2][2][kStageBytes];
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;
  // (32-bit: the launcher keeps the tile count below 2^31.)
  const int pid = int(blockIdx.x), per_group = kGroupRows * tiles_n, first_row = pid / per_group * kGroupRows;
  const int group_rows = min(tiles_m - first_row, kGroupRows), in_group = pid % per_group;
  const int64_t i0 = int64_t(first_row + in_group % group_rows) * kTcTile;
  const int64_t j0 = int64_t(in_group / group_rows) * kTcTile;
  const int64_t nchunks = (g.k + kChunk - 1) / kChunk;

  uint4 va[kVecsPerThread], vb[kVecsPerThread];
  int offa[kVecsPerThread], offb[kVecsPerThread];
  auto stage = [&](int64_t kc) {  // the global loads of stage kc, into registers
#pragma unroll
    for (int r = 0; r < kVecsPerThread; ++r) {
      va[r] = tc_load<kAContig>(oa, g.k, i0, kc, tid + r * kTcThreads, &offa[r]);
      vb[r] = tc_load<kBContig>(ob, g.k, j0, kc, tid + r * kTcThreads, &offb[r]);
    }
  };
  auto put = [&](int buf) {
#pragma unroll
    for (int r = 0; r < kVecsPerThread; ++r) {
      tc_put<kAContig>(tiles[buf][0], offa[r], va[r]);
      tc_put<kBContig>(tiles[buf][1], offb[r], vb[r]);
    }
  };

  // Slices and scales without a division in the loop: k-tiles per slice, and per fragment row (column) the
  // offset of its row (column) block's scales, to which slice s adds s times the scales' stride along k
  // (32-bit: the launcher keeps each scale matrix below 2^31 entries; registers are this kernel's limit).
  // Fragments past the matrix's edge read the last block's scales (their results are never stored), so
  // the scale loads need no branch.
  const int tiles_per_slice = int(g.block / 16);
  const int64_t ktiles = (g.k + 15) / 16;
  const int sa_step = int(g.a_trans ? nmb : 1), sb_step = int(g.b_trans ? 1 : nnb);
  int sa_base[kFragsM], sb_base[kFragsN];
#pragma unroll
  for (int fi = 0; fi < kFragsM; ++fi) {
    const int64_t ib = min((i0 + wm * 64 + fi * 16) / g.block, nmb - 1);
    sa_base[fi] = int(g.a_trans ? ib : ib * nkb);
  }
#pragma unroll
  for (int fj = 0; fj < kFragsN; ++fj) {
    const int64_t jb = min((j0 + wn * 32 + fj * 16) / g.block, nnb - 1);
    sb_base[fj] = int(g.b_trans ? jb * nkb : jb);
  }
  int tile_in_slice = 0, slice = 0;
  const bool biased = g.block <= kBiasMaxBlock;
  wmma::fragment<wmma::accumulator, 16, 16, 16, int> start, dot[kFragsM][kFragsN];
  wmma::fill_fragment(start, biased ? kBias : 0);  // where each slice's sums start
  float acc[kFragsM][kFragsN][8];
#pragma unroll
  for (int fi = 0; fi < kFragsM; ++fi)
#pragma unroll
    for (int fj = 0; fj < kFragsN; ++fj)
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[fi][fj][t] = 0.0f;
  if (nchunks > 0) {
    stage(0);
    put(0);
  }
  __syncthreads();
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int buf = int(ch & 1);
    if (ch + 1 < nchunks) stage((ch + 1) * kChunk);  // in flight during this stage's products
#pragma unroll
    for (int kt = 0; kt < kKT; ++kt) {
      const int64_t ktile = ch * kKT + kt;
      if (ktile >= ktiles) break;  // past the reduction (the same for every thread)
      wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa[kFragsM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb[kFragsN];
#pragma unroll
      for (int fi = 0; fi < kFragsM; ++fi)
        wmma::load_matrix_sync(fa[fi], &tiles[buf][0][(kt * kTiles16 + wm * kFragsM + fi) * kTileStride], 16);
#pragma unroll
      for (int fj = 0; fj < kFragsN; ++fj)
        wmma::load_matrix_sync(fb[fj], &tiles[buf][1][(kt * kTiles16 + wn * kFragsN + fj) * kTileStride], 16);
      if (tile_in_slice == 0) {  // a slice's first k-tile (the same for the whole CUDA block)
#pragma unroll
        for (int fi = 0; fi < kFragsM; ++fi)
#pragma unroll
          for (int fj = 0; fj < kFragsN; ++fj) wmma::mma_sync(dot[fi][fj], fa[fi], fb[fj], start);
      } else {
#pragma unroll
        for (int fi = 0; fi < kFragsM; ++fi)
#pragma unroll
          for (int fj = 0; fj < kFragsN; ++fj) wmma::mma_sync(dot[fi][fj], fa[fi], fb[fj], dot[fi][fj]);
      }
      // A slice ends (block is a multiple of 16; the last one may be partial): its exact sums, scaled into
      // the accumulators (the next slice starts from `start`). A fragment lies in one row block and one
      // column block: one scale pair.
      if (++tile_in_slice < tiles_per_slice && ktile + 1 < ktiles) continue;
      float sa[kFragsM], sb[kFragsN];
#pragma unroll
      for (int fi = 0; fi < kFragsM; ++fi) sa[fi] = g.a_scale[sa_base[fi] + slice * sa_step];
#pragma unroll
      for (int fj = 0; fj < kFragsN; ++fj) sb[fj] = g.b_scale[sb_base[fj] + slice * sb_step];
#pragma unroll
      for (int fi = 0; fi < kFragsM; ++fi)
#pragma unroll
        for (int fj = 0; fj < kFragsN; ++fj) {
          const float scale = sa[fi] * sb[fj];
          if (biased) {
#pragma unroll
            for (int t = 0; t < 8; ++t)
              acc[fi][fj][t] =
                  int8_block_accumulate_f(acc[fi][fj][t], __int_as_float(dot[fi][fj].x[t]) - kBiasValue, scale);
          } else {
#pragma unroll
            for (int t = 0; t < 8; ++t)
              acc[fi][fj][t] = int8_block_accumulate_f(acc[fi][fj][t], float(dot[fi][fj].x[t]), scale);
          }
        }
      tile_in_slice = 0;
      ++slice;
    }
    if (ch + 1 < nchunks) put(buf ^ 1);  // the warps read that buffer in the previous stage, before its barrier
    __syncthreads();
  }
  // Out: a fragment's element order is the hardware's, so the float32 results travel as the bits of an
  // int32 fragment through a 16 x 16 tile of the warp's in shared memory (the stages are done), then to the
  // output in rows, bias added.
  int* ot = reinterpret_cast<int*>(&tiles[0][0][0]) + warp * 256;
#pragma unroll
  for (int fi = 0; fi < kFragsM; ++fi)
#pragma unroll
    for (int fj = 0; fj < kFragsN; ++fj) {
      const int64_t r0 = i0 + wm * 64 + fi * 16, c0 = j0 + wn * 32 + fj * 16;
      if (r0 >= g.m || c0 >= g.n) continue;  // the same for the whole warp
      wmma::fragment<wmma::accumulator, 16, 16, 16, int> bits;
#pragma unroll
      for (int t = 0; t < 8; ++t) bits.x[t] = __float_as_int(acc[fi][fj][t]);
      wmma::store_matrix_sync(ot, bits, 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int idx = lane * 8 + e;
        const int64_t i = r0 + idx / 16, j = c0 + idx % 16;
        if (i >= g.m || j >= g.n) continue;
        float v = __int_as_float(ot[idx]);
        if (g.bias) v = v + g.bias[j];
        dtype_store(g.out, g.out_dtype, i * g.n + j, v);
      }
      __syncwarp();
    }
}

void launch_tc(const BlockGemmArgs& a, int64_t nmb, int64_t nnb, int64_t nkb, int tm, int tn, cudaStream_t st) {
  auto operand = [](const int8_t* p, int64_t ld, int64_t outer) {
    return TcOperand{p, ld, outer, reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 16 == 0};
  };
  const TcOperand oa = operand(a.a, a.a_trans ? a.m : a.k, a.m), ob = operand(a.b, a.b_trans ? a.k : a.n, a.n);
  const unsigned grid = unsigned(tm) * unsigned(tn);  // one dimension: the kernel orders the tiles (kGroupRows)
  const bool a_contig = !a.a_trans, b_contig = a.b_trans;
  if (a_contig && b_contig)
    block_gemm_tc_kernel<true, true><<<grid, kTcThreads, 0, st>>>(a, oa, ob, nmb, nnb, nkb, tm, tn);
  else if (a_contig)
    block_gemm_tc_kernel<true, false><<<grid, kTcThreads, 0, st>>>(a, oa, ob, nmb, nnb, nkb, tm, tn);
  else if (b_contig)
    block_gemm_tc_kernel<false, true><<<grid, kTcThreads, 0, st>>>(a, oa, ob, nmb, nnb, nkb, tm, tn);
  else
    block_gemm_tc_kernel<false, false><<<grid, kTcThreads, 0, st>>>(a, oa, ob, nmb, nnb, nkb, tm, tn);
}

bool uses_tensor_cores(int32_t block) { return block % 16 == 0; }

}  // namespace

const char* int8_block_gemm_cuda_variant(int32_t block) { return uses_tensor_cores(block) ? "wmma" : "tiled"; }

void int8_block_gemm_cuda(const BlockGemmArgs& a, void* stream) {
  const int64_t bs = a.block, nmb = (a.m + bs - 1) / bs, nnb = (a.n + bs - 1) / bs, nkb = (a.k + bs - 1) / bs;
  const bool tc = uses_tensor_cores(a.block);
  const int64_t tile = tc ? kTcTile : kTile;
  const int64_t tiles_m = (a.m + tile - 1) / tile, tiles_n = (a.n + tile - 1) / tile;
  if (tc ? tiles_m * tiles_n > 2147483647 : tiles_m > 65535 || tiles_n > 2147483647)
    ZERO8_THROW(unsupported, "int8_block_gemm_cuda: " << a.m << " x " << a.n << " outputs exceed the launch grid");
  if (tc && std::max(nmb, nnb) * nkb > 2147483647)  // the kernel's 32-bit scale offsets (A or B of > 2^39 bytes)
    ZERO8_THROW(unsupported, "int8_block_gemm_cuda: " << std::max(nmb, nnb) * nkb << " scales per operand exceed 2^31");
  cuda_detail::check_device_ptrs("int8_block_gemm_cuda", {{a.a, "a"}, {a.a_scale, "a_scale"}, {a.b, "b"},
                                                           {a.b_scale, "b_scale"}, {a.bias, "bias"}, {a.out, "out"}});
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (tc) {
    launch_tc(a, nmb, nnb, nkb, int(tiles_m), int(tiles_n), st);
  } else {
    const dim3 grid{unsigned(tiles_n), unsigned(tiles_m), 1u}, block{unsigned(kTile), unsigned(kThreadRows), 1u};
    block_gemm_kernel<<<grid, block, 0, st>>>(a, nmb, nnb, nkb);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ZERO8_THROW(internal, "int8_block_gemm_cuda: " << cudaGetErrorString(e));
}

}  // namespace zero8::int8
