// AVX-512 variant of the block-wise codec (16 lanes). Codes, scales and decoded values are bit-identical
// to the scalar reference: the same division x / scale, the same float compares against the table's
// exact thresholds (reached through the table's bucket accelerator), the same stochastic draws.
#include <immintrin.h>

// GCC 12 flags the _mm*_undefined_*() placeholders inside its own intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstring>

#include "codec_avx512_common.h"
#include "codec_internal.h"
#include "codec_simd.h"
#include "rng_avx512.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

// quant_code_nearest for 16 lanes, as quant_code_nearest_lut computes it.
template <Search S>
inline __m512i code_nearest16(__m512 n, const QuantTable& t) {
  const __m512i one = _mm512_set1_epi32(1);
  if constexpr (S == Search::binary) {
    __m512i c = _mm512_setzero_si512();
    for (int step = 128; step > 0; step >>= 1) {
      const __m512 th = _mm512_i32gather_ps(_mm512_add_epi32(c, _mm512_set1_epi32(step - 1)), t.thresholds, 4);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(n, th, _CMP_GT_OQ), c, _mm512_set1_epi32(step));
    }
    return c;
  } else {
    const __m512i u = _mm512_castps_si512(n);
    __m512i q = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), kQuantLutShift);
    // |n| <= 1 (|x| <= |scale|, and the division rounds monotonically), so only the low end needs the
    // clamp of quant_lut_index.
    q = _mm512_max_epu32(q, _mm512_set1_epi32(kQuantLutLo));
    q = _mm512_sub_epi32(q, _mm512_set1_epi32(kQuantLutLo));
    q = _mm512_add_epi32(q, _mm512_and_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(kQuantLutHalf)));
    const __m512i e = _mm512_i32gather_epi32(q, t.lut, 4);
    __m512i c = _mm512_srli_epi32(e, 16);
    if constexpr (S == Search::packed) {
      const __m512 th = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(u, e, _mm512_set1_epi32(0xffff0000), 0xe4));
      return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(n, th, _CMP_GT_OQ), c, one);
    } else {
      for (int s = 0; s < t.lut_steps; ++s) {
        const __m512 th = _mm512_i32gather_ps(c, t.thresholds, 4);
        c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(n, th, _CMP_GT_OQ), c, one);
      }
      return c;
    }
  }
}

// values[c] for 16 codes from the table held in 16 registers: eight 32-entry two-register permutes,
// then bits 5..7 of the code pick among them (two to three times the throughput of a 16-lane gather).
struct ValueRegs {
  __m512 r[16];
  explicit ValueRegs(const QuantTable& t) {
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(t.values + 16 * k);
  }
  __m512 lookup(__m512i c) const {
    __m512 p0 = _mm512_permutex2var_ps(r[0], c, r[1]), p1 = _mm512_permutex2var_ps(r[2], c, r[3]);
    __m512 p2 = _mm512_permutex2var_ps(r[4], c, r[5]), p3 = _mm512_permutex2var_ps(r[6], c, r[7]);
    __m512 p4 = _mm512_permutex2var_ps(r[8], c, r[9]), p5 = _mm512_permutex2var_ps(r[10], c, r[11]);
    __m512 p6 = _mm512_permutex2var_ps(r[12], c, r[13]), p7 = _mm512_permutex2var_ps(r[14], c, r[15]);
    const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
    p0 = _mm512_mask_mov_ps(p0, b5, p1);
    p2 = _mm512_mask_mov_ps(p2, b5, p3);
    p4 = _mm512_mask_mov_ps(p4, b5, p5);
    p6 = _mm512_mask_mov_ps(p6, b5, p7);
    p0 = _mm512_mask_mov_ps(p0, b6, p2);
    p4 = _mm512_mask_mov_ps(p4, b6, p6);
    return _mm512_mask_mov_ps(p0, b7, p4);
  }
};

