// AVX2 variant of the block-wise codec (8 lanes, F16C for fp16). Codes, scales and decoded values are
// bit-identical to the scalar reference: the same division x / scale, the same float compares against
// the table's exact thresholds (through the bucket accelerator), the same stochastic draws; a block's
// last len % 8 elements go through the reference's element functions.
#include <immintrin.h>

// GCC 12 flags the _mm*_undefined_*() placeholders inside its own intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstring>

#include "codec_internal.h"
#include "codec_simd.h"
#include "dtype_avx2.h"
#include "rng_avx2.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

// Low byte of each 32-bit lane, packed into the low 8 bytes.
inline __m128i pack_bytes(__m256i c) {
  const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(c, shuf), _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  return _mm256_castsi256_si128(b);
}

// quant_lut_index for 8 lanes. |n| <= 1 (|x| <= |scale|, and the division rounds monotonically), so
// only the low end needs the clamp.
inline __m256i lut_index8(__m256 n) {
  const __m256i u = _mm256_castps_si256(n);
  __m256i q = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), kQuantLutShift);
  q = _mm256_max_epu32(q, _mm256_set1_epi32(kQuantLutLo));
  q = _mm256_sub_epi32(q, _mm256_set1_epi32(kQuantLutLo));
  return _mm256_add_epi32(q, _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(kQuantLutHalf)));
}

// The code of 8 lanes from their packed accelerator entries e (t.lut_packed): the entry's code, plus
// one where n lies above the bucket's threshold (n's upper 16 bits joined with the entry's lower 16).
inline __m256i code_packed8(__m256 n, __m256i e) {
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  const __m256 th = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(n), hi), _mm256_andnot_si256(hi, e)));
  return _mm256_sub_epi32(_mm256_srli_epi32(e, 16), _mm256_castps_si256(_mm256_cmp_ps(n, th, _CMP_GT_OQ)));
}

// quant_code_nearest for 8 lanes, as quant_code_nearest_lut computes it (a true compare is -1, so
// subtracting it increments).
template <Search S>
inline __m256i code_nearest8(__m256 n, const QuantTable& t) {
  if constexpr (S == Search::binary) {
    __m256i c = _mm256_setzero_si256();
    for (int step = 128; step > 0; step >>= 1) {
      const __m256 th = _mm256_i32gather_ps(t.thresholds, _mm256_add_epi32(c, _mm256_set1_epi32(step - 1)), 4);
      const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(n, th, _CMP_GT_OQ));
      c = _mm256_add_epi32(c, _mm256_and_si256(gt, _mm256_set1_epi32(step)));
    }
    return c;
  } else {
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.lut), lut_index8(n), 4);
    if constexpr (S == Search::packed) {
      return code_packed8(n, e);
    } else {
      __m256i c = _mm256_srli_epi32(e, 16);
      for (int s = 0; s < t.lut_steps; ++s) {
        const __m256 th = _mm256_i32gather_ps(t.thresholds, c, 4);
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(n, th, _CMP_GT_OQ)));
      }
      return c;
    }
  }
}

inline __m256i select(__m256i a, __m256i b, __m256 mask) {
  return _mm256_blendv_epi8(a, b, _mm256_castps_si256(mask));
}

// quant_code_stochastic for 8 lanes: the reference's binary search over values (any sorted map).
inline __m256i code_stochastic8(__m256 n, __m256 u, const QuantTable& t) {
  __m256i lo = _mm256_setzero_si256();  // largest code with values[lo] <= n, as the reference searches
  for (int step = 128; step > 0; step >>= 1) {
    const __m256i c = _mm256_add_epi32(lo, _mm256_set1_epi32(step));
    const __m256 v = _mm256_i32gather_ps(t.values, c, 4);
    lo = select(lo, c, _mm256_cmp_ps(v, n, _CMP_LE_OQ));
  }
  const __m256i hi = _mm256_min_epi32(_mm256_add_epi32(lo, _mm256_set1_epi32(1)), _mm256_set1_epi32(255));
  const __m256 a = _mm256_i32gather_ps(t.values, lo, 4), b = _mm256_i32gather_ps(t.values, hi, 4);
  const __m256 p = _mm256_div_ps(_mm256_sub_ps(n, a), _mm256_sub_ps(b, a));
  __m256i c = select(lo, hi, _mm256_cmp_ps(u, p, _CMP_LT_OQ));
  c = select(c, _mm256_set1_epi32(255), _mm256_cmp_ps(n, _mm256_set1_ps(t.values[255]), _CMP_GE_OQ));
  return _mm256_and_si256(c, _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_set1_ps(t.values[0]), _CMP_GT_OQ)));
}

