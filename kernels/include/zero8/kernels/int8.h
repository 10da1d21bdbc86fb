// Int8 linear-layer kernels: absmax int8 quantization by rows (LLM.int8's vector-wise activations and
// weights), by columns, and by 2-D blocks (Jetfire's per-block format, optional stochastic rounding);
// outlier-column detection; the epilogue that turns an int32 GEMM accumulator back into floats; and the
// fused per-block product (Jetfire's GEMM with scales along the reduction axis).
// The element rules below are ZERO8_HD so the scalar reference, the SIMD variants and the CUDA kernels
// round identically. Raw kernels: arguments are validated by the API in zero8/int8.h, not here.
#pragma once

#include <cmath>
#include <cstdint>

#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"

namespace zero8::int8 {

// ---- element rules (every variant reproduces these bit for bit) ----

// A group's scale: absmax / 127, so code 127 decodes to the group's largest magnitude (LLM.int8's
// absmax quantization, Jetfire's per-block scale). Codes are symmetric in [-127, 127].
ZERO8_HD float int8_scale(float absmax) { return absmax / 127.0f; }

// |x| as the integer bits of its magnitude: the max of these over a group is the group's absmax,
// and a value >= 0x7f800000 means the group holds Inf or NaN.
ZERO8_HD uint32_t int8_abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }
constexpr uint32_t kInt8NonFiniteBits = 0x7f800000u;

// Scale of a group from the max of int8_abs_bits: NaN if the group holds Inf/NaN (its codes are all 0
// and the NaN scale makes every product with it NaN), else absmax / 127 (0 for an all-zero group).
ZERO8_HD float int8_scale_from_bits(uint32_t max_abs_bits) {
  return max_abs_bits >= kInt8NonFiniteBits ? f32_from_bits(0x7fc00000u) : int8_scale(f32_from_bits(max_abs_bits));
}

ZERO8_HD float int8_clamp127(float v) { return v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v); }

// Round to nearest (ties to even) of x / scale. A zero or NaN scale gives code 0.
ZERO8_HD int8_t int8_quant_nearest(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
#if defined(__CUDA_ARCH__)
  return int8_t(int8_clamp127(rintf(__fdiv_rn(x, scale))));
#else
  return int8_t(int8_clamp127(std::nearbyint(x / scale)));
#endif
}

// Stochastic rounding: floor(x / scale + u) with u uniform in [0, 1), so E[code * scale] = x.
ZERO8_HD int8_t int8_quant_stochastic(float x, float scale, float u) {
  if (!(scale > 0.0f)) return 0;
#if defined(__CUDA_ARCH__)
  return int8_t(int8_clamp127(floorf(__fadd_rn(__fdiv_rn(x, scale), u))));
#else
  return int8_t(int8_clamp127(std::floor(x / scale + u)));
#endif
}

// Epilogue of one output: float(acc) * (row_scale * col_scale), then + add, then + bias (each
// optional, in that order), then + the previous output when accumulating.
ZERO8_HD float int8_dequant_one(int32_t acc, float row_scale, float col_scale) {
  return float(acc) * (row_scale * col_scale);
}

// One reduction slice of a per-block product (Jetfire) added to its float32 accumulator: the slice's exact
// int32 dot product dequantized by int8_dequant_one, then summed, a product and a sum with no fused
// multiply-add. Slices are accumulated in ascending order from 0; this is also what the per-slice path (an
// int8 GEMM plus int8_epilogue with accumulate) computes, so the fused kernels equal it bit for bit.
ZERO8_HD float int8_block_accumulate(float acc, int32_t dot, float row_scale, float col_scale) {
  return acc + int8_dequant_one(dot, row_scale, col_scale);
}
// The same with float(dot) and row_scale * col_scale already formed (a kernel that converts the dot product
// another exact way, or scales many with one pair): the same operations, so the same bits.
ZERO8_HD float int8_block_accumulate_f(float acc, float dot, float scale_product) { return acc + dot * scale_product; }

// ---- kernel arguments (plain structs of raw pointers; row-major, contiguous) ----

// Row-wise: one scale per row of x (rows x cols). Columns with col_mask[c] != 0 (LLM.int8's outlier
// columns) are left out of the absmax and get code 0: the caller computes them in floating point.
struct RowQuantArgs {
  const void* x = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  const uint8_t* col_mask = nullptr;  // cols bytes, or null: no excluded columns
  int8_t* q = nullptr;                // rows * cols codes
  float* scale = nullptr;             // rows scales
  bool stochastic = false;            // u = rng_uniform(seed, index_base + r * cols + c)
  uint64_t seed = 0;
  uint64_t index_base = 0;
};

