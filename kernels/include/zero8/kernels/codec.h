// Block-wise codec kernels: a flat tensor cut into blocks of `block` elements, each stored as
// `block` uint8 codes plus one float32 scale ("absmax", signed, see quant_block_scale).
// These are raw kernels: arguments are validated by the API in zero8/quant.h, not here.
#pragma once

#include <cstdint>

#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::quant {

struct EncodeArgs {
  const void* x = nullptr;         // n elements of dtype
  DType dtype = DType::f32;
  int64_t n = 0;                   // elements; the last block may be partial
  int32_t block = 256;             // power of two, 64..4096
  const QuantTable* table = nullptr;
  uint8_t* codes = nullptr;        // n codes
  float* absmax = nullptr;         // ceil(n / block) scales
  bool stochastic = false;         // stochastic rounding with rng_uniform(seed, index_base + i)
  uint64_t seed = 0;
  uint64_t index_base = 0;         // global index of element 0 (so a split tensor rounds as a whole)
  int64_t row = 0;                 // > 0: n / row rows of `row` elements, each cut into blocks of its own
                                   // (ceil(row / block) scales per row); 0: one row of n
};

struct DecodeArgs {
  const uint8_t* codes = nullptr;
  const float* absmax = nullptr;
  int64_t n = 0;
  int32_t block = 256;
  const QuantTable* table = nullptr;
  void* y = nullptr;               // n elements of dtype
  DType dtype = DType::f32;
  bool accumulate = false;         // y += decode (dtype must be f32): the reduce side of collectives
  int64_t row = 0;                 // > 0: n / row rows, blocked as EncodeArgs::row; 0: one row of n
  bool sum_rows = false;           // with row > 0: y holds `row` float32 values, the rows' decodes summed
                                   // in row order (((r0 + r1) + r2) ...; after y itself with accumulate)
};

// Single-threaded variants over the whole range given (blocks [0, ceil(n/block))).
void quant_encode_ref(const EncodeArgs& a);
void quant_decode_ref(const DecodeArgs& a);
void quant_encode_avx2(const EncodeArgs& a);
void quant_decode_avx2(const DecodeArgs& a);
void quant_encode_avx512(const EncodeArgs& a);
void quant_decode_avx512(const DecodeArgs& a);
void quant_encode_avx512vbmi(const EncodeArgs& a);
void quant_decode_avx512vbmi(const DecodeArgs& a);

// The variants above take one row (row == 0). The entry points below take rows too: row by row on the
// CPU, in one launch on the device.
// Dispatching entry points: the active ISA variant, OpenMP across blocks (threads = 0: OpenMP default).
void quant_encode(const EncodeArgs& a, Isa isa, int threads = 0);
void quant_decode(const DecodeArgs& a, Isa isa, int threads = 0);

#if ZERO8_WITH_CUDA
// CUDA kernels over device pointers (table must be device-visible); asynchronous on `stream`.
void quant_encode_cuda(const EncodeArgs& a, void* stream);
void quant_decode_cuda(const DecodeArgs& a, void* stream);
#endif

}  // namespace zero8::quant
