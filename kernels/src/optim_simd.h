// The fused optimizer loop written once over a vector-traits class V, included by optim_avx2.cpp and
// optim_avx512.cpp (each defines V with its intrinsics and the codec block helpers to use). Mirrors
// optim_math.h operation by operation, so every lane rounds exactly as the scalar reference.
// Everything here has internal linkage: each ISA's copy stays in its own translation unit (an inline
// function shared across TUs compiled with different -m flags could be merged into the wrong one).
#pragma once

#include <cstdint>
#include <cstring>

#include "codec_internal.h"
#include "optim_walk.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/optim_math.h"

#if !defined(ZERO8_OPTIM_BLOCK_DECODE) || !defined(ZERO8_OPTIM_BLOCK_ENCODE)
#error "define ZERO8_OPTIM_BLOCK_DECODE / ZERO8_OPTIM_BLOCK_ENCODE before including optim_simd.h"
#endif

namespace zero8::optim {
namespace {

constexpr int kMaxBlock = 4096;

int simd_dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

// The step constants broadcast once per call.
template <class V>
struct VConsts {
  using F = typename V::F;
  F gs, lr, b1, b1c, b2, b2c, eps, wd, step, eps_hat, lamb_scale, decay, dampc, ratio_max, ratio_min;
  bool first, nesterov, momentum;
  explicit VConsts(const OptimConsts& c)
      : gs(V::set1(c.grad_scale)), lr(V::set1(c.lr)), b1(V::set1(c.beta1)), b1c(V::set1(c.beta1_c)),
        b2(V::set1(c.beta2)), b2c(V::set1(c.beta2_c)), eps(V::set1(c.eps)), wd(V::set1(c.weight_decay)),
        step(V::set1(c.step_size)), eps_hat(V::set1(c.eps_hat)), lamb_scale(V::set1(c.lamb_scale)), decay(V::set1(c.decay)),
        dampc(V::set1(c.dampening_c)), ratio_max(V::set1(c.ratio_max)), ratio_min(V::set1(-c.ratio_max)),
        first(c.first_step != 0), nesterov(c.nesterov != 0), momentum(c.momentum != 0) {}
};

// optim_ratio_clamp: min(bound, r) then max(-bound, .), in that operand order so that a NaN r passes
// through (x86 min/max return the second operand when either is NaN), as the scalar rule.
template <class V>
inline typename V::F simd_ratio_clamp(const VConsts<V>& k, typename V::F r) {
  return V::max(k.ratio_min, V::min(k.ratio_max, r));
}

// Where one piece's elements live; element j of the piece is at index j of every pointer.
struct Ptrs {
  const void* grad = nullptr;
  DType gdt = DType::f32;
  const float* pin = nullptr;  // fp32 parameter value: the master, or the fp32 parameter itself
  float* master = nullptr;     // written when non-null
  void* param = nullptr;       // written (rounded to pdt) when non-null
  DType pdt = DType::f32;
  float* s1 = nullptr;         // fp32 states (decoded block buffer or 32-bit state array); null: unused
  float* s2 = nullptr;
};

// ---- the element rules (optim_math.h), vectorized ----
template <class V, Algo A>
inline typename V::F simd_update(const VConsts<V>& k, typename V::F g, typename V::F p, typename V::F& s1,
                                 typename V::F& s2, typename V::F trust, typename V::F lr_trust) {
  using F = typename V::F;
  if constexpr (A == Algo::adam || A == Algo::adamw) {  // optim_adam_one
    g = V::mul(g, k.gs);
    if constexpr (A == Algo::adamw) {
      p = V::mul(p, k.decay);
    } else {
      g = V::add(g, V::mul(k.wd, p));
    }
    s1 = V::add(V::mul(k.b1, s1), V::mul(k.b1c, g));
    s2 = V::add(V::mul(k.b2, s2), V::mul(k.b2c, V::mul(g, g)));
    const F denom = V::add(V::sqrt(s2), k.eps_hat);
    return V::sub(p, V::mul(k.step, simd_ratio_clamp(k, V::div(s1, denom))));
  } else if constexpr (A == Algo::sgd || A == Algo::lars) {  // optim_sgd_one
    F d = V::mul(g, k.gs);
    d = V::add(d, V::mul(k.wd, p));
    d = V::mul(d, trust);
    if (k.momentum) {
      s1 = k.first ? d : V::add(V::mul(k.b1, s1), V::mul(k.dampc, d));
      d = k.nesterov ? V::add(d, V::mul(k.b1, s1)) : s1;
    }
    return V::sub(p, V::mul(k.lr, d));
  } else if constexpr (A == Algo::lion) {  // optim_lion_one
    g = V::mul(g, k.gs);
    p = V::mul(p, k.decay);
    const F u = V::add(V::mul(k.b1, s1), V::mul(k.b1c, g));
    const F s = V::sign(u);
    s1 = V::add(V::mul(k.b2, s1), V::mul(k.b2c, g));
    return V::sub(p, V::mul(k.lr, s));
  } else if constexpr (A == Algo::rmsprop) {  // optim_rmsprop_one
    g = V::mul(g, k.gs);
    g = V::add(g, V::mul(k.wd, p));
    s1 = V::add(V::mul(k.b2, s1), V::mul(k.b2c, V::mul(g, g)));
    const F avg = V::add(V::sqrt(s1), k.eps);
    return V::sub(p, V::mul(k.lr, V::div(g, avg)));
  } else if constexpr (A == Algo::adagrad) {  // optim_adagrad_one
    g = V::mul(g, k.gs);
    g = V::add(g, V::mul(k.wd, p));
    s1 = V::add(s1, V::mul(g, g));
    const F sd = V::add(V::sqrt(s1), k.eps);
    return V::sub(p, V::mul(k.step, V::div(g, sd)));
  } else {  // lamb: optim_lamb_one
    static_assert(A == Algo::lamb, "unhandled algorithm");
    (void)trust;
    g = V::mul(g, k.gs);
    s1 = V::add(V::mul(k.b1, s1), V::mul(k.b1c, g));
    s2 = V::add(V::mul(k.b2, s2), V::mul(k.b2c, V::mul(g, g)));
    const F denom = V::add(V::sqrt(s2), k.eps_hat);
    const F u = V::add(V::mul(k.lamb_scale, simd_ratio_clamp(k, V::div(s1, denom))), V::mul(k.wd, p));
    return V::sub(p, V::mul(lr_trust, u));
  }
}

// Phase 1 vector: optim_direction_one (lamb: the update u, states read only; otherwise g + wd p).
template <class V, Algo A>
inline typename V::F simd_direction(const VConsts<V>& k, typename V::F g, typename V::F p, typename V::F s1,
                                    typename V::F s2) {
  using F = typename V::F;
  if constexpr (A == Algo::lamb) {
    g = V::mul(g, k.gs);
    s1 = V::add(V::mul(k.b1, s1), V::mul(k.b1c, g));
    s2 = V::add(V::mul(k.b2, s2), V::mul(k.b2c, V::mul(g, g)));
    const F denom = V::add(V::sqrt(s2), k.eps_hat);
    return V::add(V::mul(k.lamb_scale, simd_ratio_clamp(k, V::div(s1, denom))), V::mul(k.wd, p));
  } else {
    (void)s1;
    (void)s2;
    const F d = V::mul(g, k.gs);
    return V::add(d, V::mul(k.wd, p));
  }
}

// ---- step: one vector, a partial vector, a piece ----
template <class V, Algo A>
inline void simd_step_vec(const VConsts<V>& k, const Ptrs& q, int64_t j, typename V::F trust, typename V::F lr_trust) {
  using F = typename V::F;
  const F g = V::load_grad(q.grad, q.gdt, j);
  F p = V::loadu(q.pin + j);
  F s1 = q.s1 ? V::loadu(q.s1 + j) : V::zero();
  F s2 = q.s2 ? V::loadu(q.s2 + j) : V::zero();
  p = simd_update<V, A>(k, g, p, s1, s2, trust, lr_trust);
  if (q.s1) V::storeu(q.s1 + j, s1);
  if (q.s2) V::storeu(q.s2 + j, s2);
  if (q.master) V::storeu(q.master + j, p);
  if (q.param) V::store_param(q.param, q.pdt, j, p);
}

// The last r < W elements of a piece: staged through zero-padded local vectors (the padding lanes
// compute garbage that is never stored), so no load or store leaves the arrays.
template <class V, Algo A>
void simd_step_tail(const VConsts<V>& k, const Ptrs& q, int64_t j, int r, typename V::F trust,
                    typename V::F lr_trust) {
  alignas(64) float g[V::W] = {}, p[V::W] = {}, s1[V::W] = {}, s2[V::W] = {}, m[V::W] = {}, par[V::W] = {};
  const int gb = simd_dtype_bytes(q.gdt), pb = simd_dtype_bytes(q.pdt);
  std::memcpy(g, static_cast<const char*>(q.grad) + j * gb, size_t(r) * gb);
  std::memcpy(p, q.pin + j, size_t(r) * 4);
  if (q.s1) std::memcpy(s1, q.s1 + j, size_t(r) * 4);
  if (q.s2) std::memcpy(s2, q.s2 + j, size_t(r) * 4);
  Ptrs t;
  t.grad = g;
  t.gdt = q.gdt;
  t.pin = p;
  t.master = q.master ? m : nullptr;
  t.param = q.param ? par : nullptr;
  t.pdt = q.pdt;
  t.s1 = q.s1 ? s1 : nullptr;
  t.s2 = q.s2 ? s2 : nullptr;
  simd_step_vec<V, A>(k, t, 0, trust, lr_trust);
  if (q.s1) std::memcpy(q.s1 + j, s1, size_t(r) * 4);
  if (q.s2) std::memcpy(q.s2 + j, s2, size_t(r) * 4);
  if (q.master) std::memcpy(q.master + j, m, size_t(r) * 4);
  if (q.param) std::memcpy(static_cast<char*>(q.param) + j * pb, par, size_t(r) * pb);
}

template <class V, Algo A>
void simd_step_piece(const VConsts<V>& k, const Ptrs& q, int64_t len, float trust, float lr_trust) {
  const typename V::F vt = V::set1(trust), vlt = V::set1(lr_trust);
  int64_t j = 0;
  for (; j + V::W <= len; j += V::W) simd_step_vec<V, A>(k, q, j, vt, vlt);
  if (j < len) simd_step_tail<V, A>(k, q, j, int(len - j), vt, vlt);
}

// Pointers of the piece starting at element i of block [lo, ...); buf1/buf2 hold the block's states.
inline Ptrs simd_piece_ptrs(const StepArgs& a, int64_t i, int64_t lo, bool use1, bool use2, float* buf1,
                            float* buf2, bool write) {
  Ptrs q;
  q.grad = static_cast<const char*>(a.grad) + i * simd_dtype_bytes(a.grad_dtype);
  q.gdt = a.grad_dtype;
  q.pin = a.master ? a.master + i : static_cast<const float*>(a.param) + i;
  if (write) {
    q.master = a.master ? a.master + i : nullptr;
    q.param = static_cast<char*>(a.param) + i * simd_dtype_bytes(a.param_dtype);
  }
  q.pdt = a.param_dtype;
  if (use1) q.s1 = a.bits == 8 ? buf1 + (i - lo) : a.state1 + i;
  if (use2) q.s2 = a.bits == 8 ? buf2 + (i - lo) : a.state2 + i;
  return q;
}

// The block's new 8-bit states x encoded, with optim_state_finite applied. A non-finite state is what makes
// the encoder's scale NaN, so only such a block (rare: the step of a NaN or Inf gradient) is made finite
// and encoded again; the common path pays one compare.
inline float simd_encode_states(float* x, int32_t len, const quant::QuantTable& t, uint8_t* codes) {
  const float scale = ZERO8_OPTIM_BLOCK_ENCODE(x, len, t, codes);
  if (scale == scale) return scale;
  for (int32_t i = 0; i < len; ++i) x[i] = optim_state_finite(x[i]);
  return ZERO8_OPTIM_BLOCK_ENCODE(x, len, t, codes);
}

// One state block [lo, hi): decode its 8-bit states into buf1/buf2, step it piece by piece, encode the
// states again. *seg: the segment of element lo or an earlier one (lamb/lars).
template <class V, Algo A>
void simd_step_block(const StepArgs& a, const OptimConsts& c, const VConsts<V>& k, bool use1, bool use2, int64_t lo,
                     int64_t hi, float* buf1, float* buf2, int64_t* seg) {
  const bool q8 = a.bits == 8;
  constexpr bool trust_algo = algo_has_trust_ratio(A);
  const int32_t len = int32_t(hi - lo);
  const int64_t b = lo / a.block;
  if (use1 && q8) ZERO8_OPTIM_BLOCK_DECODE(a.code1 + lo, len, a.absmax1[b], *a.map1, buf1);
  if (use2 && q8) ZERO8_OPTIM_BLOCK_DECODE(a.code2 + lo, len, a.absmax2[b], *a.map2, buf2);
  for (int64_t i = lo; i < hi;) {
    const int64_t end = trust_algo ? optim_piece_end(a, i, hi, seg) : hi;
    const float trust = (trust_algo && a.seg_trust) ? a.seg_trust[a.nseg > 0 ? *seg : 0] : 1.0f;
    const Ptrs q = simd_piece_ptrs(a, i, lo, use1, use2, buf1, buf2, a.update_params);
    simd_step_piece<V, A>(k, q, end - i, trust, c.lr * trust);
    i = end;
  }
  if (use1 && q8) a.absmax1[b] = simd_encode_states(buf1, len, *a.map1, a.code1 + lo);
  if (use2 && q8) a.absmax2[b] = simd_encode_states(buf2, len, *a.map2, a.code2 + lo);
}

template <class V, Algo A>
void simd_step(const StepArgs& a) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const VConsts<V> k(c);
  const bool use1 = optim_uses_state(a.algo, a.h, 1), use2 = optim_uses_state(a.algo, a.h, 2);
  alignas(64) float buf1[kMaxBlock], buf2[kMaxBlock];
  int64_t seg = 0;
  for (int64_t lo = 0; lo < a.n; lo += a.block) {
    const int64_t hi = lo + a.block < a.n ? lo + a.block : a.n;
    simd_step_block<V, A>(a, c, k, use1, use2, lo, hi, buf1, buf2, &seg);
  }
}

// ---- norms (phase 1), in the order fixed in optim_math.h ----
template <class V, Algo A>
void simd_norms_piece(const VConsts<V>& k, const Ptrs& q, int64_t len, double* w_sq, double* u_sq) {
  using F = typename V::F;
  typename V::Acc aw = V::acc_zero(), au = V::acc_zero();
  int64_t j = 0;
  for (; j + V::W <= len; j += V::W) {
    const F g = V::load_grad(q.grad, q.gdt, j);
    const F p = V::loadu(q.pin + j);
    const F s1 = q.s1 ? V::loadu(q.s1 + j) : V::zero();
    const F s2 = q.s2 ? V::loadu(q.s2 + j) : V::zero();
    V::acc_add_sq(aw, p);
    V::acc_add_sq(au, simd_direction<V, A>(k, g, p, s1, s2));
  }
  if (j < len) {
    const int r = int(len - j);
    alignas(64) float g[V::W] = {}, p[V::W] = {}, s1[V::W] = {}, s2[V::W] = {};
    const int gb = simd_dtype_bytes(q.gdt);
    std::memcpy(g, static_cast<const char*>(q.grad) + j * gb, size_t(r) * gb);
    std::memcpy(p, q.pin + j, size_t(r) * 4);
    if (q.s1) std::memcpy(s1, q.s1 + j, size_t(r) * 4);
    if (q.s2) std::memcpy(s2, q.s2 + j, size_t(r) * 4);
    const F vp = V::loadu(p);
    const F u = simd_direction<V, A>(k, V::load_grad(g, q.gdt, 0), vp, V::loadu(s1), V::loadu(s2));
    // Padding lanes may hold 0/0 (eps == 0): zero them so they add exactly nothing.
    V::acc_add_sq(aw, V::zero_tail(vp, r));
    V::acc_add_sq(au, V::zero_tail(u, r));
  }
  *w_sq = V::acc_sum(aw);
  *u_sq = V::acc_sum(au);
}

template <class V, Algo A>
void simd_norms(const StepArgs& a, NormSums* out) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const VConsts<V> k(c);
  const bool use = A == Algo::lamb;  // lars needs no state in phase 1
  const bool q8 = a.bits == 8;
  NormFold fold(out, a.nseg > 0 ? a.nseg : 1);
  alignas(64) float buf1[kMaxBlock], buf2[kMaxBlock];
  int64_t seg = 0;
  for (int64_t lo = 0; lo < a.n; lo += a.block) {
    const int64_t hi = lo + a.block < a.n ? lo + a.block : a.n;
    const int32_t len = int32_t(hi - lo);
    const int64_t b = lo / a.block, chunk = lo / kOptimNormChunk;
    if (use && q8) {
      ZERO8_OPTIM_BLOCK_DECODE(a.code1 + lo, len, a.absmax1[b], *a.map1, buf1);
      ZERO8_OPTIM_BLOCK_DECODE(a.code2 + lo, len, a.absmax2[b], *a.map2, buf2);
    }
    for (int64_t i = lo; i < hi;) {
      const int64_t end = optim_piece_end(a, i, hi, &seg);
      const Ptrs q = simd_piece_ptrs(a, i, lo, use, use, buf1, buf2, false);
      double w = 0.0, u = 0.0;
      simd_norms_piece<V, A>(k, q, end - i, &w, &u);
      fold.add(seg, chunk, w, u);
      i = end;
    }
  }
  fold.finish();
}

template <class V>
void simd_step_any(const StepArgs& a) {
  switch (a.algo) {
    case Algo::adam: return simd_step<V, Algo::adam>(a);
    case Algo::adamw: return simd_step<V, Algo::adamw>(a);
    case Algo::sgd: return simd_step<V, Algo::sgd>(a);
    case Algo::lion: return simd_step<V, Algo::lion>(a);
    case Algo::rmsprop: return simd_step<V, Algo::rmsprop>(a);
    case Algo::adagrad: return simd_step<V, Algo::adagrad>(a);
    case Algo::lamb: return simd_step<V, Algo::lamb>(a);
    case Algo::lars: return simd_step<V, Algo::lars>(a);
  }
}

template <class V>
void simd_norms_any(const StepArgs& a, NormSums* out) {
  if (a.algo == Algo::lamb) return simd_norms<V, Algo::lamb>(a, out);
  return simd_norms<V, Algo::lars>(a, out);  // every other algorithm: g + wd p, as the reference
}

}  // namespace
}  // namespace zero8::optim
