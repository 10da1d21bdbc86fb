// CUDA kernels of the int8 linear layers: row-wise, column-wise and per-block absmax quantization
// (nearest or stochastic), per-block dequantization, outlier-column detection and the GEMM epilogue,
// with the element rules of zero8/kernels/int8.h (built with --fmad=false, so they round as the CPU
// reference), plus the int8 GEMM through cuBLASLt (int32 accumulation). They are memory-bound: where
// rows are whole vectors of four elements and the arrays aligned, they move them in vector accesses
// (quant_common.cuh), and they index rows and columns on the grid's two axes rather than dividing each
// element's flat index.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "device_ptr.h"
#include "quant_common.cuh"
#include "zero8/error.h"
#include "zero8/kernels/int8.h"

namespace zero8::int8 {
namespace {

using cuda_detail::check_device_ptr;
using cuda_detail::check_device_ptrs;
using cuda_detail::ld_words;
using cuda_detail::load_codes;
using cuda_detail::load_vec;
using cuda_detail::store_codes;
using cuda_detail::store_vec;
using cuda_detail::vec_aligned;

constexpr int kThreads = 256;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ZERO8_THROW(internal, what << ": " << cudaGetErrorString(e));
}

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) ZERO8_THROW(internal, what << ": cuBLASLt status " << int(s));
}

// Block-wide max of a uint32 (every thread passes its partial; all get the result).
__device__ uint32_t block_max_u32(uint32_t v) {
  __shared__ uint32_t smax;
  if (threadIdx.x == 0) smax = 0;
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) atomicMax(&smax, v);
  __syncthreads();
  const uint32_t r = smax;
  __syncthreads();
  return r;
}

__device__ int8_t quant_elem(float x, float s, bool stochastic, uint64_t seed, uint64_t index) {
  return stochastic ? int8_quant_stochastic(x, s, rng_uniform(seed, index)) : int8_quant_nearest(x, s);
}

// One CUDA block per row. kW = 4: the row in vectors of four elements (cols % 4 == 0, x and q aligned).
template <int kW>
__global__ void row_quant_kernel(RowQuantArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t base = r * a.cols;
  auto masked = [&](int64_t c) { return a.col_mask && a.col_mask[c]; };
  uint32_t bits = 0;
  for (int64_t c = int64_t(threadIdx.x) * kW; c < a.cols; c += int64_t(blockDim.x) * kW) {
    float x[kW];
    load_vec<kW>(a.x, a.dtype, base + c, x);
#pragma unroll
    for (int k = 0; k < kW; ++k)
      if (!masked(c + k)) bits = max(bits, int8_abs_bits(x[k]));
  }
  const float s = int8_scale_from_bits(block_max_u32(bits));
  if (threadIdx.x == 0) a.scale[r] = s;
  for (int64_t c = int64_t(threadIdx.x) * kW; c < a.cols; c += int64_t(blockDim.x) * kW) {
    const int64_t i = base + c;
    float x[kW];
    load_vec<kW>(a.x, a.dtype, i, x);
    uint32_t q[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k)
      q[k] = masked(c + k) ? 0u : uint8_t(quant_elem(x[k], s, a.stochastic, a.seed, a.index_base + uint64_t(i + k)));
    store_codes<kW>(reinterpret_cast<uint8_t*>(a.q), i, q);
  }
}

// One CUDA block per tile.
__global__ void block_quant_kernel(BlockQuantArgs a, int64_t nbc) {
  const int64_t br = blockIdx.y, bc = blockIdx.x;
  const int64_t r0 = br * a.block_rows, c0 = bc * a.block_cols;
  const int64_t h = min(int64_t(a.block_rows), a.rows - r0), w = min(int64_t(a.block_cols), a.cols - c0);
  // A tile's offsets fit in 32 bits (h * w <= block_rows * block_cols), whose division is far cheaper.
  const int hw = int(h * w), wi = int(w);
  uint32_t bits = 0;
  for (int t = threadIdx.x; t < hw; t += blockDim.x) {
    const int tr = t / wi;
    bits = max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, (r0 + tr) * a.cols + c0 + (t - tr * wi))));
  }
  const float s = int8_scale_from_bits(block_max_u32(bits));
  if (threadIdx.x == 0) a.scale[br * nbc + bc] = s;
  for (int t = threadIdx.x; t < hw; t += blockDim.x) {
    const int tr = t / wi;
    const int64_t i = (r0 + tr) * a.cols + c0 + (t - tr * wi);
    a.q[i] = quant_elem(dtype_load(a.x, a.dtype, i), s, a.stochastic, a.seed, a.index_base + uint64_t(i));
  }
}

