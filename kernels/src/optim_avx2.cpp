// AVX2 variant of the fused optimizers: 8 lanes of the loop in optim_simd.h, with the codec's AVX2
// block helpers for the 8-bit states. Bit-identical to optim_ref.cpp (tests/cpp/test_optim.cpp).
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "codec_internal.h"
#include "dtype_avx2.h"

#define ZERO8_OPTIM_BLOCK_DECODE quant::quant_block_decode_f32_avx2
#define ZERO8_OPTIM_BLOCK_ENCODE quant::quant_block_encode_f32_avx2
#include "optim_simd.h"

namespace zero8::optim {
namespace {

struct V256 {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  // optim_sign: 1 where u > 0, -1 where u < 0, u itself where it is NaN, else 0.
  static F sign(F u) {
    const F gt = _mm256_cmp_ps(u, zero(), _CMP_GT_OQ), lt = _mm256_cmp_ps(u, zero(), _CMP_LT_OQ);
    const F s = _mm256_or_ps(_mm256_and_ps(gt, set1(1.0f)), _mm256_and_ps(lt, set1(-1.0f)));
    return _mm256_blendv_ps(s, u, _mm256_cmp_ps(u, u, _CMP_UNORD_Q));
  }
  // dtype_load / dtype_store (dtype_avx2.h).
  static F load_grad(const void* g, DType t, int64_t j) { return load8(g, t, j); }
  static void store_param(void* p, DType t, int64_t j, F v) { store8(p, t, j, v); }
  // Norm accumulation: 8 double lanes in two registers (lanes 0-3, 4-7), lane = k % 8.
  struct Acc {
    __m256d lo, hi;
  };
  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static void acc_add_sq(Acc& acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc.lo = _mm256_add_pd(acc.lo, _mm256_mul_pd(lo, lo));
    acc.hi = _mm256_add_pd(acc.hi, _mm256_mul_pd(hi, hi));
  }
  // ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as optim_norm_lanes_sum.
  static double acc_sum(const Acc& acc) {
    const __m256d t = _mm256_add_pd(acc.lo, acc.hi);
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static F zero_tail(F x, int r) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(r), idx)));
  }
};

}  // namespace

void optim_step_avx2(const StepArgs& a) { simd_step_any<V256>(a); }
void optim_norms_avx2(const StepArgs& a, NormSums* out) { simd_norms_any<V256>(a, out); }

}  // namespace zero8::optim
