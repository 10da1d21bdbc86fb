// AVX2 variant of the linear int8 yardstick (linear8_step.h): 8 floats per vector, 16 codes per store.
#include <immintrin.h>

#include "linear8_step_simd.h"

namespace zero8::bench {
namespace {

struct V256 {
  using F = __m256;
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static float hmax(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static F decode1(const int8_t* c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
  }
  static F decode2(const uint8_t* c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
  }
  // Round to nearest even (as nearbyint); the packs saturate to int16, then to int8 / uint8, and the
  // permute undoes the packs' per-128-bit-lane order.
  static void encode1(int8_t* c, F x, F y) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(x), _mm256_cvtps_epi32(y)), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c),
                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  }
  static void encode2(uint8_t* c, F x, F y) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_cvtps_epi32(x), _mm256_cvtps_epi32(y)), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c),
                     _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  }
};

}  // namespace

void linear8_step_avx2(const Linear8Args& a, int64_t lo, int64_t hi) {
  const int64_t whole = lo + (hi - lo) / a.block * a.block;
  linear8_blocks<V256>(a, lo, whole);
  if (whole < hi) linear8_step_ref(a, whole, hi);
}

}  // namespace zero8::bench
