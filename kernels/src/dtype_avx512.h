// dtype_load / dtype_store (hd.h) for 16 lanes with AVX-512, shared by the AVX-512 codec, optimizer and
// int8 kernels: exact widening loads (bf16 is the upper half of a float, fp16 via F16C) and rounding
// stores (bf16 to nearest even with quiet NaN, fp16 by vcvtps2ph, which rounds to nearest even with the
// same NaN and overflow results as f32_to_f16). Internal linkage (anonymous namespace), as optim_simd.h
// explains: each AVX-512 translation unit keeps its own copy, compiled with its own -m flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "zero8/kernels/hd.h"

namespace zero8 {
namespace {

inline __mmask16 tail_mask(int32_t count) { return __mmask16((1u << count) - 1u); }

// 16 elements of dtype D as float32; the masked form reads only the lanes in m (others are 0).
template <DType D>
inline __m512 load16(const void* p, int64_t i) {
  if constexpr (D == DType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}
template <DType D>
inline __m512 load16_masked(const void* p, int64_t i, __mmask16 m) {
  if constexpr (D == DType::f32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
    if constexpr (D == DType::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}
// load16 for a dtype known at run time.
inline __m512 load16(const void* p, DType t, int64_t i) {
  if (t == DType::f32) return load16<DType::f32>(p, i);
  if (t == DType::bf16) return load16<DType::bf16>(p, i);
  return load16<DType::f16>(p, i);
}

// float32 -> bfloat16 bits in the low half of each lane, as f32_to_bf16: round to nearest even,
// NaN kept quiet.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

// 16 float32 values as 16-bit dtype D (bf16 or f16) bits.
template <DType D>
inline __m256i to_half16(__m512 v) {
  static_assert(D != DType::f32, "16-bit dtypes only");
  if constexpr (D == DType::bf16) return to_bf16(v);
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Store 16 float32 values as dtype D: plain or, with kStream, streaming (the address is then aligned to
// the store's size); or masked to the lanes in m.
template <DType D, bool kStream = false>
inline void store16(void* p, int64_t i, __m512 v) {
  if constexpr (D == DType::f32 && kStream)
    _mm512_stream_ps(static_cast<float*>(p) + i, v);
  else if constexpr (D == DType::f32)
    _mm512_storeu_ps(static_cast<float*>(p) + i, v);
  else if constexpr (kStream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), to_half16<D>(v));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), to_half16<D>(v));
}
template <DType D>
inline void store16_masked(void* p, int64_t i, __m512 v, __mmask16 m) {
  if constexpr (D == DType::f32)
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, to_half16<D>(v));
}
// store16 for a dtype known at run time.
inline void store16(void* p, DType t, int64_t i, __m512 v) {
  if (t == DType::f32) return store16<DType::f32>(p, i, v);
  if (t == DType::bf16) return store16<DType::bf16>(p, i, v);
  store16<DType::f16>(p, i, v);
}

}  // namespace
}  // namespace zero8
