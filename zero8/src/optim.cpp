// Validated optimizer API over the fused kernels: state layout and allocation, argument checks, and
// the two-phase LAMB/LARS step for a single tensor.
#include "zero8/optim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "arg_checks.h"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"

namespace zero8::optim {
namespace {

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

bool algo_valid(Algo a) { return uint8_t(a) <= uint8_t(Algo::lars); }

void layout_check(Algo algo, int64_t n, int bits, int32_t block) {
  ZERO8_CHECK_ARG(algo_valid(algo), "algo", "unknown algorithm " << int(algo));
  ZERO8_CHECK_ARG(n >= 0, "n", "negative length " << n);
  ZERO8_CHECK_ARG(bits == 8 || bits == 32, "bits", "must be 8 or 32, got " << bits);
  ZERO8_CHECK_ARG(block >= 64 && block <= 4096 && (block & (block - 1)) == 0, "block",
                  "must be a power of two in 64..4096, got " << block);
}

const char* state_name(int which, const char* kind) {
  static const char* names[2][4] = {{"code1", "absmax1", "map1", "state1"}, {"code2", "absmax2", "map2", "state2"}};
  const int k = kind[0] == 'c' ? 0 : kind[0] == 'a' ? 1 : kind[0] == 'm' ? 2 : 3;
  return names[which - 1][k];
}

}  // namespace

StateLayout::StateLayout(Algo algo_, int64_t n_, int bits_, int32_t block_)
    : algo(algo_), n(n_), bits(bits_), block(block_) {
  layout_check(algo, n, bits, block);
  num_states = algo_num_states(algo);
}

int64_t StateLayout::bytes() const {
  const int64_t per_state = bits == 8 ? n + 4 * num_blocks() : 4 * n;
  return int64_t(num_states) * per_state;
}

double StateLayout::bytes_per_param() const { return n > 0 ? double(bytes()) / double(n) : 0.0; }

State::State(const StateLayout& layout, float initial_accumulator, quant::MapKind map1, quant::MapKind map2)
    : layout_(layout) {
  layout_check(layout.algo, layout.n, layout.bits, layout.block);
  ZERO8_CHECK_ARG(layout.num_states == algo_num_states(layout.algo), "layout",
                  "num_states " << layout.num_states << " but " << algo_name(layout.algo) << " has "
                                << algo_num_states(layout.algo));
  ZERO8_CHECK_ARG(std::isfinite(initial_accumulator) && initial_accumulator >= 0.0f, "initial_accumulator",
                  "must be finite and >= 0, got " << initial_accumulator);
  ZERO8_CHECK_ARG(initial_accumulator == 0.0f || layout.algo == Algo::adagrad, "initial_accumulator",
                  "only Adagrad starts from a nonzero accumulator");
  const quant::MapKind kinds[2] = {map1, map2};
  for (int k = 0; k < layout_.num_states; ++k) {
    const float init = layout_.algo == Algo::adagrad ? initial_accumulator : 0.0f;
    if (layout_.bits == 32) {
      fp32_[k].assign(size_t(layout_.n), init);
      continue;
    }
    maps_[k] = &quant::table_get(kinds[k]);
    codes_[k].resize(size_t(layout_.n));
    absmax_[k].resize(size_t(layout_.num_blocks()));
    // Quantize the constant initial value block by block (zero: zero codes and zero scales; a
    // positive accumulator: the value reproduced exactly, as the block's absmax).
    const std::vector<float> fill(size_t(layout_.block), init);
    quant::EncodeArgs e;
    e.dtype = DType::f32;
    e.block = layout_.block;
    e.table = maps_[k];
    for (int64_t lo = 0; lo < layout_.n; lo += layout_.block) {
      e.x = fill.data();
      e.n = std::min<int64_t>(layout_.block, layout_.n - lo);
      e.codes = codes_[k].data() + lo;
      e.absmax = absmax_[k].data() + lo / layout_.block;
      quant::quant_encode_ref(e);
    }
  }
}

int State::index(int which) const {
  ZERO8_CHECK_ARG(which >= 1 && which <= layout_.num_states, "which",
                  "state " << which << " of " << algo_name(layout_.algo) << " (" << layout_.num_states << " states)");
  return which - 1;
}

uint8_t* State::codes(int which) { return layout_.bits == 8 ? codes_[index(which)].data() : nullptr; }
float* State::absmax(int which) { return layout_.bits == 8 ? absmax_[index(which)].data() : nullptr; }
float* State::fp32(int which) { return layout_.bits == 32 ? fp32_[index(which)].data() : nullptr; }
const quant::QuantTable* State::map(int which) const { return maps_[index(which)]; }

std::vector<float> State::values(int which) const {
  const int k = index(which);
  if (layout_.bits == 32) return fp32_[k];
  std::vector<float> out(size_t(layout_.n));
  quant::DecodeArgs d;
  d.codes = codes_[k].data();
  d.absmax = absmax_[k].data();
  d.n = layout_.n;
  d.block = layout_.block;
  d.table = maps_[k];
  d.y = out.data();
  d.dtype = DType::f32;
  quant::quant_decode_ref(d);
  return out;
}

void State::bind(StepArgs& a) {
  a.algo = layout_.algo;
  a.n = layout_.n;
  a.bits = layout_.bits;
  a.block = layout_.block;
  a.code1 = a.code2 = nullptr;
  a.absmax1 = a.absmax2 = nullptr;
  a.map1 = a.map2 = nullptr;
  a.state1 = a.state2 = nullptr;
  if (layout_.bits == 8) {
    a.code1 = codes_[0].data();
    a.absmax1 = absmax_[0].data();
    a.map1 = maps_[0];
    if (layout_.num_states == 2) {
      a.code2 = codes_[1].data();
      a.absmax2 = absmax_[1].data();
      a.map2 = maps_[1];
    }
  } else {
    a.state1 = fp32_[0].data();
    if (layout_.num_states == 2) a.state2 = fp32_[1].data();
  }
}

void hyper_validate(Algo algo, const Hyper& h) {
  ZERO8_CHECK_ARG(algo_valid(algo), "algo", "unknown algorithm " << int(algo));
  auto finite = [](float x) { return std::isfinite(x); };
  ZERO8_CHECK_ARG(finite(h.lr) && h.lr >= 0.0f, "lr", "learning rate must be finite and >= 0, got " << h.lr);
  ZERO8_CHECK_ARG(h.beta1 >= 0.0f && h.beta1 < 1.0f, "beta1", "must be in [0, 1), got " << h.beta1);
  ZERO8_CHECK_ARG(h.beta2 >= 0.0f && h.beta2 < 1.0f, "beta2", "must be in [0, 1), got " << h.beta2);
  ZERO8_CHECK_ARG(finite(h.eps) && h.eps >= 0.0f, "eps", "must be finite and >= 0, got " << h.eps);
  ZERO8_CHECK_ARG(finite(h.weight_decay) && h.weight_decay >= 0.0f, "weight_decay",
                  "must be finite and >= 0, got " << h.weight_decay);
  ZERO8_CHECK_ARG(h.dampening >= 0.0f && h.dampening <= 1.0f, "dampening", "must be in [0, 1], got " << h.dampening);
  if (h.nesterov && (algo == Algo::sgd || algo == Algo::lars))
    ZERO8_CHECK_ARG(h.beta1 > 0.0f && h.dampening == 0.0f, "nesterov",
                    "needs momentum (beta1) > 0 and dampening == 0 (beta1 " << h.beta1 << ", dampening " << h.dampening
                                                                           << ")");
  ZERO8_CHECK_ARG(finite(h.lr_decay) && h.lr_decay >= 0.0f, "lr_decay", "must be finite and >= 0, got " << h.lr_decay);
  ZERO8_CHECK_ARG(finite(h.initial_accumulator) && h.initial_accumulator >= 0.0f, "initial_accumulator",
                  "must be finite and >= 0, got " << h.initial_accumulator);
  ZERO8_CHECK_ARG(finite(h.trust_coefficient) && h.trust_coefficient >= 0.0f, "trust_coefficient",
                  "must be finite and >= 0, got " << h.trust_coefficient);
  ZERO8_CHECK_ARG(finite(h.max_trust_ratio) && h.max_trust_ratio >= 0.0f, "max_trust_ratio",
                  "must be finite and >= 0 (0: no clip), got " << h.max_trust_ratio);
  ZERO8_CHECK_ARG(finite(h.min_trust_ratio) && h.min_trust_ratio >= 0.0f &&
                      (h.max_trust_ratio == 0.0f || h.min_trust_ratio <= h.max_trust_ratio),
                  "min_trust_ratio", "must be finite, >= 0 and <= max_trust_ratio " << h.max_trust_ratio << ", got "
                                                                                 << h.min_trust_ratio);
  ZERO8_CHECK_ARG(h.step >= 1, "step", "the 1-based step number must be >= 1, got " << h.step);
  ZERO8_CHECK_ARG(finite(h.grad_scale) && h.grad_scale > 0.0f, "grad_scale",
                  "must be finite and > 0, got " << h.grad_scale);
}

void args_validate(const StepArgs& a, bool phase2) {
  layout_check(a.algo, a.n, a.bits, a.block);
  hyper_validate(a.algo, a.h);
  check_dtype(a.param_dtype, "param_dtype");
  check_dtype(a.grad_dtype, "grad_dtype");
  if (a.param_dtype == DType::f32) {
    ZERO8_CHECK_ARG(a.master == nullptr, "master",
                    "must be null for a float32 parameter (the parameter is its own master)");
  } else {
    ZERO8_CHECK_ARG(a.master != nullptr, "master",
                    "a " << dtype_name(a.param_dtype) << " parameter needs its float32 master copy");
  }
  ZERO8_CHECK_ARG(a.nseg >= 0, "nseg", "negative segment count " << a.nseg);
  if (a.nseg > 0) {
    ZERO8_CHECK_ARG(a.seg_offsets != nullptr, "seg_offsets", "null with nseg = " << a.nseg);
    ZERO8_CHECK_ARG(a.seg_offsets[0] == 0, "seg_offsets", "must start at 0, got " << a.seg_offsets[0]);
    for (int64_t s = 0; s < a.nseg; ++s)
      ZERO8_CHECK_ARG(a.seg_offsets[s] < a.seg_offsets[s + 1], "seg_offsets",
                      "not strictly increasing at " << s << " (" << a.seg_offsets[s] << ", " << a.seg_offsets[s + 1]
                                                    << ")");
    ZERO8_CHECK_ARG(a.seg_offsets[a.nseg] == a.n, "seg_offsets",
                    "length mismatch: segments end at " << a.seg_offsets[a.nseg] << " but n = " << a.n);
  }
  if (phase2 && algo_has_trust_ratio(a.algo)) {
    ZERO8_CHECK_ARG(a.seg_trust != nullptr, "seg_trust",
                    algo_name(a.algo) << " needs the trust ratios of phase 1 (optim_trust_ratio of the reduced norms)");
    const int64_t nt = a.nseg > 0 ? a.nseg : 1;
    for (int64_t s = 0; s < nt; ++s)
      ZERO8_CHECK_ARG(std::isfinite(a.seg_trust[s]) && a.seg_trust[s] >= 0.0f, "seg_trust",
                      "entry " << s << " = " << a.seg_trust[s] << " is not finite and >= 0");
  }
  if (a.n == 0) return;
  const int pb = dtype_size(a.param_dtype), gb = dtype_size(a.grad_dtype);
  ZERO8_CHECK_ARG(a.param != nullptr, "param", "null pointer");
  ZERO8_CHECK_ARG(aligned(a.param, pb), "param", "misaligned for " << dtype_name(a.param_dtype) << " (" << a.param << ")");
  ZERO8_CHECK_ARG(a.grad != nullptr, "grad", "null pointer");
  ZERO8_CHECK_ARG(aligned(a.grad, gb), "grad", "misaligned for " << dtype_name(a.grad_dtype) << " (" << a.grad << ")");
  if (a.master) ZERO8_CHECK_ARG(aligned(a.master, 4), "master", "misaligned for float32 (" << a.master << ")");
  for (int which = 1; which <= 2; ++which) {
    if (!optim_uses_state(a.algo, a.h, which)) continue;
    if (a.bits == 8) {
      const uint8_t* codes = which == 1 ? a.code1 : a.code2;
      const float* absmax = which == 1 ? a.absmax1 : a.absmax2;
      const quant::QuantTable* map = which == 1 ? a.map1 : a.map2;
      ZERO8_CHECK_ARG(codes != nullptr, state_name(which, "code"), "null pointer (8-bit state)");
      ZERO8_CHECK_ARG(absmax != nullptr, state_name(which, "absmax"), "null pointer (8-bit state)");
      ZERO8_CHECK_ARG(aligned(absmax, 4), state_name(which, "absmax"), "misaligned for float32 (" << absmax << ")");
      ZERO8_CHECK_ARG(map != nullptr, state_name(which, "map"), "null quantization map (8-bit state)");
    } else {
      const float* s = which == 1 ? a.state1 : a.state2;
      ZERO8_CHECK_ARG(s != nullptr, state_name(which, "state"), "null pointer (32-bit state)");
      ZERO8_CHECK_ARG(aligned(s, 4), state_name(which, "state"), "misaligned for float32 (" << s << ")");
    }
  }
}

void norms_range(const StepArgs& a, NormSums* out, int threads) {
  args_validate(a, false);
  ZERO8_CHECK_ARG(out != nullptr, "out", "null pointer");
  check_threads(threads);
  optim_norms(a, out, isa_active(), threads);
}

void step_range(const StepArgs& a, int threads) {
  args_validate(a, true);
  check_threads(threads);
  optim_step(a, isa_active(), threads);
}

void step_tensor(StepArgs a, int threads) {
  args_validate(a, false);
  check_threads(threads);
  const Isa isa = isa_active();
  std::vector<float> trust;
  if (algo_has_trust_ratio(a.algo)) {
    // Each segment is its own tensor: its norms give its trust ratio.
    std::vector<NormSums> s(size_t(std::max<int64_t>(a.nseg, 1)));
    optim_norms(a, s.data(), isa, threads);
    for (const NormSums& x : s) trust.push_back(optim_trust_ratio(a.algo, a.h, x));
    a.seg_trust = trust.data();
  }
  optim_step(a, isa, threads);
}

void step_tensor_cuda(StepArgs a, void* stream) {
#if ZERO8_WITH_CUDA
  // The segment offsets would be device memory, which the validation cannot read.
  ZERO8_CHECK_ARG(a.nseg == 0, "nseg",
                  "step_tensor_cuda steps one whole tensor (nseg = 0), got " << a.nseg << " segments");
  args_validate(a, false);
  optim_step_tensor_cuda(a, stream);
#else
  (void)a, (void)stream;
  ZERO8_THROW(unsupported, "zero8 was not built with CUDA");
#endif
}

void step(State& state, const Hyper& h, void* param, DType param_dtype, int64_t param_numel, float* master,
          const void* grad, DType grad_dtype, int64_t grad_numel, int threads) {
  const int64_t n = state.layout().n;
  ZERO8_CHECK_ARG(param_numel == n, "param", "length mismatch: " << param_numel << " elements, the state has " << n);
  ZERO8_CHECK_ARG(grad_numel == n, "grad", "length mismatch: " << grad_numel << " elements, the state has " << n);
  check_threads(threads);
  StepArgs a;
  state.bind(a);
  a.h = h;
  a.param = param;
  a.param_dtype = param_dtype;
  a.master = master;
  a.grad = grad;
  a.grad_dtype = grad_dtype;
  step_tensor(a, threads);
}

void step(State& state, const Hyper& h, void* param, DType param_dtype, float* master, const void* grad,
          DType grad_dtype, int threads) {
  const int64_t n = state.layout().n;
  step(state, h, param, param_dtype, n, master, grad, grad_dtype, n, threads);
}

}  // namespace zero8::optim
