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
// The device copy of a standard map's table: table_get_device (zero8/kernels/quant_map.h).

}  // namespace zero8::quant
