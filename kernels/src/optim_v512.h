// The 16-lane vector traits of optim_simd.h for the AVX-512 translation units (avx512, avx512vbmi).
// Internal linkage only (an anonymous namespace): each TU keeps its own copy, compiled with its own
// -m flags (see optim_simd.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "dtype_avx512.h"
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
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  // optim_sign: 1 where u > 0, -1 where u < 0, u itself where it is NaN, else 0.
  static F sign(F u) {
    const __mmask16 gt = _mm512_cmp_ps_mask(u, zero(), _CMP_GT_OQ);
    const __mmask16 lt = _mm512_cmp_ps_mask(u, zero(), _CMP_LT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
    const F s = _mm512_mask_blend_ps(lt, _mm512_mask_blend_ps(gt, zero(), set1(1.0f)), set1(-1.0f));
    return _mm512_mask_blend_ps(nan, s, u);
  }

  // dtype_load / dtype_store (dtype_avx512.h).
  static F load_grad(const void* g, DType t, int64_t j) { return load16(g, t, j); }
  static void store_param(void* p, DType t, int64_t j, F v) { store16(p, t, j, v); }
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
