// AVX-512 helpers shared by the codec's avx512 and avx512vbmi translation units: dtype loads and stores
// of 16 lanes, the block scale, and the blocking constants. Internal linkage only (an anonymous
// namespace): each TU keeps its own copy, compiled with its own -m flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "zero8/kernels/codec.h"

namespace zero8::quant {
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

// Store 16 float32 values as dtype D (F16C rounds to nearest even exactly as f32_to_f16).
template <DType D>
inline void store16_masked(void* p, int64_t i, __m512 v, __mmask16 m) {
  if constexpr (D == DType::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v);
  } else {
    const __m256i h = D == DType::bf16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, h);
  }
}
template <DType D>
inline void store16(void* p, int64_t i, __m512 v) {
  if constexpr (D == DType::f32) {
    _mm512_storeu_ps(static_cast<float*>(p) + i, v);
  } else {
    const __m256i h = D == DType::bf16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// store16 with streaming stores (the address is aligned to the store's size).
template <DType D>
inline void store16_stream(void* p, int64_t i, __m512 v) {
  if constexpr (D == DType::f32) {
    _mm512_stream_ps(static_cast<float*>(p) + i, v);
  } else {
    const __m256i h = D == DType::bf16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// quant_block_scale of a block of finite values (vmin <= 0 <= vmax) without a branch on the data: the
// sign of the block's extreme element is as good as random, and a mispredicted branch there would
// discard the work already issued past it. Same selection, same negation (a sign flip).
inline float block_scale_finite(float vmin, float vmax, const QuantTable& t) {
  const __m128 lo = _mm_set_ss(vmin), hi = _mm_set_ss(vmax);
  const __m128 neg = _mm_xor_ps(lo, _mm_set_ss(-0.0f));  // -vmin
  const __m128 other = t.has_neg_one ? neg : lo;          // fixed per map: predictable
  return _mm_cvtss_f32(_mm_mask_mov_ps(other, _mm_cmp_ss_mask(hi, neg, _CMP_GE_OQ), hi));
}

// Scale of one block (elements [off, off + len) of x): min/max with +0 accumulators as the reference's
// std::min/max (the accumulator is the second operand, so zeros and NaN never replace it), and an
// exponent check for non-finite values.
template <DType D>
inline float block_scale(const void* x, int64_t off, int32_t len, const QuantTable& t) {
  __m512 vmin0 = _mm512_setzero_ps(), vmax0 = vmin0, vmin1 = vmin0, vmax1 = vmin0;
  __m512i abits = _mm512_setzero_si512();
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  int32_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m512 v0 = load16<D>(x, off + i), v1 = load16<D>(x, off + i + 16);
    vmin0 = _mm512_min_ps(v0, vmin0);
    vmax0 = _mm512_max_ps(v0, vmax0);
    vmin1 = _mm512_min_ps(v1, vmin1);
    vmax1 = _mm512_max_ps(v1, vmax1);
    abits = _mm512_max_epu32(abits, _mm512_and_si512(_mm512_castps_si512(v0), absmask));
    abits = _mm512_max_epu32(abits, _mm512_and_si512(_mm512_castps_si512(v1), absmask));
  }
  for (; i < len; i += 16) {
    const __m512 v = i + 16 <= len ? load16<D>(x, off + i) : load16_masked<D>(x, off + i, tail_mask(len - i));
    vmin0 = _mm512_min_ps(v, vmin0);
    vmax0 = _mm512_max_ps(v, vmax0);
    abits = _mm512_max_epu32(abits, _mm512_and_si512(_mm512_castps_si512(v), absmask));
  }
  if (_mm512_reduce_max_epu32(abits) >= 0x7f800000u) return f32_from_bits(0x7fc00000u);
  // Lanes hold +0 or negative (resp. positive) values only, never -0 or NaN: any reduction order agrees.
  const float vmin = _mm512_reduce_min_ps(_mm512_min_ps(vmin1, vmin0));
  const float vmax = _mm512_reduce_max_ps(_mm512_max_ps(vmax1, vmax0));
  return block_scale_finite(vmin, vmax, t);
}

// Blocks are taken in groups of about 2048 elements: first every scale of the group, then every
// code, so that a small block's codes need not wait for the reduction of its own scale.
constexpr int64_t kGroupElements = 2048;

// Decoded outputs of at least this many bytes per call are written with streaming stores (no read of the
// destination lines, no eviction of the working set), as memcpy does for copies beyond the caches.
constexpr int64_t kStreamBytes = int64_t(8) << 20;

[[maybe_unused]] bool map_has_zero(const QuantTable& t) { return t.values[t.zero_code] == 0.0f; }

[[maybe_unused]] bool map_strictly_increasing(const QuantTable& t) {
  for (int i = 0; i < 255; ++i)
    if (!(t.values[i] < t.values[i + 1])) return false;
  return true;
}

}  // namespace
}  // namespace zero8::quant
