// Scalar reference of the fused optimizers: block by block, dequantize the states, apply the element
// rule of optim_math.h, requantize, write the parameter. The plain definition every SIMD variant and
// the CUDA kernels are checked against; also the step constants and the trust ratio.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "codec_internal.h"
#include "optim_walk.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/optim_math.h"

namespace zero8::optim {

bool optim_uses_state(Algo a, const Hyper& h, int which) {
  if (which < 1 || which > algo_num_states(a)) return false;
  if (a == Algo::sgd || a == Algo::lars) return h.beta1 != 0.0f;
  return true;
}

OptimConsts optim_consts(Algo a, const Hyper& h, int state_bits) {
  OptimConsts c{};
  const double t = double(h.step);
  const bool adam_like = a == Algo::adam || a == Algo::adamw || a == Algo::lamb;
  const bool bc = h.bias_correction && adam_like;
  const double bc1 = bc ? 1.0 - std::pow(double(h.beta1), t) : 1.0;
  const double bc2 = bc ? 1.0 - std::pow(double(h.beta2), t) : 1.0;
  c.grad_scale = h.grad_scale;
  c.lr = h.lr;
  c.beta1 = h.beta1;
  c.beta1_c = float(1.0 - double(h.beta1));
  c.beta2 = h.beta2;
  c.beta2_c = float(1.0 - double(h.beta2));
  c.eps = h.eps;
  c.weight_decay = h.weight_decay;
  const double bc2_sqrt = std::sqrt(bc2);
  if (a == Algo::adam || a == Algo::adamw) {
    c.step_size = float(double(h.lr) * bc2_sqrt / bc1);
  } else if (a == Algo::adagrad) {
    c.step_size = float(double(h.lr) / (1.0 + (t - 1.0) * double(h.lr_decay)));
  } else {
    c.step_size = h.lr;
  }
  c.eps_hat = adam_like ? float(double(h.eps) * bc2_sqrt) : h.eps;
  c.lamb_scale = float(bc2_sqrt / bc1);
  c.decay = float(1.0 - double(h.lr) * double(h.weight_decay));
  c.dampening_c = float(1.0 - double(h.dampening));
  c.first_step = h.step <= 1;
  c.nesterov = h.nesterov;
  c.momentum = h.beta1 != 0.0f;
  const double b1 = h.beta1, b2 = h.beta2;
  const bool bounded = adam_like && state_bits == 8 && b1 * b1 < b2;  // optim_math.h, optim_ratio_clamp
  c.ratio_max = bounded ? float((1.0 - b1) / std::sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2)))
                        : std::numeric_limits<float>::infinity();
  return c;
}

float optim_trust_ratio(Algo a, const Hyper& h, const NormSums& s) {
  return optim_trust_ratio_of(a, h, s.w_sq, s.u_sq);
}

namespace {

// The states of one block as fp32: decoded into a local buffer (8-bit) or the state array itself
// (32-bit); index with [i - off] for element i of the range.
struct BlockStates {
  float* s = nullptr;
  int64_t off = 0;
};

BlockStates block_states_load(const StepArgs& a, int which, bool used, int64_t lo, int32_t len, float* buf) {
  BlockStates st;
  if (!used) return st;
  if (a.bits == 32) {
    st.s = which == 1 ? a.state1 : a.state2;
    return st;
  }
  const uint8_t* codes = which == 1 ? a.code1 : a.code2;
  const float* absmax = which == 1 ? a.absmax1 : a.absmax2;
  const quant::QuantTable& t = which == 1 ? *a.map1 : *a.map2;
  quant::quant_block_decode_f32_ref(codes + lo, len, absmax[lo / a.block], t, buf);
  st.s = buf;
  st.off = lo;
  return st;
}

void block_states_store(const StepArgs& a, int which, bool used, int64_t lo, int32_t len, float* buf) {
  if (!used || a.bits == 32) return;
  for (int32_t i = 0; i < len; ++i) buf[i] = optim_state_finite(buf[i]);
  uint8_t* codes = which == 1 ? a.code1 : a.code2;
  float* absmax = which == 1 ? a.absmax1 : a.absmax2;
  const quant::QuantTable& t = which == 1 ? *a.map1 : *a.map2;
  absmax[lo / a.block] = quant::quant_block_encode_f32_ref(buf, len, t, codes + lo);
}

float param_load(const StepArgs& a, int64_t i) {
  return a.master ? a.master[i] : static_cast<const float*>(a.param)[i];
}

}  // namespace