// quant_code_stochastic for 8 lanes of a map with strictly increasing values, from the nearest code
// c: the largest code with values[lo] <= n is c when values[c] <= n (values[c + 1] <= n would be
// nearer) and c - 1 otherwise.
template <Search S>
inline __m256i code_stochastic8_near(__m256 n, __m256 u, const QuantTable& t) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i c = code_nearest8<S>(n, t);
  // Neighbours clamped into the table; lanes at the ends are decided by the edge rules below.
  const __m256i cm = _mm256_max_epi32(_mm256_sub_epi32(c, one), _mm256_setzero_si256());
  const __m256i cp = _mm256_min_epi32(_mm256_add_epi32(c, one), _mm256_set1_epi32(255));
  const __m256 vm = _mm256_i32gather_ps(t.values, cm, 4), v0 = _mm256_i32gather_ps(t.values, c, 4),
               vp = _mm256_i32gather_ps(t.values, cp, 4);
  const __m256 above = _mm256_cmp_ps(v0, n, _CMP_GT_OQ);  // values[c] > n: lo = c - 1
  const __m256i lo = _mm256_add_epi32(c, _mm256_castps_si256(above));
  const __m256 a = _mm256_blendv_ps(v0, vm, above), b = _mm256_blendv_ps(vp, v0, above);
  const __m256 p = _mm256_div_ps(_mm256_sub_ps(n, a), _mm256_sub_ps(b, a));
  __m256i code = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_LT_OQ)));
  code = select(code, _mm256_set1_epi32(255), _mm256_cmp_ps(n, _mm256_set1_ps(t.values[255]), _CMP_GE_OQ));
  return _mm256_and_si256(code, _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_set1_ps(t.values[0]), _CMP_GT_OQ)));
}

// quant_code_keep_sign: values are sorted, so values[c] < 0 iff c < nonneg_first and values[c] > 0
// iff c > nonpos_last (also when the map has no value of that sign: the replacement is then c itself).
inline __m256i code_keep_sign8(__m256i c, __m256 x, __m256 n, const QuantTable& t) {
  const __m256 nonzero = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_OQ);
  const __m256 negative = _mm256_castsi256_ps(_mm256_srai_epi32(_mm256_castps_si256(n), 31));  // n's sign bit
  c = select(c, _mm256_max_epi32(c, _mm256_set1_epi32(t.nonneg_first)), _mm256_andnot_ps(negative, nonzero));
  return select(c, _mm256_min_epi32(c, _mm256_set1_epi32(t.nonpos_last)), _mm256_and_ps(negative, nonzero));
}

inline float hmin(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline uint32_t hmax_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
}

// Scale of one block (elements [off, off + len) of x): min/max with +0 accumulators as the reference's
// std::min/max (the accumulator is the second operand, so zeros and NaN never replace it), and an
// exponent check for non-finite values.
template <DType D>
inline float block_scale(const void* x, int64_t off, int32_t len, const QuantTable& t) {
  __m256 vmin0 = _mm256_setzero_ps(), vmax0 = vmin0, vmin1 = vmin0, vmax1 = vmin0;
  __m256i abits = _mm256_setzero_si256();
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  int32_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256 v0 = load8<D>(x, off + i), v1 = load8<D>(x, off + i + 8);
    vmin0 = _mm256_min_ps(v0, vmin0);
    vmax0 = _mm256_max_ps(v0, vmax0);
    vmin1 = _mm256_min_ps(v1, vmin1);
    vmax1 = _mm256_max_ps(v1, vmax1);
    abits = _mm256_max_epu32(abits, _mm256_and_si256(_mm256_castps_si256(v0), absmask));
    abits = _mm256_max_epu32(abits, _mm256_and_si256(_mm256_castps_si256(v1), absmask));
  }
  for (; i + 8 <= len; i += 8) {
    const __m256 v = load8<D>(x, off + i);
    vmin0 = _mm256_min_ps(v, vmin0);
    vmax0 = _mm256_max_ps(v, vmax0);
    abits = _mm256_max_epu32(abits, _mm256_and_si256(_mm256_castps_si256(v), absmask));
  }
  bool finite = hmax_epu32(abits) < 0x7f800000u;
  // Lanes hold +0 or negative (resp. positive) values only, never -0 or NaN: any reduction order agrees.
  float vmin = hmin(_mm256_min_ps(vmin1, vmin0)), vmax = hmax(_mm256_max_ps(vmax1, vmax0));
  for (; i < len; ++i) {
    const float v = dtype_load(x, D, off + i);
    finite = finite && (v - v == 0.0f);
    vmin = std::min(vmin, v);
    vmax = std::max(vmax, v);
  }
  return finite ? quant_block_scale(vmin, vmax, t) : f32_from_bits(0x7fc00000u);
}

