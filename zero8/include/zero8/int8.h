// Int8 linear layers, validated C++ API (no torch): absmax int8 quantization by rows, columns and 2-D
// blocks (LLM.int8 vector-wise and outlier columns; Jetfire per-block with stochastic rounding), the
// int8 GEMM (oneDNN when built with it, else a scalar reference) and its dequantizing epilogue, and the
// fused per-block (Jetfire) int8 product.
// Every entry checks its arguments once and throws zero8::Error naming the bad one; the work runs on the
// active CPU variant (isa_active) across OpenMP threads. The math is defined in zero8/kernels/int8.h.
#pragma once

#include <cstdint>
#include <string>

#include "zero8/kernels/hd.h"
#include "zero8/kernels/int8.h"

namespace zero8::int8 {

struct Int8QuantOptions {
  bool stochastic = false;  // floor(x / scale + u), u = rng_uniform(seed, index_base + element index)
  uint64_t seed = 0;
  uint64_t index_base = 0;
  int threads = 0;          // OpenMP threads; 0: OpenMP default (one thread for small inputs)
};

// Number of per-block scales of a rows x cols matrix: ceil(rows / block_rows) * ceil(cols / block_cols).
int64_t int8_block_count(int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols);

// x: rows x cols of dtype, row-major. q: rows x cols int8; scale: rows floats. col_mask (optional, cols
// bytes): nonzero columns are left out of the scale and get code 0.
void int8_quantize_rows(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                        const uint8_t* col_mask = nullptr, const Int8QuantOptions& opt = {});
// One scale per column (scale: cols floats); q keeps x's layout.
void int8_quantize_cols(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                        const Int8QuantOptions& opt = {});
// Per block of block_rows x block_cols (each 1..65536); scale: int8_block_count(...) floats, row-major.
void int8_quantize_blocks(const void* x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows,
                          int32_t block_cols, int8_t* q, float* scale, const Int8QuantOptions& opt = {});
// y = q * scale of its block, written as dtype.
void int8_dequantize_blocks(const int8_t* q, const float* scale, int64_t rows, int64_t cols, int32_t block_rows,
                            int32_t block_cols, void* y, DType dtype, int threads = 0);
// mask[c] = 1 where any |x[r][c]| >= threshold (threshold > 0; +inf finds none). Returns the count.
int64_t int8_outlier_columns(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold, uint8_t* mask,
                             int threads = 0);
// The epilogue of an int32 GEMM (see EpilogueArgs): scales, optional add matrix and bias, output dtype,
// optional accumulation into a float32 output.
void int8_dequantize_matmul(const EpilogueArgs& args, int threads = 0);

// C (m x n int32) = A (m x k int8) * B, B given as n x k (b_trans, a weight matrix) or k x n, all
// row-major and contiguous; k <= 131071 so no int32 sum can overflow. Runs oneDNN's int8 matmul when
// zero8 was built with it, else the scalar reference (correct, slow).
void int8_gemm(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans = true);
// What int8_gemm runs: "onednn <version> (<oneDNN ISA>[, no VNNI: ...])" or "reference". Exact on every
// CPU: without VNNI, where oneDNN's int8 kernels saturate, the weights are split into two 7-bit products.
std::string int8_gemm_backend();

// The per-block int8 product of Jetfire (BlockGemmArgs in zero8/kernels/int8.h: A m x k, B k x n, each
// stored either way with the per-block scales int8_quantize_blocks made for it as stored; block 1..65536;
// optional float32 bias; output m x n row-major float32, bfloat16 or float16). Per reduction slice the
// int32 dot product is exact and is dequantized and accumulated in float32 by int8_block_accumulate, so
// every backend gives the same bits. Runs the AVX-512 VNNI kernel when the active CPU variant is avx512
// and the CPU has AVX512_VNNI, else the scalar reference (correct, slow); threads as Int8QuantOptions.
// The VNNI kernel keeps its packing workspace (about (m + n) * k bytes) for the calling thread's next
// call: fresh pages cost more than the packing (docs/INT8.md); it is freed when the thread exits.
void int8_block_matmul(const BlockGemmArgs& args, int threads = 0);
// "avx512-vnni" or "reference": what int8_block_matmul runs.
std::string int8_block_matmul_backend();
// What int8_block_matmul_cuda runs for this block: "wmma" (tensor cores, blocks that are multiples of 16)
// or "tiled" (CUDA cores). Throws ErrorCode::unsupported when zero8 was built without CUDA.
std::string int8_block_matmul_cuda_backend(int32_t block);

// CUDA (device pointers, queued on `stream`, a cudaStream_t or null). Throw ErrorCode::unsupported
// when zero8 was built without CUDA.
void int8_quantize_rows_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                             const uint8_t* col_mask = nullptr, const Int8QuantOptions& opt = {},
                             void* stream = nullptr);
void int8_quantize_cols_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                             const Int8QuantOptions& opt = {}, void* stream = nullptr);
void int8_quantize_blocks_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows,
                               int32_t block_cols, int8_t* q, float* scale, const Int8QuantOptions& opt = {},
                               void* stream = nullptr);
void int8_dequantize_blocks_cuda(const int8_t* q, const float* scale, int64_t rows, int64_t cols, int32_t block_rows,
                                 int32_t block_cols, void* y, DType dtype, void* stream = nullptr);
void int8_outlier_columns_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold,
                               uint8_t* mask, void* stream = nullptr);
void int8_dequantize_matmul_cuda(const EpilogueArgs& args, void* stream = nullptr);
// Per-block int8 product on device pointers (kernels/cuda/int8_blockwise.cu), same contract and bits as
// int8_block_matmul.
void int8_block_matmul_cuda(const BlockGemmArgs& args, void* stream = nullptr);
// cuBLASLt int8 GEMM (IMMA, the "TN" form): the result of int8_gemm with b_trans = true only; k and n
// multiples of 4 and a, b 4-byte aligned (cuBLASLt's requirements; anything else throws zero8::Error
// naming the argument); k = 0 gives zeros. Compiled here, never run on a GPU.
void int8_gemm_cuda(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans = true,
                    void* stream = nullptr);

}  // namespace zero8::int8