// Column-wise in two passes over chunks of kColChunk rows, so that even a few columns give the device
// enough CUDA blocks (one per kColTile columns x chunk): the first folds each column's largest magnitude
// into bits[c] with atomicMax (an integer maximum: the same whatever the order), the second quantizes with
// the column's scale, which the first chunk's block also stores. Threads are kColTile x kColRows: lane tx
// walks column c0 + tx down the chunk's rows (consecutive lanes read consecutive addresses).
constexpr int kColTile = 32, kColRows = 8, kColChunk = 256;
__global__ void col_max_kernel(ColQuantArgs a, int64_t ld, uint32_t* bits_out) {
  __shared__ uint32_t part[kColRows][kColTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * kColTile + tx;
  uint32_t bits = 0;
  if (c < a.cols) {
    for (int64_t r0 = int64_t(blockIdx.y) * kColChunk; r0 < a.rows; r0 += int64_t(gridDim.y) * kColChunk) {
      const int64_t r1 = min(a.rows, r0 + kColChunk);
      for (int64_t r = r0 + ty; r < r1; r += kColRows)
        bits = max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, r * ld + c)));
    }
  }
  part[ty][tx] = bits;
  __syncthreads();
  if (ty == 0 && c < a.cols) {
    for (int k = 1; k < kColRows; ++k) bits = max(bits, part[k][tx]);
    atomicMax(bits_out + c, bits);
  }
}
__global__ void col_quant_kernel(ColQuantArgs a, int64_t ld, const uint32_t* col_bits) {
  const int64_t c = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  if (c >= a.cols) return;
  const float s = int8_scale_from_bits(col_bits[c]);
  if (blockIdx.y == 0 && threadIdx.y == 0) a.scale[c] = s;
  for (int64_t r0 = int64_t(blockIdx.y) * kColChunk; r0 < a.rows; r0 += int64_t(gridDim.y) * kColChunk) {
    const int64_t r1 = min(a.rows, r0 + kColChunk);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const int64_t i = r * ld + c;
      a.q[i] = quant_elem(dtype_load(a.x, a.dtype, i), s, a.stochastic, a.seed, a.index_base + uint64_t(i));
    }
  }
}

// y = q * its tile's scale, one rounding to dtype (int8_block_dequant_ref's rule). Rows go to the grid's
// y (striding past its limit), each thread kW consecutive columns (kW = 4: cols and block_cols multiples of
// 4, q and y aligned; a tile's columns then come in whole quads), with no division per element.
template <int kW>
__global__ void block_dequant_kernel(BlockDequantArgs a, int64_t nbc) {
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kW;
  if (c >= a.cols) return;
  const int64_t bc = c / a.block_cols;
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const float s = a.scale[(r / a.block_rows) * nbc + bc];
    const int64_t e = r * a.cols + c;
    uint32_t q[kW];
    load_codes<kW>(reinterpret_cast<const uint8_t*>(a.q), e, q);
    float y[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k) y[k] = float(int8_t(q[k])) * s;
    store_vec<kW>(a.y, a.dtype, e, y);
  }
}

// Marks columns; the mask was zeroed first. Racing writes all store 1.
__global__ void col_outliers_kernel(OutlierArgs a) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (fabsf(dtype_load(a.x, a.dtype, i)) >= a.threshold) a.mask[i % a.cols] = 1;
}

