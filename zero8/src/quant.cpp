// The validated block-wise quantization API: checks every argument once, then runs the codec kernels
// (the active CPU variant with OpenMP, or the CUDA kernels on device pointers).
#include "zero8/quant.h"

#include <cmath>
#include <cstdint>

#include "arg_checks.h"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"

namespace zero8::quant {
namespace {

void check_block(int32_t block) {
  ZERO8_CHECK_ARG(block >= 64 && block <= 4096 && (block & (block - 1)) == 0, "block",
                  "must be a power of two in 64..4096, got " << block);
}

void check_common(int64_t n, int32_t block, DType dtype, const QuantTable* table) {
  ZERO8_CHECK_ARG(n >= 0, "n", "must be >= 0, got " << n);
  check_block(block);
  check_dtype(dtype, "dtype");
  ZERO8_CHECK_ARG(table != nullptr, "table", "null table");
}

// A host table must come from table_build (its last threshold is +inf); device tables are not read here.
void check_host_table(const QuantTable& t) {
  ZERO8_CHECK_ARG(std::isinf(t.thresholds[255]) && t.thresholds[255] > 0.0f, "table",
                  "not a table built by table_build");
}

EncodeArgs encode_args(const void* x, DType dtype, int64_t n, int32_t block, const QuantTable* table,
                       uint8_t* codes, float* absmax, const QuantizeOptions& opt) {
  check_common(n, block, dtype, table);
  check_ptr(x, "x", n, dtype_size(dtype));
  check_ptr(codes, "codes", n, 1);
  check_ptr(absmax, "absmax", quant_num_blocks(n, block), 4);
  check_threads(opt.threads);
  EncodeArgs a;
  a.x = x;
  a.dtype = dtype;
  a.n = n;
  a.block = block;
  a.table = table;
  a.codes = codes;
  a.absmax = absmax;
  a.stochastic = opt.stochastic;
  a.seed = opt.seed;
  a.index_base = opt.index_base;
  return a;
}

DecodeArgs decode_args(const uint8_t* codes, const float* absmax, int64_t n, int32_t block, const QuantTable* table,
                       void* y, DType dtype, bool accumulate, int threads) {
  check_common(n, block, dtype, table);
  check_ptr(codes, "codes", n, 1);
  check_ptr(absmax, "absmax", quant_num_blocks(n, block), 4);
  check_ptr(y, "y", n, dtype_size(dtype));
  ZERO8_CHECK_ARG(!accumulate || dtype == DType::f32, "accumulate",
                  "needs a float32 output, got " << dtype_name(dtype));
  check_threads(threads);
  DecodeArgs a;
  a.codes = codes;
  a.absmax = absmax;
  a.n = n;
  a.block = block;
  a.table = table;
  a.y = y;
  a.dtype = dtype;
  a.accumulate = accumulate;
  return a;
}

// The arguments of the rows entries: rows * row elements in one call (EncodeArgs::row, DecodeArgs::row).
int64_t rows_elements(int64_t rows, int64_t row, int32_t block) {
  check_block(block);
  ZERO8_CHECK_ARG(rows >= 0, "rows", "must be >= 0, got " << rows);
  ZERO8_CHECK_ARG(row >= 0, "row", "must be >= 0, got " << row);
  ZERO8_CHECK_ARG(rows == 0 || row <= (INT64_MAX - block) / rows, "row",
                  rows << " rows of " << row << " elements overflow 64-bit sizes");
  return rows * row;
}

EncodeArgs encode_rows_args(const void* x, DType dtype, int64_t rows, int64_t row, int32_t block,
                            const QuantTable* table, uint8_t* codes, float* absmax, const QuantizeOptions& opt) {
  const int64_t n = rows_elements(rows, row, block);
  EncodeArgs a = encode_args(x, dtype, n, block, table, codes, absmax, opt);
  check_ptr(absmax, "absmax", rows * quant_num_blocks(row, block), 4);
  a.row = row;
  return a;
}

DecodeArgs decode_rows_args(const uint8_t* codes, const float* absmax, int64_t rows, int64_t row, int32_t block,
                            const QuantTable* table, void* y, DType dtype, bool sum, bool accumulate, int threads) {
  const int64_t n = rows_elements(rows, row, block);
  ZERO8_CHECK_ARG(!sum || dtype == DType::f32, "dtype", "the rows' sum is float32, got " << dtype_name(dtype));
  ZERO8_CHECK_ARG(!sum || rows > 0 || row == 0, "rows", "a sum of rows needs one row at least, got 0");
  DecodeArgs a = decode_args(codes, absmax, n, block, table, y, dtype, accumulate, threads);
  check_ptr(absmax, "absmax", rows * quant_num_blocks(row, block), 4);
  a.row = row;
  a.sum_rows = sum;
  return a;
}

#if !ZERO8_WITH_CUDA
[[noreturn]] void cuda_unsupported() { ZERO8_THROW(unsupported, "zero8 was not built with CUDA"); }
#endif

}  // namespace

int64_t quant_num_blocks(int64_t n, int32_t block) {
  ZERO8_CHECK_ARG(n >= 0, "n", "must be >= 0, got " << n);
  check_block(block);
  return (n + block - 1) / block;
}

int64_t quant_bytes(int64_t n, int32_t block) { return n + 4 * quant_num_blocks(n, block); }

void quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block, const QuantTable& table,
                        uint8_t* codes, float* absmax, const QuantizeOptions& opt) {
  const EncodeArgs a = encode_args(x, dtype, n, block, &table, codes, absmax, opt);
  check_host_table(table);
  if (n > 0) quant_encode(a, isa_active(), opt.threads);
}

void quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block, MapKind map, uint8_t* codes,
                        float* absmax, const QuantizeOptions& opt) {
  quantize_blockwise(x, dtype, n, block, table_get(map), codes, absmax, opt);
}

void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int32_t block,
                          const QuantTable& table, void* y, DType dtype, bool accumulate, int threads) {
  const DecodeArgs a = decode_args(codes, absmax, n, block, &table, y, dtype, accumulate, threads);
  check_host_table(table);
  if (n > 0) quant_decode(a, isa_active(), threads);
}

void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int32_t block, MapKind map,
                          void* y, DType dtype, bool accumulate, int threads) {
  dequantize_blockwise(codes, absmax, n, block, table_get(map), y, dtype, accumulate, threads);
}

void quantize_blockwise_rows(const void* x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind map,
                             uint8_t* codes, float* absmax, const QuantizeOptions& opt) {
  const EncodeArgs a = encode_rows_args(x, dtype, rows, row, block, &table_get(map), codes, absmax, opt);
  if (a.n > 0) quant_encode(a, isa_active(), opt.threads);
}

void dequantize_blockwise_rows(const uint8_t* codes, const float* absmax, int64_t rows, int64_t row, int32_t block,
                               MapKind map, void* y, DType dtype, bool sum, bool accumulate, int threads) {
  const DecodeArgs a =
      decode_rows_args(codes, absmax, rows, row, block, &table_get(map), y, dtype, sum, accumulate, threads);
  if (a.n > 0) quant_decode(a, isa_active(), threads);
}

Blockwise quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block, MapKind map,
                             const QuantizeOptions& opt) {
  Blockwise q;
  q.n = n;
  q.block = block;
  q.map = map;
  q.codes.resize(size_t(n > 0 ? n : 0));
  q.absmax.resize(size_t(quant_num_blocks(n, block)));
  quantize_blockwise(x, dtype, n, block, map, q.codes.data(), q.absmax.data(), opt);
  return q;
}

