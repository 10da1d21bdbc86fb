// Per-element update rules of the fused optimizers, shared by the scalar reference, the CUDA kernels
// and (as the specification they mirror operation by operation) the SIMD variants. One rounding per
// operation, no implicit FMA (-ffp-contract=off, nvcc --fmad=false): every variant gets the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"

namespace zero8::optim {

// Scalars of one step, derived once on the host from Hyper (in double, rounded once to float) and
// passed by value to every variant, so no variant recomputes a power or a bias correction itself.
struct OptimConsts {
  float grad_scale;    // g <- g * grad_scale before anything else
  float lr;
  float beta1, beta1_c;  // beta1 and 1 - beta1 (sgd/lars: momentum)
  float beta2, beta2_c;  // beta2 and 1 - beta2 (rmsprop: alpha)
  float eps;
  float weight_decay;
  float step_size;     // adam/adamw: lr sqrt(1 - beta2^t) / (1 - beta1^t) (Kingma & Ba's alpha_t);
                       // adagrad: lr / (1 + (t - 1) lr_decay); others: lr
  float eps_hat;       // adam/adamw/lamb: eps sqrt(1 - beta2^t) (Kingma & Ba's epsilon-hat); others: eps
  float lamb_scale;    // lamb: sqrt(1 - beta2^t) / (1 - beta1^t)
  float decay;         // adamw/lion: 1 - lr * weight_decay (decoupled decay factor)
  float dampening_c;   // sgd/lars: 1 - dampening
  int32_t first_step;  // sgd/lars: step == 1, the momentum buffer starts as the gradient (torch)
  int32_t nesterov;    // sgd/lars
  int32_t momentum;    // sgd/lars: beta1 != 0 (else the state is neither read nor written)
  float ratio_max;     // adam/adamw/lamb with 8-bit states: the bound on |m| / sqrt(v) (optim_ratio_clamp);
                       // otherwise +inf
};

// Defined in optim_ref.cpp (not inline, so SIMD translation units compiled with other -m flags never
// share a copy of it with the reference). state_bits: 8 or 32, the format of the states this step reads.
OptimConsts optim_consts(Algo a, const Hyper& h, int state_bits);


ZERO8_HD float optim_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// Exact Adam moments (m_0 = v_0 = 0) satisfy |m| <= ratio_max sqrt(v) at every step, with ratio_max =
// (1-b1) / sqrt((1-b2) (1 - b1^2/b2)) when b1^2 < b2 (Cauchy-Schwarz over m's and v's sums of past
// gradients; 1.165 for betas (0.9, 0.95), 7.27 for (0.9, 0.999)). 8-bit states can break it: a v whose
// gradients are about 1e-3.5 of its block's largest rounds to 0 (the unsigned map's smallest value is
// 3.25e-7 of the scale) while m, which scales with g rather than g^2, keeps its code, and m / (sqrt(v) +
// eps) then takes steps of up to m / eps (rare embedding rows: 100x the learning rate). So the ratio
// m / (sqrt(v) + eps_hat) is clamped to +-ratio_max: a no-op for exact moments, the bound for quantized
// ones. NaN passes through (as in the SIMD order, min(bound, r) then max(-bound, .)).
// The bound holds only while the betas stay constant: after a change (say beta2 from 0.999 to 0.95) the
// moments still carry the old betas' sums, and exact moments reach 2.5 against the new bound of 1.165.
// So only 8-bit states are clamped (ratio_max is +inf with 32-bit states, which then follow torch
// whatever the betas do), and with 8-bit states a change of betas can cut such steps short until the
// moments have forgotten the old betas (about 1 / (1 - beta2) steps).
ZERO8_HD float optim_ratio_clamp(float r, float bound) { return r > bound ? bound : (r < -bound ? -bound : r); }

// ---- Adam / AdamW ----
// torch.optim.Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019): m <- b1 m + (1-b1) g,
// v <- b2 v + (1-b2) g^2, p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps), computed in the
// equivalent form of Kingma & Ba's Section 2 (as bitsandbytes does): p <- p - alpha_t m / (sqrt(v) +
// eps_hat), alpha_t = lr sqrt(1-b2^t)/(1-b1^t), eps_hat = eps sqrt(1-b2^t): one division, not two.
// Adam adds the L2 term wd*p to the gradient; AdamW scales the parameter by (1 - lr wd) first.
ZERO8_HD float optim_adam_one(const OptimConsts& c, bool decoupled, float g, float p, float& m, float& v) {
  g = g * c.grad_scale;
  if (decoupled) {
    p = p * c.decay;
  } else {
    g = g + c.weight_decay * p;
  }
  m = c.beta1 * m + c.beta1_c * g;
  v = c.beta2 * v + c.beta2_c * (g * g);
  const float denom = optim_sqrt(v) + c.eps_hat;
  return p - c.step_size * optim_ratio_clamp(m / denom, c.ratio_max);
}

// ---- SGD with momentum, and LARS ----
// torch.optim.SGD: d = g + wd p; buf <- d on the first step, else momentum buf + (1 - dampening) d;
// d <- d + momentum buf (Nesterov) or buf; p <- p - lr d. LARS (You et al. 2017, "Large Batch
// Training of Convolutional Networks", as timm's Lars implements it) is the same with d scaled by the
// per-tensor trust ratio eta ||p|| / ||g + wd p|| before the momentum (trust = 1 for plain SGD).
ZERO8_HD float optim_sgd_one(const OptimConsts& c, float g, float p, float& buf, float trust) {
  float d = g * c.grad_scale;
  d = d + c.weight_decay * p;
  d = d * trust;
  if (c.momentum) {
    buf = c.first_step ? d : c.beta1 * buf + c.dampening_c * d;
    d = c.nesterov ? d + c.beta1 * buf : buf;
  }
  return p - c.lr * d;
}

// LARS phase 1: the vector whose norm is the denominator of the trust ratio, g + wd p.
ZERO8_HD float optim_lars_direction(const OptimConsts& c, float g, float p) {
  const float d = g * c.grad_scale;
  return d + c.weight_decay * p;
}

// ---- Lion ----
// Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Program 1: p <- p (1 - lr wd);
// p <- p - lr sign(b1 m + (1-b1) g); m <- b2 m + (1-b2) g. sign(+-0) = +0 as torch.sign; sign(NaN) = NaN as
// numpy.sign and jax.numpy.sign (the paper's Lion is optax's), not 0 as torch.sign: with 0, a NaN gradient
// would leave its parameter as it is and its momentum NaN, so the element would stop training for good
// without a NaN anywhere in the model.
ZERO8_HD float optim_sign(float u) { return u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : (u == u ? 0.0f : u)); }