// Rows on the grid's y (striding past its limit), each thread kW consecutive columns (kW = 4: cols a
// multiple of 4, col_group 1 or a multiple of 4, the arrays aligned), so the scales' indices take no
// division per element.
template <int kW>
__global__ void epilogue_kernel(EpilogueArgs a) {
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kW;
  if (j >= a.cols) return;
  // With groups of several columns the thread's columns lie in one group (col_group % kW == 0).
  const float group_scale = a.col_scale[(a.col_group == 1 ? j : j / a.col_group) * a.col_stride];
  float cs[kW], bias[kW] = {};
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    cs[k] = a.col_group == 1 ? a.col_scale[(j + k) * a.col_stride] : group_scale;
    if (a.bias) bias[k] = a.bias[j + k];
  }
  for (int64_t i = blockIdx.y; i < a.rows; i += gridDim.y) {
    const float rs = a.row_scale[(i / a.row_group) * a.row_stride];
    const int64_t e = i * a.cols + j;
    float v[kW], add[kW] = {}, prev[kW] = {};
    uint32_t acc[kW];
    ld_words<4 * kW>(a.acc + e, acc);
    if (a.add) load_vec<kW>(a.add, DType::f32, e, add);
    if (a.accumulate) load_vec<kW>(a.out, DType::f32, e, prev);
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      v[k] = int8_dequant_one(int32_t(acc[k]), rs, cs[k]);
      if (a.add) v[k] = v[k] + add[k];
      if (a.bias) v[k] = v[k] + bias[k];
      if (a.accumulate) v[k] = prev[k] + v[k];
    }
    store_vec<kW>(a.out, a.out_dtype, e, v);
  }
}

int grid_for(int64_t n) { return int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

// The grid of the row x column-group kernels (rows > 0, cols > 0): a thread per group of kW columns on x,
// rows on y up to its limit (the kernels stride past it).
dim3 rows_by_column_groups(int64_t rows, int64_t cols, int kw) {
  const int64_t groups = (cols + kw - 1) / kw;
  return dim3{unsigned((groups + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(rows, 65535)), 1u};
}

// The current device's cuBLASLt handle. A handle belongs to the device that was current when it was made
// (cuBLAS: "one handle per device"), so each device gets its own, made on its first product and kept for the
// process (as torch keeps its own); the mutex makes first uses from several threads safe.
cublasLtHandle_t lt_handle() {
  int dev = 0;
  cuda_check(cudaGetDevice(&dev), "int8_gemm_cuda (cudaGetDevice)");
  static std::mutex mu;
  static std::vector<cublasLtHandle_t> handles;  // by device index
  std::lock_guard<std::mutex> lock(mu);
  if (handles.size() <= size_t(dev)) handles.resize(size_t(dev) + 1, nullptr);
  if (handles[size_t(dev)] == nullptr) cublas_check(cublasLtCreate(&handles[size_t(dev)]), "cublasLtCreate");
  return handles[size_t(dev)];
}

// Releases cuBLASLt descriptors on every exit path.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtDescs() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

// Launch limits are checked before any CUDA call: gridDim.x <= 2^31 - 1, gridDim.y <= 65535.
constexpr int64_t kMaxGridX = 2147483647, kMaxGridY = 65535;

void int8_row_quant_cuda(const RowQuantArgs& a, void* stream) {
  if (a.rows > kMaxGridX)
    ZERO8_THROW(unsupported, "int8_row_quant_cuda: rows = " << a.rows << " exceeds the launch grid (one CUDA block per "
                                                             "row, at most " << kMaxGridX << ")");
  check_device_ptrs("int8_row_quant_cuda", {{a.x, "x"}, {a.col_mask, "col_mask"}, {a.q, "q"}, {a.scale, "scale"}});
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a.cols % 4 == 0 && vec_aligned(a.x, 4 * size_t(dtype_size(a.dtype))) && vec_aligned(a.q, 4))
    row_quant_kernel<4><<<unsigned(a.rows), kThreads, 0, st>>>(a);
  else
    row_quant_kernel<1><<<unsigned(a.rows), kThreads, 0, st>>>(a);
  cuda_check(cudaGetLastError(), "int8_row_quant_cuda");
}

void int8_block_quant_cuda(const BlockQuantArgs& a, void* stream) {
  const int64_t nbr = (a.rows + a.block_rows - 1) / a.block_rows, nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  if (nbr > kMaxGridY || nbc > kMaxGridX)
    ZERO8_THROW(unsupported, "int8_block_quant_cuda: rows = " << a.rows << " / block_rows = " << a.block_rows << " gives "
                                                               << nbr << " row blocks and cols = " << a.cols
                                                               << " / block_cols = " << a.block_cols << " gives " << nbc
                                                               << " column blocks; the launch grid takes at most "
                                                               << kMaxGridY << " row blocks and " << kMaxGridX
                                                               << " column blocks (use a larger block_rows)");
  check_device_ptrs("int8_block_quant_cuda", {{a.x, "x"}, {a.q, "q"}, {a.scale, "scale"}});
  const dim3 grid{unsigned(nbc), unsigned(nbr), 1u};
  block_quant_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, nbc);
  cuda_check(cudaGetLastError(), "int8_block_quant_cuda");
}