void dequantize_blockwise(const Blockwise& q, void* y, DType dtype, bool accumulate, int threads) {
  ZERO8_CHECK_ARG(int64_t(q.codes.size()) == q.n && int64_t(q.absmax.size()) == quant_num_blocks(q.n, q.block), "q",
                  "holds " << q.codes.size() << " codes and " << q.absmax.size() << " scales, expected " << q.n
                           << " and " << quant_num_blocks(q.n, q.block));
  dequantize_blockwise(q.codes.data(), q.absmax.data(), q.n, q.block, q.map, y, dtype, accumulate, threads);
}

std::vector<float> dequantize_blockwise(const Blockwise& q, int threads) {
  std::vector<float> y(size_t(q.n > 0 ? q.n : 0));
  dequantize_blockwise(q, y.data(), DType::f32, false, threads);
  return y;
}

// ---- CUDA ----

void quantize_blockwise_cuda(const void* x, DType dtype, int64_t n, int32_t block, const QuantTable* device_table,
                             uint8_t* codes, float* absmax, const QuantizeOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  const EncodeArgs a = encode_args(x, dtype, n, block, device_table, codes, absmax, opt);
  if (n > 0) quant_encode_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)n, (void)block, (void)device_table, (void)codes, (void)absmax, (void)opt, (void)stream;
  cuda_unsupported();
#endif
}

void quantize_blockwise_cuda(const void* x, DType dtype, int64_t n, int32_t block, MapKind map, uint8_t* codes,
                             float* absmax, const QuantizeOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  encode_args(x, dtype, n, block, &table_get(map), codes, absmax, opt);  // bad arguments before device errors
#endif
  quantize_blockwise_cuda(x, dtype, n, block, table_get_device(map), codes, absmax, opt, stream);
}

void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t n, int32_t block,
                               const QuantTable* device_table, void* y, DType dtype, bool accumulate, void* stream) {
#if ZERO8_WITH_CUDA
  const DecodeArgs a = decode_args(codes, absmax, n, block, device_table, y, dtype, accumulate, 0);
  if (n > 0) quant_decode_cuda(a, stream);
#else
  (void)codes, (void)absmax, (void)n, (void)block, (void)device_table, (void)y, (void)dtype, (void)accumulate,
      (void)stream;
  cuda_unsupported();
#endif
}

void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t n, int32_t block, MapKind map,
                               void* y, DType dtype, bool accumulate, void* stream) {
#if ZERO8_WITH_CUDA
  decode_args(codes, absmax, n, block, &table_get(map), y, dtype, accumulate, 0);  // bad arguments first
#endif
  dequantize_blockwise_cuda(codes, absmax, n, block, table_get_device(map), y, dtype, accumulate, stream);
}

void quantize_blockwise_rows_cuda(const void* x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind map,
                                  uint8_t* codes, float* absmax, const QuantizeOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  encode_rows_args(x, dtype, rows, row, block, &table_get(map), codes, absmax, opt);  // bad arguments first
  const EncodeArgs a = encode_rows_args(x, dtype, rows, row, block, table_get_device(map), codes, absmax, opt);
  if (a.n > 0) quant_encode_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)rows, (void)row, (void)block, (void)map, (void)codes, (void)absmax, (void)opt,
      (void)stream;
  cuda_unsupported();
#endif
}

void dequantize_blockwise_rows_cuda(const uint8_t* codes, const float* absmax, int64_t rows, int64_t row,
                                    int32_t block, MapKind map, void* y, DType dtype, bool sum, bool accumulate,
                                    void* stream) {
#if ZERO8_WITH_CUDA
  decode_rows_args(codes, absmax, rows, row, block, &table_get(map), y, dtype, sum, accumulate, 0);  // bad args first
  const DecodeArgs a =
      decode_rows_args(codes, absmax, rows, row, block, table_get_device(map), y, dtype, sum, accumulate, 0);
  if (a.n > 0) quant_decode_cuda(a, stream);
#else
  (void)codes, (void)absmax, (void)rows, (void)row, (void)block, (void)map, (void)y, (void)dtype, (void)sum,
      (void)accumulate, (void)stream;
  cuda_unsupported();
#endif
}

}  // namespace zero8::quant