ZERO8_HD float optim_lion_one(const OptimConsts& c, float g, float p, float& m) {
  g = g * c.grad_scale;
  p = p * c.decay;
  const float u = c.beta1 * m + c.beta1_c * g;
  const float s = optim_sign(u);
  m = c.beta2 * m + c.beta2_c * g;
  return p - c.lr * s;
}

// ---- RMSprop ----
// torch.optim.RMSprop (Hinton's lecture 6e; not centered, no momentum): g <- g + wd p;
// v <- alpha v + (1-alpha) g^2; p <- p - lr g / (sqrt(v) + eps). alpha is Hyper::beta2.
ZERO8_HD float optim_rmsprop_one(const OptimConsts& c, float g, float p, float& v) {
  g = g * c.grad_scale;
  g = g + c.weight_decay * p;
  v = c.beta2 * v + c.beta2_c * (g * g);
  const float avg = optim_sqrt(v) + c.eps;
  return p - c.lr * (g / avg);
}

// ---- Adagrad ----
// torch.optim.Adagrad (Duchi et al. 2011): clr = lr / (1 + (t-1) lr_decay); g <- g + wd p;
// s <- s + g^2 (s starts at initial_accumulator); p <- p - clr g / (sqrt(s) + eps).
ZERO8_HD float optim_adagrad_one(const OptimConsts& c, float g, float p, float& s) {
  g = g * c.grad_scale;
  g = g + c.weight_decay * p;
  s = s + g * g;
  const float std_ = optim_sqrt(s) + c.eps;
  return p - c.step_size * (g / std_);
}

// ---- LAMB ----
// You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
// Algorithm 2: Adam moments, u = m_hat / (sqrt(v_hat) + eps) + wd p (decoupled decay inside the
// update), p <- p - lr * trust * u with trust = ||p|| / ||u|| per tensor (two phases: norms, step).
// m_hat / (sqrt(v_hat) + eps) is computed as lamb_scale * m / (sqrt(v) + eps_hat), as for Adam.
// Updates m and v (phase 1 passes copies) and returns u.
ZERO8_HD float optim_lamb_direction(const OptimConsts& c, float g, float p, float& m, float& v) {
  g = g * c.grad_scale;
  m = c.beta1 * m + c.beta1_c * g;
  v = c.beta2 * v + c.beta2_c * (g * g);
  const float denom = optim_sqrt(v) + c.eps_hat;
  return c.lamb_scale * optim_ratio_clamp(m / denom, c.ratio_max) + c.weight_decay * p;
}
// lr_trust = lr * trust of the element's tensor (one float product, computed per segment).
ZERO8_HD float optim_lamb_one(const OptimConsts& c, float g, float p, float& m, float& v, float lr_trust) {
  const float u = optim_lamb_direction(c, g, p, m, v);
  return p - lr_trust * u;
}