// Column-wise: one scale per column of x (rows x cols); q keeps x's layout. Element (r, c) of x and q
// is at r * ld + c (ld = 0: cols), and its stochastic draw is rng_uniform(seed, index_base + r * ld + c).
struct ColQuantArgs {
  const void* x = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int8_t* q = nullptr;     // rows * ld codes
  float* scale = nullptr;  // cols scales
  bool stochastic = false;
  uint64_t seed = 0;
  uint64_t index_base = 0;
};

// Per-block: x (rows x cols) cut into block_rows x block_cols tiles (edge tiles are partial), one scale
// per tile, stored row-major: scale[(r / block_rows) * ceil(cols / block_cols) + c / block_cols].
struct BlockQuantArgs {
  const void* x = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  int32_t block_rows = 32, block_cols = 32;
  int8_t* q = nullptr;
  float* scale = nullptr;
  bool stochastic = false;
  uint64_t seed = 0;
  uint64_t index_base = 0;
};

// y = q * its block's scale (the inverse of BlockQuantArgs), written as dtype.
struct BlockDequantArgs {
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0, cols = 0;
  int32_t block_rows = 32, block_cols = 32;
  void* y = nullptr;
  DType dtype = DType::f32;
};

// mask[c] = 1 if any |x[r][c]| >= threshold (NaN never counts), else 0.
struct OutlierArgs {
  const void* x = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  float threshold = 6.0f;
  uint8_t* mask = nullptr;  // cols bytes
};

// out[i][j] = epilogue(acc[i][j]) with row scale row_scale[(i / row_group) * row_stride] and column
// scale col_scale[(j / col_group) * col_stride]: groups of 1 for LLM.int8's vector-wise scales, groups
// of the block size (and the stride of one block column/row) for one K-slice of a per-block GEMM.
struct EpilogueArgs {
  const int32_t* acc = nullptr;  // rows * cols
  int64_t rows = 0, cols = 0;
  const float* row_scale = nullptr;
  int64_t row_group = 1, row_stride = 1;
  const float* col_scale = nullptr;
  int64_t col_group = 1, col_stride = 1;
  const float* add = nullptr;   // rows * cols float32 (LLM.int8's outlier product), or null
  const float* bias = nullptr;  // cols float32, or null
  void* out = nullptr;          // rows * cols of out_dtype
  DType out_dtype = DType::f32;
  bool accumulate = false;      // out += value (out_dtype must be f32): per-block K-slices
};

// C (m x n, int32, row-major) = A (m x k, int8, row-major) * B, where B is given as b_rows-major:
// b_trans = true means B is stored as n x k row-major (a weight matrix, C = A W^T).
struct GemmArgs {
  const int8_t* a = nullptr;
  const int8_t* b = nullptr;
  int32_t* c = nullptr;
  int64_t m = 0, n = 0, k = 0;
  bool b_trans = true;
};

// Per-block int8 product (Jetfire): A (m x k) and B (k x n) quantized in block x block tiles, one scale
// per tile. With slices s = [s*block, min(k, (s+1)*block)) of the reduction axis,
//   out[i][j] = sum over s ascending of float(sum_{k in s} A[i][k] B[k][j]) * (sA[i/block][s] * sB[s][j/block])
// accumulated by int8_block_accumulate from 0.0f, then + bias[j] (if given), stored as out_dtype by
// dtype_store. Each operand comes with the scales int8_block_quant made for it as stored (row-major):
//   A stored m x k: a_scale ceil(m/block) x ceil(k/block); a_trans, A stored k x m: ceil(k/block) x ceil(m/block)
//   b_trans, B stored n x k (a weight): b_scale ceil(n/block) x ceil(k/block); else k x n: ceil(k/block) x ceil(n/block)
// so the three products of a linear layer (X W^T, dY W, dY^T X) take the stored tensors without copies.
struct BlockGemmArgs {
  const int8_t* a = nullptr;
  const float* a_scale = nullptr;
  bool a_trans = false;
  const int8_t* b = nullptr;
  const float* b_scale = nullptr;
  bool b_trans = true;
  int64_t m = 0, n = 0, k = 0;
  int32_t block = 32;
  const float* bias = nullptr;  // n float32, or null
  void* out = nullptr;          // m x n of out_dtype, row-major
  DType out_dtype = DType::f32;
};

