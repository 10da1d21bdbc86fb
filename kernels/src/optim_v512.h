// The 16-lane vector traits of optim_simd.h for the AVX-512 translation units (avx512, avx512vbmi).
// Internal linkage only (an anonymous namespace): each TU keeps its own copy, compiled with its own
// -m flags (see optim_simd.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "zero8/kernels/hd.h"

namespace zero8::optim {
namespace {

struct V512 {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  // 1 where u > 0, -1 where u < 0, else 0 (also NaN), as the scalar rule.
  static F sign(F u) {
    const __mmask16 gt = _mm512_cmp_ps_mask(u, zero(), _CMP_GT_OQ);
    const __mmask16 lt = _mm512_cmp_ps_mask(u, zero(), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(lt, _mm512_mask_blend_ps(gt, zero(), set1(1.0f)), set1(-1.0f));
  }
  // Exact widening loads (as dtype_load): bf16 is the upper half of a float, fp16 via F16C.
  static F load_grad(const void* g, DType t, int64_t j) {
    if (t == DType::f32) return _mm512_loadu_ps(static_cast<const float*>(g) + j);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + j));
    if (t == DType::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
  // Rounding stores (as dtype_store): bf16 round to nearest even with quiet NaN, fp16 by vcvtps2ph
  // (round to nearest even, the same NaN and overflow results as f32_to_f16).
  static void store_param(void* p, DType t, int64_t j, F v) {
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
      const __m512i q = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + j), h);
  }
  // Norm accumulation: 8 double lanes; 16 floats add as elements 0..7 then 8..15 (lane = k % 8).
  struct Acc {
    __m512d a;
  };
  static Acc acc_zero() { return {_mm512_setzero_pd()}; }
  static void acc_add_sq(Acc& acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    acc.a = _mm512_add_pd(acc.a, _mm512_mul_pd(lo, lo));
    acc.a = _mm512_add_pd(acc.a, _mm512_mul_pd(hi, hi));
  }
  // ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as optim_norm_lanes_sum.
  static double acc_sum(const Acc& acc) {
    const __m256d t = _mm256_add_pd(_mm512_castpd512_pd256(acc.a), _mm512_extractf64x4_pd(acc.a, 1));
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static F zero_tail(F x, int r) { return _mm512_maskz_mov_ps(__mmask16((1u << r) - 1u), x); }
};

}  // namespace
}  // namespace zero8::optim
