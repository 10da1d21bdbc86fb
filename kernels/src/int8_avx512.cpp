// AVX-512 variant of the int8 linear-layer kernels: 16 lanes of the loops in int8_simd.h. Bit-identical
// to int8_ref.cpp (tests/cpp/test_int8.cpp).
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include "dtype_avx512.h"
#include "int8_simd.h"
#include "rng_avx512.h"

namespace zero8::int8 {
namespace {

struct V512 {
  using F = __m512;
  using U = __m512i;
  static constexpr int W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F rint(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F clamp127(F a) { return _mm512_min_ps(_mm512_max_ps(a, set1(-127.0f)), set1(127.0f)); }
  template <DType D>
  static F load(const void* p, int64_t i) { return load16<D>(p, i); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
  static void store(void* p, DType t, int64_t j, F v) { store16(p, t, j, v); }
  static void store_i8(int8_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  static U u_zero() { return _mm512_setzero_si512(); }
  static U u_load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void u_store(uint32_t* p, U v) { _mm512_storeu_si512(p, v); }
  static U absbits_max(U acc, F v) {
    return _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
  }
  static uint32_t hmax(U v) { return _mm512_reduce_max_epu32(v); }
  static F masked_zero(F v, const uint8_t* mask) {
    const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask));
    return _mm512_maskz_mov_ps(__mmask16(~_mm_test_epi8_mask(m, m)), v);
  }
  static void or_outliers(uint8_t* mask, F v, F thr) {
    const __mmask16 k = _mm512_cmp_ps_mask(_mm512_abs_ps(v), thr, _CMP_GE_OQ);
    if (!k) return;
    __m128i* p = reinterpret_cast<__m128i*>(mask);
    _mm_storeu_si128(p, _mm_or_si128(_mm_loadu_si128(p), _mm_maskz_set1_epi8(k, 1)));
  }
  static F nonpos_zero(F q, F s) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), q); }
  static F rng(uint64_t seed, uint64_t index0) { return rng_uniform16_avx512(seed, index0); }
};

}  // namespace

void int8_row_quant_avx512(const RowQuantArgs& a) { simd_by_dtype<RowQuantFn, V512>(a.dtype, a); }
void int8_col_quant_avx512(const ColQuantArgs& a) { simd_by_dtype<ColQuantFn, V512>(a.dtype, a); }
void int8_block_quant_avx512(const BlockQuantArgs& a) { simd_by_dtype<BlockQuantFn, V512>(a.dtype, a); }
int64_t int8_col_outliers_avx512(const OutlierArgs& a) { return simd_by_dtype<OutlierFn, V512>(a.dtype, a); }
void int8_epilogue_avx512(const EpilogueArgs& a) { simd_epilogue_t<V512>(a); }
void int8_block_dequant_avx512(const BlockDequantArgs& a) { simd_block_dequant_t<V512>(a); }

}  // namespace zero8::int8
