// dtype_load / dtype_store (hd.h) for 8 lanes with AVX2 and F16C, shared by the AVX2 codec, optimizer
// and int8 kernels: exact widening loads (bf16 is the upper half of a float, fp16 via F16C) and rounding
// stores (bf16 to nearest even with quiet NaN, fp16 by vcvtps2ph, which rounds to nearest even with the
// same NaN and overflow results as f32_to_f16). Internal linkage (anonymous namespace), as optim_simd.h
// explains: each AVX2 translation unit keeps its own copy, compiled with its own -m flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "zero8/kernels/hd.h"

namespace zero8 {
namespace {

// 8 elements of dtype D as float32.
template <DType D>
inline __m256 load8(const void* p, int64_t i) {
  if constexpr (D == DType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
}
// load8 for a dtype known at run time.
inline __m256 load8(const void* p, DType t, int64_t i) {
  if (t == DType::f32) return load8<DType::f32>(p, i);
  if (t == DType::bf16) return load8<DType::bf16>(p, i);
  return load8<DType::f16>(p, i);
}

// float32 -> bfloat16 as f32_to_bf16 (round to nearest even, NaN kept quiet), 8 results as uint16.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  // |u| > 0x7f800000 as signed compare: the masked value is non-negative.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // values <= 0xffff
}

// Store 8 float32 values as dtype D.
template <DType D>
inline void store8(void* p, int64_t i, __m256 v) {
  if constexpr (D == DType::f32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  } else {
    const __m128i h = D == DType::bf16 ? to_bf16(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}
// store8 for a dtype known at run time.
inline void store8(void* p, DType t, int64_t i, __m256 v) {
  if (t == DType::f32) return store8<DType::f32>(p, i, v);
  if (t == DType::bf16) return store8<DType::bf16>(p, i, v);
  store8<DType::f16>(p, i, v);
}

}  // namespace
}  // namespace zero8
