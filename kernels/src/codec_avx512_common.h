// AVX-512 helpers shared by the codec's avx512 and avx512vbmi translation units and the avx512vbmi
// optimizers: the block extremes and scale, and the blocking constants (dtype loads and stores: dtype_avx512.h).
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

// The running extremes of float values, kept on their bit patterns with integer maxima (any vector pipe,
// where float min/max compete with the float adds): the signed maximum is the largest value (or +0, its
// start), the unsigned maximum the most negative value when there is one; a NaN or an infinity shows as
// bits at or above those of +inf (signed) or -inf (unsigned). Masked-off lanes (+0) change nothing.
struct BitExtremes {
  __m512i smax = _mm512_setzero_si512(), umax = _mm512_setzero_si512();
  void add(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    smax = _mm512_max_epi32(smax, b);
    umax = _mm512_max_epu32(umax, b);
  }
  void add(const BitExtremes& o) {
    smax = _mm512_max_epi32(smax, o.smax);
    umax = _mm512_max_epu32(umax, o.umax);
  }
  // quant_block_scale of the values: NaN if one is NaN or infinite, otherwise from their min and max with
  // +0 starts, as the reference's std::min/max (a -0 never enters them).
  float scale(const QuantTable& t) const {
    const uint32_t hi = uint32_t(_mm512_reduce_max_epi32(smax)), lo = uint32_t(_mm512_reduce_max_epu32(umax));
    if (hi >= 0x7f800000u || lo >= 0xff800000u) return f32_from_bits(0x7fc00000u);
    return block_scale_finite(lo > 0x80000000u ? f32_from_bits(lo) : 0.0f, f32_from_bits(hi), t);
  }
};

// Scale of one block (elements [off, off + len) of x), two accumulators deep.
template <DType D>
inline float block_scale(const void* x, int64_t off, int32_t len, const QuantTable& t) {
  BitExtremes r0, r1;
  int32_t i = 0;
  for (; i + 32 <= len; i += 32) {
    r0.add(load16<D>(x, off + i));
    r1.add(load16<D>(x, off + i + 16));
  }
  for (; i < len; i += 16)
    r0.add(i + 16 <= len ? load16<D>(x, off + i) : load16_masked<D>(x, off + i, tail_mask(len - i)));
  r0.add(r1);
  return r0.scale(t);
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