void int8_col_quant_cuda(const ColQuantArgs& a, void* stream) {
  const int64_t tiles = (a.cols + kColTile - 1) / kColTile;
  if (tiles > kMaxGridX)
    ZERO8_THROW(unsupported, "int8_col_quant_cuda: cols = " << a.cols << " exceeds the launch grid");
  check_device_ptrs("int8_col_quant_cuda", {{a.x, "x"}, {a.q, "q"}, {a.scale, "scale"}});
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>((a.rows + kColChunk - 1) / kColChunk, 1), kMaxGridY);
  const dim3 grid{unsigned(tiles), unsigned(chunks), 1u}, block{unsigned(kColTile), unsigned(kColRows), 1u};
  const int64_t ld = a.ld > 0 ? a.ld : a.cols;
  uint32_t* bits = nullptr;  // each column's largest magnitude (as bits), a stream-ordered scratch
  cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&bits), size_t(a.cols) * sizeof(uint32_t), st),
             "int8_col_quant_cuda (scratch)");
  cuda_check(cudaMemsetAsync(bits, 0, size_t(a.cols) * sizeof(uint32_t), st), "int8_col_quant_cuda (scratch)");
  col_max_kernel<<<grid, block, 0, st>>>(a, ld, bits);
  col_quant_kernel<<<grid, block, 0, st>>>(a, ld, bits);
  cuda_check(cudaFreeAsync(bits, st), "int8_col_quant_cuda (scratch)");
  cuda_check(cudaGetLastError(), "int8_col_quant_cuda");
}

void int8_block_dequant_cuda(const BlockDequantArgs& a, void* stream) {
  check_device_ptrs("int8_block_dequant_cuda", {{a.q, "q"}, {a.scale, "scale"}, {a.y, "y"}});
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  const bool four = a.cols % 4 == 0 && a.block_cols % 4 == 0 && vec_aligned(a.q, 4) &&
                    vec_aligned(a.y, 4 * size_t(dtype_size(a.dtype)));
  const dim3 grid = rows_by_column_groups(a.rows, a.cols, four ? 4 : 1);
  if (four)
    block_dequant_kernel<4><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, nbc);
  else
    block_dequant_kernel<1><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, nbc);
  cuda_check(cudaGetLastError(), "int8_block_dequant_cuda");
}