// quant_code_stochastic for 16 lanes: the reference's binary search over values (any sorted map).
inline __m512i code_stochastic16(__m512 n, __m512 u, const QuantTable& t) {
  __m512i lo = _mm512_setzero_si512();  // largest code with values[lo] <= n, as the reference searches
  for (int step = 128; step > 0; step >>= 1) {
    const __m512i c = _mm512_add_epi32(lo, _mm512_set1_epi32(step));
    const __m512 v = _mm512_i32gather_ps(c, t.values, 4);
    lo = _mm512_mask_mov_epi32(lo, _mm512_cmp_ps_mask(v, n, _CMP_LE_OQ), c);
  }
  const __m512i hi = _mm512_min_epi32(_mm512_add_epi32(lo, _mm512_set1_epi32(1)), _mm512_set1_epi32(255));
  const __m512 a = _mm512_i32gather_ps(lo, t.values, 4), b = _mm512_i32gather_ps(hi, t.values, 4);
  const __m512 p = _mm512_div_ps(_mm512_sub_ps(n, a), _mm512_sub_ps(b, a));
  __m512i c = _mm512_mask_mov_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), hi);
  c = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(n, _mm512_set1_ps(t.values[255]), _CMP_GE_OQ), _mm512_set1_epi32(255));
  return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(n, _mm512_set1_ps(t.values[0]), _CMP_GT_OQ), c);
}

// quant_code_stochastic for 16 lanes of a map with strictly increasing values, from the nearest code
// c: the largest code with values[lo] <= n is c when values[c] <= n (values[c + 1] <= n would be
// nearer) and c - 1 otherwise. One table read and register lookups instead of ten dependent gathers.
template <Search S>
inline __m512i code_stochastic16_near(__m512 n, __m512 u, const QuantTable& t, const ValueRegs& vr) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i c = code_nearest16<S>(n, t);
  // Out-of-range neighbours (c - 1 < 0, c + 1 > 255) only occur in lanes the edge rules below decide.
  const __m512 vm = vr.lookup(_mm512_sub_epi32(c, one)), v0 = vr.lookup(c), vp = vr.lookup(_mm512_add_epi32(c, one));
  const __mmask16 above = _mm512_cmp_ps_mask(v0, n, _CMP_GT_OQ);  // values[c] > n: lo = c - 1
  const __m512i lo = _mm512_mask_sub_epi32(c, above, c, one);
  const __m512 a = _mm512_mask_mov_ps(v0, above, vm), b = _mm512_mask_mov_ps(vp, above, v0);
  const __m512 p = _mm512_div_ps(_mm512_sub_ps(n, a), _mm512_sub_ps(b, a));
  __m512i code = _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), lo, one);
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(n, _mm512_set1_ps(t.values[255]), _CMP_GE_OQ),
                               _mm512_set1_epi32(255));
  return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(n, _mm512_set1_ps(t.values[0]), _CMP_GT_OQ), code);
}

// quant_code_keep_sign: values are sorted, so values[c] < 0 iff c < nonneg_first and values[c] > 0
// iff c > nonpos_last (also when the map has no value of that sign: the replacement is then c itself).
inline __m512i code_keep_sign16(__m512i c, __m512 x, __m512 n, const QuantTable& t) {
  const __mmask16 nonzero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(n));  // n's sign bit
  c = _mm512_mask_max_epi32(c, nonzero & ~negative, c, _mm512_set1_epi32(t.nonneg_first));
  return _mm512_mask_min_epi32(c, nonzero & negative, c, _mm512_set1_epi32(t.nonpos_last));
}

// quant_encode_one for 16 lanes of a block with a finite nonzero scale. kKeepSign: the map has no
// exact 0; with one, neither rounding can cross zero and the sign rule is a no-op. vr: the values in
// registers (stochastic_near only).
template <Search S, Round R, bool kKeepSign>
inline __m512i encode16(__m512 v, __m512 s, const QuantTable& t, const ValueRegs* vr, uint64_t seed, uint64_t index0) {
  const __m512 n = _mm512_div_ps(v, s);
  __m512i c;
  if constexpr (R == Round::nearest)
    c = code_nearest16<S>(n, t);
  else if constexpr (R == Round::stochastic_near)
    c = code_stochastic16_near<S>(n, rng_uniform16_avx512(seed, index0), t, *vr);
  else
    c = code_stochastic16(n, rng_uniform16_avx512(seed, index0), t);
  if constexpr (kKeepSign) c = code_keep_sign16(c, v, n, t);
  return c;
}