// ---- non-finite states ----
// An 8-bit state block stores codes and one scale: a NaN or Inf among its new states would make the scale
// NaN, and at the next step all block-size elements of the state, and so of the parameter, NaN (or, for
// Lion, frozen). So with 8-bit states a non-finite new state is stored as 0 and the block's scale comes from
// its finite states: the element that took the NaN/Inf keeps it in its parameter (which the update has
// already written, as torch's would be), and the other elements of the block train on as in torch.
// 32-bit states keep the value, as torch's do. Every variant encodes what applying this to each new 8-bit
// state before taking the block's range gives (the SIMD ones apply it to a block only when its range
// shows a non-finite state, so the common step pays nothing for it).
ZERO8_HD float optim_state_finite(float s) { return s - s == 0.0f ? s : 0.0f; }

// One element of any algorithm: returns the new parameter, updates s1/s2 in place (unused states may
// be any value). `trust` is the segment's trust ratio (lamb/lars; 1 otherwise).
ZERO8_HD float optim_update_one(Algo a, const OptimConsts& c, float g, float p, float& s1, float& s2, float trust) {
  switch (a) {
    case Algo::adam: return optim_adam_one(c, false, g, p, s1, s2);
    case Algo::adamw: return optim_adam_one(c, true, g, p, s1, s2);
    case Algo::sgd: return optim_sgd_one(c, g, p, s1, 1.0f);
    case Algo::lion: return optim_lion_one(c, g, p, s1);
    case Algo::rmsprop: return optim_rmsprop_one(c, g, p, s1);
    case Algo::adagrad: return optim_adagrad_one(c, g, p, s1);
    case Algo::lamb: return optim_lamb_one(c, g, p, s1, s2, c.lr * trust);
    case Algo::lars: return optim_sgd_one(c, g, p, s1, trust);
  }
  return p;
}

// Phase 1 of lamb/lars: the element of the vector whose norm forms the trust ratio's denominator
// (states are read, not written).
ZERO8_HD float optim_direction_one(Algo a, const OptimConsts& c, float g, float p, float s1, float s2) {
  if (a == Algo::lamb) return optim_lamb_direction(c, g, p, s1, s2);
  return optim_lars_direction(c, g, p);
}

// ---- trust ratio (LAMB / LARS, between the phases) ----
// optim_trust_ratio's definition, here so that the CUDA step can compute it on the device (no host
// read between the phases): ||w|| / ||u|| (times eta for lars), 1 when either norm is 0 or NaN,
// clipped at max_trust_ratio (0: no clip), then raised to min_trust_ratio. In double, each operation
// correctly rounded on both sides, then rounded once to float. 1 for the algorithms without a ratio.
ZERO8_HD double optim_sqrt_f64(double x) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
ZERO8_HD float optim_trust_ratio_of(Algo a, const Hyper& h, double w_sq, double u_sq) {
  if (a != Algo::lamb && a != Algo::lars) return 1.0f;
  const double w = optim_sqrt_f64(w_sq), u = optim_sqrt_f64(u_sq);
  if (!(w > 0.0) || !(u > 0.0)) return 1.0f;  // also NaN norms: leave the update unscaled
  double r = w / u;
  if (a == Algo::lars) r *= double(h.trust_coefficient);
  if (h.max_trust_ratio > 0.0f && r > double(h.max_trust_ratio)) r = double(h.max_trust_ratio);
  if (r < double(h.min_trust_ratio)) r = double(h.min_trust_ratio);
  return float(r);
}

// ---- norm reduction order (phase 1) ----
// Squares are formed exactly in double (a float product fits in 53 bits). Within a piece (one
// segment's part of one state block) element k of the piece goes to lane k % 8; the lanes combine as
// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). Piece sums add up in order within a chunk of
// kOptimNormChunk elements, chunk sums in order per segment. The chunk grid is fixed from the start
// of the range, so the result is identical for every variant and every thread count.
constexpr int64_t kOptimNormChunk = 16384;  // a multiple of every state block size (<= 4096)
ZERO8_HD double optim_norm_lanes_sum(const double* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

}  // namespace zero8::optim