void int8_col_outliers_cuda(const OutlierArgs& a, void* stream) {
  check_device_ptrs("int8_col_outliers_cuda", {{a.x, "x"}, {a.mask, "mask"}});
  cuda_check(cudaMemsetAsync(a.mask, 0, size_t(a.cols), static_cast<cudaStream_t>(stream)), "int8_col_outliers_cuda");
  if (a.rows * a.cols == 0) return;  // no rows: the all-zero mask, as on the CPU (a 0-block grid is a launch error)
  col_outliers_kernel<<<grid_for(a.rows * a.cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cuda_check(cudaGetLastError(), "int8_col_outliers_cuda");
}

void int8_epilogue_cuda(const EpilogueArgs& a, void* stream) {
  check_device_ptrs("int8_epilogue_cuda", {{a.acc, "acc"}, {a.row_scale, "row_scale"}, {a.col_scale, "col_scale"},
                                           {a.add, "add"}, {a.bias, "bias"}, {a.out, "out"}});
  const bool four = a.cols % 4 == 0 && (a.col_group == 1 || a.col_group % 4 == 0) && vec_aligned(a.acc, 16) &&
                    vec_aligned(a.add, 16) && vec_aligned(a.out, 4 * size_t(dtype_size(a.out_dtype)));
  const dim3 grid = rows_by_column_groups(a.rows, a.cols, four ? 4 : 1);
  if (four)
    epilogue_kernel<4><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  else
    epilogue_kernel<1><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cuda_check(cudaGetLastError(), "int8_epilogue_cuda");
}

// Row-major C (m x n) = A (m x k) B is column-major C^T (n x m) = B^T A^T. A row-major m x k is a
// column-major k x m matrix (ld k): cuBLASLt's B operand, not transposed. B given as n x k (b_trans) is a
// column-major k x n matrix (ld k) used transposed: the "TN" form. cuBLASLt's int8 (IMMA) kernels in
// column order take only TN, leading dimensions (here k, k and n) that are multiples of 4 and 4-byte
// aligned pointers (cublasLtMatmul, "IMMA kernels"); anything else fails inside cublasLtMatmul with
// "status 15" (not supported), so it is refused here by name, before any CUDA call. B given as k x n
// (b_trans = false) would be NN: refused too. k = 0 is the all-zero product, as on the CPU.
void int8_gemm_cublaslt(const GemmArgs& g, void* stream) {
  if (g.k == 0) {
    check_device_ptr(g.c, "c", "int8_gemm_cuda");
    cuda_check(cudaMemsetAsync(g.c, 0, size_t(g.m) * size_t(g.n) * sizeof(int32_t), static_cast<cudaStream_t>(stream)),
               "int8_gemm_cuda (k = 0)");
    return;
  }
  if (!g.b_trans)
    ZERO8_THROW(unsupported, "int8_gemm_cuda: b_trans = false (B given as k x n) is not supported: cuBLASLt's int8 "
                             "kernels take only the TN form; pass B as n x k with b_trans = true");
  if (g.k % 4 != 0)
    ZERO8_THROW(unsupported, "int8_gemm_cuda: k = " << g.k << " is not a multiple of 4, which cuBLASLt's int8 "
                                                         "kernels need (the leading dimension of a and b); pad k");
  if (g.n % 4 != 0)
    ZERO8_THROW(unsupported, "int8_gemm_cuda: n = " << g.n << " is not a multiple of 4, which cuBLASLt's int8 "
                                                         "kernels need (the leading dimension of c); pad n");
  for (const auto& [p, name] : {std::pair<const void*, const char*>{g.a, "a"}, {g.b, "b"}})
    if (reinterpret_cast<uintptr_t>(p) % 4 != 0)
      ZERO8_THROW(unsupported, "int8_gemm_cuda: pointer '" << name << "' (" << p << ") is not 4-byte aligned, which "
                                                               "cuBLASLt's int8 kernels need");
  check_device_ptrs("int8_gemm_cuda", {{g.a, "a"}, {g.b, "b"}, {g.c, "c"}});
  LtDescs d;
  cublas_check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32I, CUDA_R_32I), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublas_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  cublas_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  cublas_check(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_8I, uint64_t(g.k), uint64_t(g.n), g.k), "layout B");
  cublas_check(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_8I, uint64_t(g.k), uint64_t(g.m), g.k), "layout A");
  cublas_check(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32I, uint64_t(g.n), uint64_t(g.m), g.n), "layout C");
  const int32_t alpha = 1, beta = 0;
  cublas_check(cublasLtMatmul(lt_handle(), d.op, &alpha, g.b, d.a, g.a, d.b, &beta, g.c, d.c, g.c, d.c, nullptr,
                              nullptr, 0, static_cast<cudaStream_t>(stream)),
               "cublasLtMatmul (int8)");
}

}  // namespace zero8::int8