// Nearest codes of the first len - len % 8 elements [off, ...) of x through the packed accelerator,
// staged through the stack kStage elements at a time: (1) the quotients n and their 16-bit bucket
// indices, (2) the table entries by scalar loads, four indices per 64-bit read, (3) the codes. On CPUs
// whose AVX2 gathers are slow, the three loops together take less time than one vpgatherdd per 8 codes
// (docs/BENCHMARKS.md, "What the kernels do for speed").
// Returns the number of elements encoded.
template <DType D, bool kKeepSign>
int32_t encode_packed_staged(const void* x, int64_t off, int32_t len, __m256 s, const QuantTable& t, uint8_t* codes,
                             const char* prefetch) {
  constexpr int32_t kStage = 256;
  alignas(32) float ns[kStage];
  alignas(32) uint16_t qs[kStage];
  alignas(32) uint32_t es[kStage];
  const int32_t whole = len & ~7;
  for (int32_t c0 = 0; c0 < whole; c0 += kStage) {
    const int32_t m = std::min(kStage, whole - c0);
    for (int32_t i = 0; i < m; i += 8) {
      // The block's scale pass was memory-bound, its encode is compute-bound: fetch the next block
      // meanwhile (as encode_codes does).
      const int32_t j = c0 + i;
      if (prefetch && j % 16 == 0) _mm_prefetch(prefetch + int64_t(j) * dtype_size(D), _MM_HINT_T0);
      const __m256 n = _mm256_div_ps(load8<D>(x, off + j), s);
      _mm256_store_ps(ns + i, n);
      const __m256i q = lut_index8(n);  // < kQuantLutBuckets, so the unsigned saturation never acts
      _mm_store_si128(reinterpret_cast<__m128i*>(qs + i),
                      _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    }
    for (int32_t i = 0; i < m; i += 4) {
      uint64_t w;
      std::memcpy(&w, qs + i, 8);
      es[i] = t.lut[w & 0xffff];
      es[i + 1] = t.lut[(w >> 16) & 0xffff];
      es[i + 2] = t.lut[(w >> 32) & 0xffff];
      es[i + 3] = t.lut[w >> 48];
    }
    for (int32_t i = 0; i < m; i += 8) {
      const __m256 n = _mm256_load_ps(ns + i);
      __m256i c = code_packed8(n, _mm256_load_si256(reinterpret_cast<const __m256i*>(es + i)));
      if constexpr (kKeepSign) c = code_keep_sign8(c, load8<D>(x, off + c0 + i), n, t);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + c0 + i), pack_bytes(c));
    }
  }
  return whole;
}

