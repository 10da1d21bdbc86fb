// AVX2 variant of the linear int8 yardstick (linear8_step.h), 8 elements per vector and 16 per code
// store: the same float operations as linear8_step_ref, so the same bits.
#include <immintrin.h>

#include <algorithm>

#include "linear8_step.h"

namespace zero8::bench {
namespace {

float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Two vectors of 8 int32 (in order) to 16 saturated bytes: signed to int8 or, with kUnsigned, to uint8.
template <bool kUnsigned>
__m128i pack16(__m256i x, __m256i y) {
  const __m256i w = _mm256_permute4x64_epi64(kUnsigned ? _mm256_packus_epi32(x, y) : _mm256_packs_epi32(x, y), 0xD8);
  const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  return kUnsigned ? _mm_packus_epi16(lo, hi) : _mm_packs_epi16(lo, hi);
}

}  // namespace

void linear8_step_avx2(const Linear8Args& a, int64_t lo, int64_t hi) {
  const __m256 b1 = _mm256_set1_ps(a.b1), b2 = _mm256_set1_ps(a.b2), c1 = _mm256_set1_ps(1.0f - a.b1),
               c2 = _mm256_set1_ps(1.0f - a.b2), decay = _mm256_set1_ps(a.decay), step = _mm256_set1_ps(a.step),
               eps = _mm256_set1_ps(a.eps_hat);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  alignas(32) float x1[4096], x2[4096];
  const int64_t whole = lo + (hi - lo) / a.block * a.block;
  for (int64_t b0 = lo; b0 < whole; b0 += a.block) {
    const int64_t b = b0 / a.block;
    const __m256 d1 = _mm256_set1_ps(a.scale1[b] / 127.0f), d2 = _mm256_set1_ps(a.scale2[b] / 255.0f);
    __m256 max1 = _mm256_setzero_ps(), max2 = _mm256_setzero_ps();
    for (int32_t i = 0; i < a.block; i += 8) {
      const int64_t e = b0 + i;
      const __m256 g = _mm256_loadu_ps(a.grad + e);
      const __m256 s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.code1 + e))));
      const __m256 s2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.code2 + e))));
      const __m256 m = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_mul_ps(s1, d1)), _mm256_mul_ps(c1, g));
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_mul_ps(s2, d2)), _mm256_mul_ps(c2, _mm256_mul_ps(g, g)));
      const __m256 u = _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), eps));
      _mm256_storeu_ps(a.param + e, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(a.param + e), decay), _mm256_mul_ps(step, u)));
      _mm256_store_ps(x1 + i, m);
      _mm256_store_ps(x2 + i, v);
      max1 = _mm256_max_ps(max1, _mm256_and_ps(m, abs_mask));
      max2 = _mm256_max_ps(max2, v);
    }
    const float m1 = hmax(max1), m2 = hmax(max2);
    a.scale1[b] = m1;
    a.scale2[b] = m2;
    const __m256 r1 = _mm256_set1_ps(m1 > 0.0f ? 127.0f / m1 : 0.0f), r2 = _mm256_set1_ps(m2 > 0.0f ? 255.0f / m2 : 0.0f);
    for (int32_t i = 0; i < a.block; i += 16) {
      const __m256i q1a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x1 + i), r1));
      const __m256i q1b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x1 + i + 8), r1));
      const __m256i q2a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x2 + i), r2));
      const __m256i q2b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x2 + i + 8), r2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.code1 + b0 + i), pack16<false>(q1a, q1b));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.code2 + b0 + i), pack16<true>(q2a, q2b));
    }
  }
  if (whole < hi) linear8_step_ref(a, whole, hi);
}

}  // namespace zero8::bench
