// The loop of the linear int8 yardstick's SIMD variants (linear8_step.h), written once over a vector
// traits class V (linear8_step_avx2.cpp, linear8_step_avx512.cpp): the same float operations, in the same
// order, as linear8_step_ref, so the same bits. Whole blocks only; the caller leaves the rest to the
// reference. Internal linkage: each including file compiles it with its own -m flags.
#pragma once

#include <cstdint>

#include "linear8_step.h"

namespace zero8::bench {
namespace {

// V: F (a vector of V::W floats), set1, loadu, storeu, store, load, add, sub, mul, div, sqrt, min, max, abs,
// hmax; decode1 / decode2 (V::W codes of state 1 / 2 as floats); encode1 / encode2 (2 W floats, already
// scaled, to 2 W saturated codes).
template <class V>
void linear8_blocks(const Linear8Args& a, int64_t lo, int64_t hi) {
  using F = typename V::F;
  const F b1 = V::set1(a.b1), b2 = V::set1(a.b2), c1 = V::set1(1.0f - a.b1), c2 = V::set1(1.0f - a.b2),
          decay = V::set1(a.decay), step = V::set1(a.step), eps = V::set1(a.eps_hat),
          bound = V::set1(a.ratio_max), nbound = V::set1(-a.ratio_max);
  alignas(64) float x1[4096], x2[4096];
  for (int64_t b0 = lo; b0 < hi; b0 += a.block) {
    const int64_t b = b0 / a.block;
    const F d1 = V::set1(a.scale1[b] / 127.0f), d2 = V::set1(a.scale2[b] / 255.0f);
    F max1 = V::set1(0.0f), max2 = V::set1(0.0f);
    for (int32_t i = 0; i < a.block; i += V::W) {
      const int64_t e = b0 + i;
      const F g = V::loadu(a.grad + e);
      const F m = V::add(V::mul(b1, V::mul(V::decode1(a.code1 + e), d1)), V::mul(c1, g));
      const F v = V::add(V::mul(b2, V::mul(V::decode2(a.code2 + e), d2)), V::mul(c2, V::mul(g, g)));
      const F u = V::max(nbound, V::min(bound, V::div(m, V::add(V::sqrt(v), eps))));
      V::storeu(a.param + e, V::sub(V::mul(V::loadu(a.param + e), decay), V::mul(step, u)));
      V::store(x1 + i, m);
      V::store(x2 + i, v);
      max1 = V::max(max1, V::abs(m));
      max2 = V::max(max2, v);
    }
    const float m1 = V::hmax(max1), m2 = V::hmax(max2);
    a.scale1[b] = m1;
    a.scale2[b] = m2;
    const F r1 = V::set1(m1 > 0.0f ? 127.0f / m1 : 0.0f), r2 = V::set1(m2 > 0.0f ? 255.0f / m2 : 0.0f);
    for (int32_t i = 0; i < a.block; i += 2 * V::W) {
      V::encode1(a.code1 + b0 + i, V::mul(V::load(x1 + i), r1), V::mul(V::load(x1 + i + V::W), r1));
      V::encode2(a.code2 + b0 + i, V::mul(V::load(x2 + i), r2), V::mul(V::load(x2 + i + V::W), r2));
    }
  }
}

}  // namespace
}  // namespace zero8::bench
