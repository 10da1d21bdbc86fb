// AVX2 variant of the int8 linear-layer kernels: 8 lanes of the loops in int8_simd.h. Bit-identical to
// int8_ref.cpp (tests/cpp/test_int8.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include "dtype_avx2.h"
#include "int8_simd.h"
#include "rng_avx2.h"

namespace zero8::int8 {
namespace {

struct V256 {
  using F = __m256;
  using U = __m256i;
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F rint(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F floor(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F clamp127(F a) { return _mm256_min_ps(_mm256_max_ps(a, set1(-127.0f)), set1(127.0f)); }
  template <DType D>
  static F load(const void* p, int64_t i) { return load8<D>(p, i); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_i32(const int32_t* p) { return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(void* p, DType t, int64_t j, F v) { store8(p, t, j, v); }
  // 8 int32 in [-127, 127] (or 0/1) -> 8 bytes.
  static __m128i pack8(__m256i v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_packs_epi16(w, w);
  }
  static void store_i8(int8_t* p, F v) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), pack8(_mm256_cvtps_epi32(v))); }
  static U u_zero() { return _mm256_setzero_si256(); }
  static U u_load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void u_store(uint32_t* p, U v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static U absbits_max(U acc, F v) {
    return _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)));
  }
  static uint32_t hmax(U v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
    return uint32_t(_mm_cvtsi128_si32(m));
  }
  static F masked_zero(F v, const uint8_t* mask) {
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask)));
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_setzero_si256())));
  }
  static void or_outliers(uint8_t* mask, F v, F thr) {
    const F absv = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(absv, thr, _CMP_GE_OQ));
    if (_mm256_testz_si256(ge, ge)) return;
    __m128i* p = reinterpret_cast<__m128i*>(mask);
    _mm_storel_epi64(p, _mm_or_si128(_mm_loadl_epi64(p), pack8(_mm256_and_si256(ge, _mm256_set1_epi32(1)))));
  }
  static F nonpos_zero(F q, F s) { return _mm256_and_ps(q, _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ)); }
  static F rng(uint64_t seed, uint64_t index0) { return rng_uniform8_avx2(seed, index0); }
};

}  // namespace

void int8_row_quant_avx2(const RowQuantArgs& a) { simd_by_dtype<RowQuantFn, V256>(a.dtype, a); }
void int8_col_quant_avx2(const ColQuantArgs& a) { simd_by_dtype<ColQuantFn, V256>(a.dtype, a); }
void int8_block_quant_avx2(const BlockQuantArgs& a) { simd_by_dtype<BlockQuantFn, V256>(a.dtype, a); }
int64_t int8_col_outliers_avx2(const OutlierArgs& a) { return simd_by_dtype<OutlierFn, V256>(a.dtype, a); }
void int8_epilogue_avx2(const EpilogueArgs& a) { simd_epilogue_t<V256>(a); }
void int8_block_dequant_avx2(const BlockDequantArgs& a) { simd_block_dequant_t<V256>(a); }

}  // namespace zero8::int8
