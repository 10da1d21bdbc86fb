// CUDA kernels of the int8 linear layers: row-wise, column-wise and per-block absmax quantization
// (nearest or stochastic), per-block dequantization, outlier-column detection and the GEMM epilogue,
// with the element rules of zero8/kernels/int8.h (built with --fmad=false, so they round as the CPU
// reference), plus the int8 GEMM through cuBLASLt (int32 accumulation). Compiled in CI; no GPU has run
// them yet (docs/INT8.md).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "device_ptr.h"
#include "zero8/error.h"
#include "zero8/kernels/int8.h"

namespace zero8::int8 {
namespace {

using cuda_detail::check_device_ptr;
using cuda_detail::check_device_ptrs;

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

// One CUDA block per row.
__global__ void row_quant_kernel(RowQuantArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t base = r * a.cols;
  uint32_t bits = 0;
  for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x)
    if (!a.col_mask || !a.col_mask[c]) bits = max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, base + c)));
  const float s = int8_scale_from_bits(block_max_u32(bits));
  if (threadIdx.x == 0) a.scale[r] = s;
  for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const int64_t i = base + c;
    a.q[i] = (a.col_mask && a.col_mask[c])
                 ? int8_t(0)
                 : quant_elem(dtype_load(a.x, a.dtype, i), s, a.stochastic, a.seed, a.index_base + uint64_t(i));
  }
}

// One CUDA block per tile.
__global__ void block_quant_kernel(BlockQuantArgs a, int64_t nbc) {
  const int64_t br = blockIdx.y, bc = blockIdx.x;
  const int64_t r0 = br * a.block_rows, c0 = bc * a.block_cols;
  const int64_t h = min(int64_t(a.block_rows), a.rows - r0), w = min(int64_t(a.block_cols), a.cols - c0);
  uint32_t bits = 0;
  for (int64_t t = threadIdx.x; t < h * w; t += blockDim.x)
    bits = max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, (r0 + t / w) * a.cols + c0 + t % w)));
  const float s = int8_scale_from_bits(block_max_u32(bits));
  if (threadIdx.x == 0) a.scale[br * nbc + bc] = s;
  for (int64_t t = threadIdx.x; t < h * w; t += blockDim.x) {
    const int64_t i = (r0 + t / w) * a.cols + c0 + t % w;
    a.q[i] = quant_elem(dtype_load(a.x, a.dtype, i), s, a.stochastic, a.seed, a.index_base + uint64_t(i));
  }
}

// One CUDA block per kColTile consecutive columns: its threads are kColTile x kColRows, lane tx walks
// column c0 + tx down the rows (consecutive lanes read consecutive addresses), the rows' partial maxima
// meet in shared memory.
constexpr int kColTile = 32, kColRows = 8;
__global__ void col_quant_kernel(ColQuantArgs a, int64_t ld) {
  __shared__ uint32_t part[kColRows][kColTile];
  __shared__ float col_scale[kColTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * kColTile + tx;
  uint32_t bits = 0;
  if (c < a.cols)
    for (int64_t r = ty; r < a.rows; r += kColRows)
      bits = max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, r * ld + c)));
  part[ty][tx] = bits;
  __syncthreads();
  if (ty == 0) {
    for (int k = 1; k < kColRows; ++k) bits = max(bits, part[k][tx]);
    const float s = int8_scale_from_bits(bits);
    col_scale[tx] = s;
    if (c < a.cols) a.scale[c] = s;
  }
  __syncthreads();
  if (c >= a.cols) return;
  const float s = col_scale[tx];
  for (int64_t r = ty; r < a.rows; r += kColRows) {
    const int64_t i = r * ld + c;
    a.q[i] = quant_elem(dtype_load(a.x, a.dtype, i), s, a.stochastic, a.seed, a.index_base + uint64_t(i));
  }
}

// y = q * its tile's scale, one rounding to dtype (int8_block_dequant_ref's rule).
__global__ void block_dequant_kernel(BlockDequantArgs a, int64_t nbc) {
  const int64_t n = a.rows * a.cols;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / a.cols, c = e % a.cols;
    const float s = a.scale[(r / a.block_rows) * nbc + c / a.block_cols];
    dtype_store(a.y, a.dtype, e, float(a.q[e]) * s);
  }
}

// Marks columns; the mask was zeroed first. Racing writes all store 1.
__global__ void col_outliers_kernel(OutlierArgs a) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (fabsf(dtype_load(a.x, a.dtype, i)) >= a.threshold) a.mask[i % a.cols] = 1;
}

__global__ void epilogue_kernel(EpilogueArgs a) {
  const int64_t n = a.rows * a.cols;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / a.cols, j = e % a.cols;
    float v = int8_dequant_one(a.acc[e], a.row_scale[(i / a.row_group) * a.row_stride],
                               a.col_scale[(j / a.col_group) * a.col_stride]);
    if (a.add) v = v + a.add[e];
    if (a.bias) v = v + a.bias[j];
    if (a.accumulate) v = static_cast<const float*>(a.out)[e] + v;
    dtype_store(a.out, a.out_dtype, e, v);
  }
}

int grid_for(int64_t n) { return int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

cublasLtHandle_t lt_handle() {
  static std::once_flag once;
  static cublasLtHandle_t h = nullptr;
  std::call_once(once, [] { cublas_check(cublasLtCreate(&h), "cublasLtCreate"); });
  return h;
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
  row_quant_kernel<<<unsigned(a.rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
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
  const dim3 block{unsigned(kColTile), unsigned(kColRows), 1u};
  col_quant_kernel<<<unsigned(tiles), block, 0, static_cast<cudaStream_t>(stream)>>>(a, a.ld > 0 ? a.ld : a.cols);
  cuda_check(cudaGetLastError(), "int8_col_quant_cuda");
}

void int8_block_dequant_cuda(const BlockDequantArgs& a, void* stream) {
  check_device_ptrs("int8_block_dequant_cuda", {{a.q, "q"}, {a.scale, "scale"}, {a.y, "y"}});
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  block_dequant_kernel<<<grid_for(a.rows * a.cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a, nbc);
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
  epilogue_kernel<<<grid_for(a.rows * a.cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
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
