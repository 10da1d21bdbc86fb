// AVX-512 variant of the linear int8 yardstick (linear8_step.h): 16 floats per vector.
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (as in the kernels' AVX-512 files); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "linear8_step_simd.h"

namespace zero8::bench {
namespace {

struct V512 {
  using F = __m512;
  static constexpr int W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static float hmax(F a) { return _mm512_reduce_max_ps(a); }
  static F decode1(const int8_t* c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  }
  static F decode2(const uint8_t* c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  }
  // Round to nearest even (the default MXCSR mode, as nearbyint), saturate to int8 / uint8.
  static void encode1(int8_t* c, F x, F y) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y)));
  }
  static void encode2(uint8_t* c, F x, F y) {
    const __m512i zero = _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(x), zero)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16),
                     _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(y), zero)));
  }
};

}  // namespace

void linear8_step_avx512(const Linear8Args& a, int64_t lo, int64_t hi) {
  const int64_t whole = lo + (hi - lo) / a.block * a.block;
  linear8_blocks<V512>(a, lo, whole);
  if (whole < hi) linear8_step_ref(a, whole, hi);
}

}  // namespace zero8::bench