// ---- variants: single-threaded over the whole range given ----
void int8_row_quant_ref(const RowQuantArgs& a);
void int8_row_quant_avx2(const RowQuantArgs& a);
void int8_row_quant_avx512(const RowQuantArgs& a);
void int8_col_quant_ref(const ColQuantArgs& a);
void int8_col_quant_avx2(const ColQuantArgs& a);
void int8_col_quant_avx512(const ColQuantArgs& a);
void int8_block_quant_ref(const BlockQuantArgs& a);
void int8_block_quant_avx2(const BlockQuantArgs& a);
void int8_block_quant_avx512(const BlockQuantArgs& a);
void int8_block_dequant_ref(const BlockDequantArgs& a);
void int8_block_dequant_avx2(const BlockDequantArgs& a);
void int8_block_dequant_avx512(const BlockDequantArgs& a);
int64_t int8_col_outliers_ref(const OutlierArgs& a);  // returns the number of outlier columns
int64_t int8_col_outliers_avx2(const OutlierArgs& a);
int64_t int8_col_outliers_avx512(const OutlierArgs& a);
void int8_epilogue_ref(const EpilogueArgs& a);
void int8_epilogue_avx2(const EpilogueArgs& a);
void int8_epilogue_avx512(const EpilogueArgs& a);
// Reference GEMM (int32 accumulation, exact): for tests and builds without a GEMM library. Slow.
void int8_gemm_ref(const GemmArgs& a);
// Per-block product, the definition written directly (one output at a time), for output rows
// [row_begin, row_end) (row_end < 0: m). Slow.
void int8_block_gemm_ref(const BlockGemmArgs& a, int64_t row_begin = 0, int64_t row_end = -1);
// Per-block product with AVX-512 VNNI (vpdpbusd), operands packed once per call, OpenMP over output tiles
// (threads = 0: OpenMP default). Needs int8_block_gemm_vnni_supported(); k >= 1.
void int8_block_gemm_vnni(const BlockGemmArgs& a, int threads);
// This CPU, OS and build can run int8_block_gemm_vnni (AVX-512 F/BW/DQ/VL plus AVX512_VNNI).
bool int8_block_gemm_vnni_supported();

// ---- dispatching entry points: the Isa's variant, OpenMP over rows / row blocks / column chunks
// (threads = 0: OpenMP default, one thread for small inputs). Results do not depend on the thread
// count (stochastic draws are indexed by element, not by thread).
void int8_row_quant(const RowQuantArgs& a, Isa isa, int threads = 0);
void int8_col_quant(const ColQuantArgs& a, Isa isa, int threads = 0);
void int8_block_quant(const BlockQuantArgs& a, Isa isa, int threads = 0);
void int8_block_dequant(const BlockDequantArgs& a, Isa isa, int threads = 0);
int64_t int8_col_outliers(const OutlierArgs& a, Isa isa, int threads = 0);
void int8_epilogue(const EpilogueArgs& a, Isa isa, int threads = 0);
// Per-block product: the VNNI kernel when isa is avx512 (or a superset) and the CPU has AVX512_VNNI, else
// the reference (OpenMP over rows). Bit-identical either way.
void int8_block_gemm(const BlockGemmArgs& a, Isa isa, int threads = 0);
// What int8_block_gemm runs for this isa: "avx512-vnni" or "reference".
const char* int8_block_gemm_variant(Isa isa);

#if ZERO8_WITH_CUDA
// CUDA kernels over device pointers, queued on `stream` (a cudaStream_t; null: default stream).
// int8_col_outliers_cuda writes the mask only (count it on the host if needed).
void int8_row_quant_cuda(const RowQuantArgs& a, void* stream);
void int8_col_quant_cuda(const ColQuantArgs& a, void* stream);
void int8_block_quant_cuda(const BlockQuantArgs& a, void* stream);
void int8_block_dequant_cuda(const BlockDequantArgs& a, void* stream);
void int8_col_outliers_cuda(const OutlierArgs& a, void* stream);
void int8_epilogue_cuda(const EpilogueArgs& a, void* stream);
// cuBLASLt int8 GEMM (int32 accumulation, CUBLAS_COMPUTE_32I) on device pointers. Throws
// zero8::Error (internal) with the cuBLAS status on failure.
void int8_gemm_cublaslt(const GemmArgs& a, void* stream);
// Per-block product on device pointers (kernels/cuda/int8_blockwise.cu), same contract and rounding as
// int8_block_gemm_ref.
void int8_block_gemm_cuda(const BlockGemmArgs& a, void* stream);
// Which kernel int8_block_gemm_cuda runs for this block: "wmma" (tensor cores; blocks that are multiples of
// 16) or "tiled" (CUDA cores).
const char* int8_block_gemm_cuda_variant(int32_t block);
#endif

}  // namespace zero8::int8
