// AVX-512 variant of the linear int8 yardstick (linear8_step.h), 16 elements per vector: the same
// float operations as linear8_step_ref, so the same bits.
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (as in the kernels' AVX-512 files); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>

#include "linear8_step.h"

namespace zero8::bench {

void linear8_step_avx512(const Linear8Args& a, int64_t lo, int64_t hi) {
  const __m512 b1 = _mm512_set1_ps(a.b1), b2 = _mm512_set1_ps(a.b2), c1 = _mm512_set1_ps(1.0f - a.b1),
               c2 = _mm512_set1_ps(1.0f - a.b2), decay = _mm512_set1_ps(a.decay), step = _mm512_set1_ps(a.step),
               eps = _mm512_set1_ps(a.eps_hat);
  alignas(64) float x1[4096], x2[4096];
  const int64_t whole = lo + (hi - lo) / a.block * a.block;
  for (int64_t b0 = lo; b0 < whole; b0 += a.block) {
    const int64_t b = b0 / a.block;
    const __m512 d1 = _mm512_set1_ps(a.scale1[b] / 127.0f), d2 = _mm512_set1_ps(a.scale2[b] / 255.0f);
    __m512 max1 = _mm512_setzero_ps(), max2 = _mm512_setzero_ps();
    for (int32_t i = 0; i < a.block; i += 16) {
      const int64_t e = b0 + i;
      const __m512 g = _mm512_loadu_ps(a.grad + e);
      const __m512 s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.code1 + e))));
      const __m512 s2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.code2 + e))));
      const __m512 m = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_mul_ps(s1, d1)), _mm512_mul_ps(c1, g));
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_mul_ps(s2, d2)), _mm512_mul_ps(c2, _mm512_mul_ps(g, g)));
      const __m512 u = _mm512_div_ps(m, _mm512_add_ps(_mm512_sqrt_ps(v), eps));
      _mm512_storeu_ps(a.param + e, _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(a.param + e), decay), _mm512_mul_ps(step, u)));
      _mm512_store_ps(x1 + i, m);
      _mm512_store_ps(x2 + i, v);
      max1 = _mm512_max_ps(max1, _mm512_abs_ps(m));
      max2 = _mm512_max_ps(max2, v);
    }
    const float m1 = _mm512_reduce_max_ps(max1), m2 = _mm512_reduce_max_ps(max2);
    a.scale1[b] = m1;
    a.scale2[b] = m2;
    const __m512 r1 = _mm512_set1_ps(m1 > 0.0f ? 127.0f / m1 : 0.0f), r2 = _mm512_set1_ps(m2 > 0.0f ? 255.0f / m2 : 0.0f);
    for (int32_t i = 0; i < a.block; i += 16) {
      // Round to nearest even (the default MXCSR mode, as nearbyint), saturate to int8 / uint8.
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x1 + i), r1));
      const __m512i q2 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x2 + i), r2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.code1 + b0 + i), _mm512_cvtsepi32_epi8(q1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.code2 + b0 + i),
                       _mm512_cvtusepi32_epi8(_mm512_max_epi32(q2, _mm512_setzero_si512())));
    }
  }
  if (whole < hi) linear8_step_ref(a, whole, hi);
}

}  // namespace zero8::bench
