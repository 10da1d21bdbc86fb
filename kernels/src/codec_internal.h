// Per-ISA single-block helpers shared by the codec variants and the fused optimizers: encode one
// block of fp32 values already in memory (the optimizers' freshly updated states) and decode one.
// Internal to zero8_kernels.
#pragma once

#include <cstdint>

#include "zero8/kernels/quant_map.h"

namespace zero8::quant {

// Nearest-rounding encode of len <= 4096 fp32 values: writes len codes, returns the block scale.
float quant_block_encode_f32_ref(const float* x, int32_t len, const QuantTable& t, uint8_t* codes);
float quant_block_encode_f32_avx2(const float* x, int32_t len, const QuantTable& t, uint8_t* codes);
float quant_block_encode_f32_avx512(const float* x, int32_t len, const QuantTable& t, uint8_t* codes);
float quant_block_encode_f32_avx512vbmi(const float* x, int32_t len, const QuantTable& t, uint8_t* codes);

// y[i] = values[codes[i]] * scale for len <= 4096 elements.
void quant_block_decode_f32_ref(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y);
void quant_block_decode_f32_avx2(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y);
void quant_block_decode_f32_avx512(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y);
void quant_block_decode_f32_avx512vbmi(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y);

}  // namespace zero8::quant