void optim_step_ref(const StepArgs& a) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const bool use1 = optim_uses_state(a.algo, a.h, 1), use2 = optim_uses_state(a.algo, a.h, 2);
  const bool trust_algo = algo_has_trust_ratio(a.algo);
  std::vector<float> buf1(a.block), buf2(a.block);
  int64_t seg = 0;
  for (int64_t lo = 0; lo < a.n; lo += a.block) {
    const int64_t hi = std::min<int64_t>(a.n, lo + a.block);
    const int32_t len = int32_t(hi - lo);
    const BlockStates st1 = block_states_load(a, 1, use1, lo, len, buf1.data());
    const BlockStates st2 = block_states_load(a, 2, use2, lo, len, buf2.data());
    for (int64_t i = lo; i < hi;) {
      // One piece: the part of the block inside one segment (one trust ratio).
      const int64_t end = optim_piece_end(a, i, hi, &seg);
      const float trust = (trust_algo && a.seg_trust) ? a.seg_trust[a.nseg > 0 ? seg : 0] : 1.0f;
      for (; i < end; ++i) {
        float unused1 = 0.0f, unused2 = 0.0f;
        float& s1 = st1.s ? st1.s[i - st1.off] : unused1;
        float& s2 = st2.s ? st2.s[i - st2.off] : unused2;
        const float g = dtype_load(a.grad, a.grad_dtype, i);
        const float p = optim_update_one(a.algo, c, g, param_load(a, i), s1, s2, trust);
        if (a.update_params) {
          if (a.master) a.master[i] = p;
          dtype_store(a.param, a.param_dtype, i, p);
        }
      }
    }
    block_states_store(a, 1, use1, lo, len, buf1.data());
    block_states_store(a, 2, use2, lo, len, buf2.data());
  }
}

void optim_norms_ref(const StepArgs& a, NormSums* out) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const bool use1 = a.algo == Algo::lamb, use2 = a.algo == Algo::lamb;  // lars needs no state here
  NormFold fold(out, a.nseg > 0 ? a.nseg : 1);
  std::vector<float> buf1(a.block), buf2(a.block);
  int64_t seg = 0;
  for (int64_t lo = 0; lo < a.n; lo += a.block) {
    const int64_t hi = std::min<int64_t>(a.n, lo + a.block);
    const int32_t len = int32_t(hi - lo);
    const BlockStates st1 = block_states_load(a, 1, use1, lo, len, buf1.data());
    const BlockStates st2 = block_states_load(a, 2, use2, lo, len, buf2.data());
    const int64_t chunk = lo / kOptimNormChunk;
    for (int64_t i = lo; i < hi;) {
      const int64_t end = optim_piece_end(a, i, hi, &seg);
      double lw[8] = {}, lu[8] = {};
      for (const int64_t start = i; i < end; ++i) {
        const float g = dtype_load(a.grad, a.grad_dtype, i);
        const float p = param_load(a, i);
        const float s1 = st1.s ? st1.s[i - st1.off] : 0.0f;
        const float s2 = st2.s ? st2.s[i - st2.off] : 0.0f;
        const float u = optim_direction_one(a.algo, c, g, p, s1, s2);
        lw[(i - start) & 7] += double(p) * double(p);
        lu[(i - start) & 7] += double(u) * double(u);
      }
      fold.add(seg, chunk, optim_norm_lanes_sum(lw), optim_norm_lanes_sum(lu));
    }
  }
  fold.finish();
}

}  // namespace zero8::optim
