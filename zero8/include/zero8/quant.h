// Block-wise 8-bit quantization, validated: a flat tensor of n elements (fp32, bf16 or fp16) cut into
// blocks of `block` elements, each stored as `block` uint8 codes plus one float32 scale (signed
// absmax, see quant_block_scale). Every entry validates its arguments once and throws zero8::Error
// naming the bad one; the work runs on the active CPU variant (isa_active) across OpenMP threads.
#pragma once

#include <cstdint>
#include <vector>

#include "zero8/kernels/hd.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::quant {

// Number of blocks (= scales) for n elements: ceil(n / block).
int64_t quant_num_blocks(int64_t n, int32_t block);
// Bytes of the quantized form: n codes + 4 bytes per block.
int64_t quant_bytes(int64_t n, int32_t block);

struct QuantizeOptions {
  bool stochastic = false;   // stochastic rounding with rng_uniform(seed, index_base + i)
  uint64_t seed = 0;
  uint64_t index_base = 0;   // global index of element 0, so a tensor split in pieces rounds as a whole
  int threads = 0;           // OpenMP threads; 0: OpenMP default (one thread for small tensors)
};

// codes: n bytes; absmax: quant_num_blocks(n, block) floats (4-byte aligned); x: n elements of
// dtype (aligned to its element size). block: a power of two in 64..4096. Pointers may be null
// only when n == 0.
void quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block, const QuantTable& table,
                        uint8_t* codes, float* absmax, const QuantizeOptions& opt = {});
void quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block, MapKind map, uint8_t* codes,
                        float* absmax, const QuantizeOptions& opt = {});

// y = decode (or y += decode with accumulate, which needs dtype f32: the reduce side of collectives).
void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int32_t block,
                          const QuantTable& table, void* y, DType dtype, bool accumulate = false, int threads = 0);
void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int32_t block, MapKind map,
                          void* y, DType dtype, bool accumulate = false, int threads = 0);

// Rows: `rows` tensors of `row` elements each, back to back, each cut into blocks of its own (its last
// block partial when `block` does not divide `row`): the codes and scales of one quantize_blockwise per
// row, in one call (one kernel launch on the device; the pieces of a collective, one per rank).
// codes: rows * row bytes; absmax: rows * quant_num_blocks(row, block) floats, row r's from
// r * quant_num_blocks(row, block) on. Stochastic rounding numbers the elements across the rows
// (element i of row r is index_base + r * row + i).
void quantize_blockwise_rows(const void* x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind map,
                             uint8_t* codes, float* absmax, const QuantizeOptions& opt = {});
// y = the rows' decodes (rows * row elements of dtype); with sum, the rows' decodes added element by
// element in row order, ((r0 + r1) + r2) ..., into `row` float32 values (after y itself with accumulate:
// the reduce side of an all-to-all, every rank summing in the same order).
void dequantize_blockwise_rows(const uint8_t* codes, const float* absmax, int64_t rows, int64_t row, int32_t block,
                               MapKind map, void* y, DType dtype, bool sum = false, bool accumulate = false,
                               int threads = 0);

// An owning quantized tensor (for tests, tools and small users; the hot paths use the raw entries).
struct Blockwise {
  int64_t n = 0;
  int32_t block = 2048;
  MapKind map = MapKind::dynamic_signed;
  std::vector<uint8_t> codes;
  std::vector<float> absmax;

  int64_t bytes() const { return quant_bytes(n, block); }
};
Blockwise quantize_blockwise(const void* x, DType dtype, int64_t n, int32_t block,
                             MapKind map = MapKind::dynamic_signed, const QuantizeOptions& opt = {});
std::vector<float> dequantize_blockwise(const Blockwise& q, int threads = 0);
void dequantize_blockwise(const Blockwise& q, void* y, DType dtype, bool accumulate = false, int threads = 0);

// CUDA: x, codes, absmax and y are device pointers; the work is queued on `stream` (a cudaStream_t,
// null for the default stream) and the call returns without waiting. The table is the device copy
// of a standard map (cached per device) or, in the QuantTable overloads, a device-visible table.
// Throws ErrorCode::unsupported when zero8 was built without CUDA.
void quantize_blockwise_cuda(const void* x, DType dtype, int64_t n, int32_t block, MapKind map, uint8_t* codes,
                             float* absmax, const QuantizeOptions& opt = {}, void* stream = nullptr);
void quantize_blockwise_cuda(const void* x, DType dtype, int64_t n, int32_t block, const QuantTable* device_table,
                             uint8_t* codes, float* absmax, const QuantizeOptions& opt = {}, void* stream = nullptr);
void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t n, int32_t block, MapKind map,
                               void* y, DType dtype, bool accumulate = false, void* stream = nullptr);
void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t n, int32_t block,
                               const QuantTable* device_table, void* y, DType dtype, bool accumulate = false,
                               void* stream = nullptr);
// The rows entries on device pointers (see quantize_blockwise_rows / dequantize_blockwise_rows).
void quantize_blockwise_rows_cuda(const void* x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind map,
                                  uint8_t* codes, float* absmax, const QuantizeOptions& opt = {},
                                  void* stream = nullptr);
void dequantize_blockwise_rows_cuda(const uint8_t* codes, const float* absmax, int64_t rows, int64_t row,
                                    int32_t block, MapKind map, void* y, DType dtype, bool sum = false,
                                    bool accumulate = false, void* stream = nullptr);
// The device copy of a standard map's table: table_get_device (zero8/kernels/quant_map.h).

}  // namespace zero8::quant
