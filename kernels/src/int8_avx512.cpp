// AVX-512 variant of the int8 linear-layer kernels: 16 lanes of the loops in int8_simd.h. Bit-identical
// to int8_ref.cpp (tests/cpp/test_int8.cpp).
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined; the values are never read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "int8_simd.h"

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
  static F load(const void* p, int64_t i) {
    if constexpr (D == DType::f32) {
      return _mm512_loadu_ps(static_cast<const float*>(p) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
      if constexpr (D == DType::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      return _mm512_cvtph_ps(h);
    }
  }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
  // Rounding stores as dtype_store: bf16 to nearest even with quiet NaN, fp16 by vcvtps2ph.
  static void store(void* p, DType t, int64_t j, F v) {
    if (t == DType::f32) {
      _mm512_storeu_ps(static_cast<float*>(p) + j, v);
      return;
    }
    __m256i h;
    if (t == DType::bf16) {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i hi = _mm512_srli_epi32(u, 16);
      const __mmask16 nan =
          _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
      const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + j), h);
  }
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
  // rng_uniform(seed, index0 + lane) for 16 lanes (splitmix64 on two halves of 8 lanes).
  static F rng(uint64_t seed, uint64_t index0) {
    const __m512i base = _mm512_set1_epi64(int64_t(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull + index0));
    auto mix = [](__m512i z) {
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(int64_t(0xbf58476d1ce4e5b9ull)));
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(int64_t(0x94d049bb133111ebull)));
      z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
      return _mm512_cvtepi64_epi32(_mm512_srli_epi64(z, 32));
    };
    const __m256i r0 = mix(_mm512_add_epi64(base, _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256i r1 = mix(_mm512_add_epi64(base, _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15)));
    const __m512i r = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), _mm512_set1_ps(5.9604644775390625e-8f));
  }
};

}  // namespace

void int8_row_quant_avx512(const RowQuantArgs& a) { simd_by_dtype<RowQuantFn, V512>(a.dtype, a); }
void int8_col_quant_avx512(const ColQuantArgs& a) { simd_by_dtype<ColQuantFn, V512>(a.dtype, a); }
void int8_block_quant_avx512(const BlockQuantArgs& a) { simd_by_dtype<BlockQuantFn, V512>(a.dtype, a); }
int64_t int8_col_outliers_avx512(const OutlierArgs& a) { return simd_by_dtype<OutlierFn, V512>(a.dtype, a); }
void int8_epilogue_avx512(const EpilogueArgs& a) { simd_epilogue_t<V512>(a); }
void int8_block_dequant_avx512(const BlockDequantArgs& a) { simd_block_dequant_t<V512>(a); }

}  // namespace zero8::int8