// Codes of elements [off, off + len) of x, a block of the given scale, into codes[0, len); index0 is
// the global index of element off. prefetch: start of the input bytes to fetch while this block computes
// (as many as the block's), or null. A block's last len % 8 elements go through the reference's
// element functions.
template <DType D, Search S, Round R, bool kKeepSign>
void encode_codes(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, uint8_t* codes,
                  uint64_t seed, uint64_t index0, const char* prefetch) {
  if (!(scale == scale) || scale == 0.0f) {
    std::memset(codes, t.zero_code, size_t(len));
    return;
  }
  const __m256 s = _mm256_set1_ps(scale);
  int32_t i = 0;
  if constexpr (S == Search::packed && R == Round::nearest)
    i = encode_packed_staged<D, kKeepSign>(x, off, len, s, t, codes, prefetch);
  for (; i + 8 <= len; i += 8) {
    // Pass 2 is compute-bound, pass 1 memory-bound: fetch a block ahead while computing this one.
    if (prefetch && i % 16 == 0) _mm_prefetch(prefetch + int64_t(i) * dtype_size(D), _MM_HINT_T0);
    const __m256 v = load8<D>(x, off + i);
    const __m256 n = _mm256_div_ps(v, s);
    __m256i c;
    if constexpr (R == Round::nearest)
      c = code_nearest8<S>(n, t);
    else if constexpr (R == Round::stochastic_near)
      c = code_stochastic8_near<S>(n, rng_uniform8_avx2(seed, index0 + uint64_t(i)), t);
    else
      c = code_stochastic8(n, rng_uniform8_avx2(seed, index0 + uint64_t(i)), t);
    if constexpr (kKeepSign) c = code_keep_sign8(c, v, n, t);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), pack_bytes(c));
  }
  constexpr bool kStochastic = R != Round::nearest;
  for (; i < len; ++i) {
    const float u = kStochastic ? rng_uniform(seed, index0 + uint64_t(i)) : 0.0f;
    codes[i] = uint8_t(quant_encode_one(dtype_load(x, D, off + i), scale, t, kStochastic, u));
  }
}

// y[off + i] (=, or += when kAccumulate) values[codes[i]] * scale for i < len.
template <DType D, bool kAccumulate>
void decode_block(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, void* y, int64_t off) {
  const __m256 s = _mm256_set1_ps(scale);
  int32_t i = 0;
  for (; i + 8 <= len; i += 8) {
    // Eight scalar loads rather than vgatherdps: an 8-lane gather from this 1 KiB table is slower than
    // scalar loads inserted into a vector on CPUs without fast gathers (docs/BENCHMARKS.md, findings).
    // The encoder's indices are computed in vector registers, so it stages its scalar reads through the
    // stack (encode_packed_staged).
    // The first four codes come from one 32-bit read and shifts, the others by byte loads: that
    // balances the load ports against the integer ones.
    const uint8_t* c = codes + i;
    const float* tv = t.values;
    uint32_t w;
    std::memcpy(&w, c, 4);
    __m256 v = _mm256_setr_ps(tv[w & 255], tv[(w >> 8) & 255], tv[(w >> 16) & 255], tv[w >> 24], tv[c[4]], tv[c[5]],
                              tv[c[6]], tv[c[7]]);
    v = _mm256_mul_ps(v, s);
    if constexpr (kAccumulate) v = _mm256_add_ps(_mm256_loadu_ps(static_cast<float*>(y) + off + i), v);
    store8<D>(y, off + i, v);
  }
  for (; i < len; ++i) {
    const float v = quant_decode_one(codes[i], scale, t);
    if constexpr (kAccumulate)
      static_cast<float*>(y)[off + i] += v;
    else
      dtype_store(y, D, off + i, v);
  }
}

// The lane functions of codec_simd.h's drivers. Each block's codes follow its scale at once (no
// grouping); decoded outputs take ordinary stores.
struct Avx2 {
  using Lookup = NoLookup;
  static constexpr bool kCellsOnly = false;
  static constexpr int64_t kGroupElements = 0;
  static constexpr int64_t kStreamBytes = 0;
  template <DType D>
  static float scale_of(const void* x, int64_t off, int32_t len, const QuantTable& t) {
    return block_scale<D>(x, off, len, t);
  }
  template <DType D, Search S, Round R, bool kKeepSign>
  static void encode(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, const NoLookup*,
                     uint8_t* codes, uint64_t seed, uint64_t index0, const char* prefetch) {
    encode_codes<D, S, R, kKeepSign>(x, off, len, scale, t, codes, seed, index0, prefetch);
  }
  template <DType D, bool kAccumulate, bool kStream>
  static void decode(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, const NoLookup&, void* y,
                     int64_t off) {
    static_assert(!kStream, "no streaming stores");
    decode_block<D, kAccumulate>(codes, len, scale, t, y, off);
  }
};

}  // namespace

void quant_encode_avx2(const EncodeArgs& a) { codec_encode<Avx2>(a); }

void quant_decode_avx2(const DecodeArgs& a) { codec_decode<Avx2>(a); }

float quant_block_encode_f32_avx2(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  return codec_block_encode_f32<Avx2>(x, len, t, codes);
}

void quant_block_decode_f32_avx2(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  codec_block_decode_f32<Avx2>(codes, len, scale, t, y);
}

}  // namespace zero8::quant