// Codes of elements [off, off + len) of x, a block of the given scale, into codes[0, len); index0 is
// the global index of element off. prefetch: start of the input bytes to fetch meanwhile (as many as
// the block's), or null.
template <DType D, Search S, Round R, bool kKeepSign>
void encode_codes(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, const ValueRegs* vr,
                  uint8_t* codes, uint64_t seed, uint64_t index0, const char* prefetch) {
  if (!(scale == scale) || scale == 0.0f) {
    std::memset(codes, t.zero_code, size_t(len));
    return;
  }
  const __m512 s = _mm512_set1_ps(scale);
  constexpr int kLine = 64 / (D == DType::f32 ? 4 : 2);  // elements per cache line
  int32_t i = 0;
  for (; i + 64 <= len; i += 64) {
    // Codes are compute-bound, scales memory-bound: fetch the data ahead while computing these.
    if (prefetch) {
      for (int k = 0; k < 64; k += kLine) _mm_prefetch(prefetch + int64_t(i + k) * dtype_size(D), _MM_HINT_T0);
    }
    __m512i c[4];
    for (int k = 0; k < 4; ++k)
      c[k] = encode16<S, R, kKeepSign>(load16<D>(x, off + i + 16 * k), s, t, vr, seed, index0 + uint64_t(i + 16 * k));
    for (int k = 0; k < 4; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 16 * k), _mm512_cvtepi32_epi8(c[k]));
  }
  for (; i + 16 <= len; i += 16) {
    const __m512i c = encode16<S, R, kKeepSign>(load16<D>(x, off + i), s, t, vr, seed, index0 + uint64_t(i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(c));
  }
  if (i < len) {
    const __mmask16 m = tail_mask(len - i);
    const __m512i c =
        encode16<S, R, kKeepSign>(load16_masked<D>(x, off + i, m), s, t, vr, seed, index0 + uint64_t(i));
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, m, c);
  }
}

// y[off + i] (=, or += when kAccumulate) values[codes[i]] * scale for i < len. kStream: y is 64-byte
// aligned and large (not with kAccumulate, which reads y anyway).
template <DType D, bool kAccumulate, bool kStream>
inline void decode_block(const uint8_t* codes, int32_t len, float scale, const ValueRegs& vr, void* y, int64_t off) {
  const __m512 s = _mm512_set1_ps(scale);
  int32_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    __m512 v = _mm512_mul_ps(vr.lookup(c), s);
    if constexpr (kAccumulate) v = _mm512_add_ps(_mm512_loadu_ps(static_cast<float*>(y) + off + i), v);
    store16<D, kStream>(y, off + i, v);
  }
  if (i < len) {
    const __mmask16 m = tail_mask(len - i);
    const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, codes + i));
    __m512 v = _mm512_mul_ps(vr.lookup(c), s);
    if constexpr (kAccumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, static_cast<float*>(y) + off + i), v);
    store16_masked<D>(y, off + i, v, m);
  }
}

// The lane functions of codec_simd.h's drivers.
struct Avx512 : Avx512LanesBase {
  using Lookup = ValueRegs;
  static constexpr bool kCellsOnly = false;
  template <DType D, Search S, Round R, bool kKeepSign>
  static void encode(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, const ValueRegs* vr,
                     uint8_t* codes, uint64_t seed, uint64_t index0, const char* prefetch) {
    encode_codes<D, S, R, kKeepSign>(x, off, len, scale, t, vr, codes, seed, index0, prefetch);
  }
  template <DType D, bool kAccumulate, bool kStream>
  static void decode(const uint8_t* codes, int32_t len, float scale, const QuantTable&, const ValueRegs& vr, void* y,
                     int64_t off) {
    decode_block<D, kAccumulate, kStream>(codes, len, scale, vr, y, off);
  }
};

}  // namespace

void quant_encode_avx512(const EncodeArgs& a) { codec_encode<Avx512>(a); }

void quant_decode_avx512(const DecodeArgs& a) { codec_decode<Avx512>(a); }

float quant_block_encode_f32_avx512(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  return codec_block_encode_f32<Avx512>(x, len, t, codes);
}

void quant_block_decode_f32_avx512(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  codec_block_decode_f32<Avx512>(codes, len, scale, t, y);
}

}  // namespace zero8::quant
