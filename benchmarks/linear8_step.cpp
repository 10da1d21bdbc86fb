// The linear int8 yardstick of `zero8-bench optimizer` (see linear8_step.h): the scalar reference, the
// threaded driver and the choice of variant.
#include "linear8_step.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace zero8::bench {

void linear8_set_hyper(Linear8Args& a, const optim::Hyper& h) {
  const float lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, weight_decay = h.weight_decay;
  const double bc1 = 1.0 - std::pow(double(beta1), double(h.step)), bc2 = 1.0 - std::pow(double(beta2), double(h.step));
  a.b1 = beta1;
  a.b2 = beta2;
  a.decay = float(1.0 - double(lr) * double(weight_decay));
  a.step = float(double(lr) / bc1 * std::sqrt(bc2));
  a.eps_hat = float(double(eps) * std::sqrt(bc2));
  // The bound of exact Adam moments, |m| <= ratio_max sqrt(v) (optim_math.h), for beta1^2 < beta2.
  a.ratio_max = float((1.0 - double(beta1)) /
                      std::sqrt((1.0 - double(beta2)) * (1.0 - double(beta1) * double(beta1) / double(beta2))));
}

void linear8_step_ref(const Linear8Args& a, int64_t lo, int64_t hi) {
  const float c1 = 1.0f - a.b1, c2 = 1.0f - a.b2;
  float x1[4096], x2[4096];
  for (int64_t b0 = lo; b0 < hi; b0 += a.block) {
    const int64_t b = b0 / a.block, len = std::min<int64_t>(a.block, hi - b0);
    const float d1 = a.scale1[b] / 127.0f, d2 = a.scale2[b] / 255.0f;
    float max1 = 0.0f, max2 = 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      const int64_t e = b0 + i;
      const float g = a.grad[e];
      const float m = a.b1 * (float(a.code1[e]) * d1) + c1 * g;
      const float v = a.b2 * (float(a.code2[e]) * d2) + c2 * (g * g);
      const float u = std::max(-a.ratio_max, std::min(a.ratio_max, m / (std::sqrt(v) + a.eps_hat)));
      a.param[e] = a.param[e] * a.decay - a.step * u;
      x1[i] = m;
      x2[i] = v;
      max1 = std::max(max1, std::fabs(m));
      max2 = std::max(max2, v);
    }
    a.scale1[b] = max1;
    a.scale2[b] = max2;
    const float r1 = max1 > 0.0f ? 127.0f / max1 : 0.0f, r2 = max2 > 0.0f ? 255.0f / max2 : 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      a.code1[b0 + i] = int8_t(std::clamp(std::nearbyint(x1[i] * r1), -128.0f, 127.0f));
      a.code2[b0 + i] = uint8_t(std::clamp(std::nearbyint(x2[i] * r2), 0.0f, 255.0f));
    }
  }
}

void linear8_step(const Linear8Args& a, Isa isa, int threads) {
  void (*fn)(const Linear8Args&, int64_t, int64_t) = linear8_step_ref;
#if ZERO8_WITH_X86_SIMD
  if (isa == Isa::avx512) fn = linear8_step_avx512;
  if (isa == Isa::avx2) fn = linear8_step_avx2;
#else
  (void)isa;
#endif
  constexpr int64_t kChunk = 65536;  // as zero8's step (kStepChunk in optim_dispatch.cpp)
  const int64_t per_chunk = std::max<int64_t>(1, kChunk / a.block) * a.block;
  const int64_t nchunks = (a.n + per_chunk - 1) / per_chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < nchunks; ++c) fn(a, c * per_chunk, std::min(a.n, (c + 1) * per_chunk));
}

}  // namespace zero8::bench
