// AVX-512 helpers shared by the codec's avx512 and avx512vbmi translation units and the avx512vbmi
// optimizers: the block scale and the blocking constants (dtype loads and stores: dtype_avx512.h).
// Internal linkage only (an anonymous namespace): each TU keeps its own copy, compiled with its own -m
// flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "dtype_avx512.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

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

// What the lane classes of codec_simd.h's drivers share in the avx512 and avx512vbmi codecs.
struct Avx512LanesBase {
  // Blocks are encoded in groups of about 2048 elements (see codec_simd.h).
  static constexpr int64_t kGroupElements = 2048;
  // Decoded outputs of at least this many bytes per call are written with streaming stores (no read of
  // the destination lines, no eviction of the working set), as memcpy does for copies beyond the caches.
  static constexpr int64_t kStreamBytes = int64_t(8) << 20;
  template <DType D>
  static float scale_of(const void* x, int64_t off, int32_t len, const QuantTable& t) {
    return block_scale<D>(x, off, len, t);
  }
};

}  // namespace
}  // namespace zero8::quant
