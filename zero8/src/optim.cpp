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

void layout_check(Algo algo, int64_t n, int bits, int32_t block) {
  ZERO8_CHECK_ARG(algo_valid(algo), "algo", "unknown algorithm " << int(algo));
  ZERO8_CHECK_ARG(n >= 0, "n", "negative length " << n);
  ZERO8_CHECK_ARG(bits == 8 || bits == 32, "bits", "must be 8 or 32, got " << bits);
  ZERO8_CHECK_ARG(block >= 64 && block <= 4096 && (block & (block - 1)) == 0, "block",
                  "must be a power of two in 64..4096, got " << block);
}

// Whether the algorithm's states start at a value of its own (a table entry with the init role).
bool algo_has_initial_value(Algo a) {
  const AlgoSpec& row = algo_spec(a);
  for (int i = 0; i < row.num_hyper; ++i)
    if (row.hyper[i].role == HyperRole::init) return true;
  return false;
}

// Whether the algorithm reads Hyper field f (its table row names it).
bool algo_has_field(Algo a, HyperField f) {
  const AlgoSpec& row = algo_spec(a);
  for (int i = 0; i < row.num_hyper; ++i)
    if (row.hyper[i].field == f) return true;
  return false;
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

State::State(const StateLayout& layout, float initial_accumulator, quant::MapKind map1, quant::MapKind map2,
             MemSpace memory)
    : layout_(layout), memory_(memory) {
  layout_check(layout.algo, layout.n, layout.bits, layout.block);
  ZERO8_CHECK_ARG(layout.num_states == algo_num_states(layout.algo), "layout",
                  "num_states " << layout.num_states << " but " << algo_name(layout.algo) << " has "
                                << algo_num_states(layout.algo));
  ZERO8_CHECK_ARG(std::isfinite(initial_accumulator) && initial_accumulator >= 0.0f, "initial_accumulator",
                  "must be finite and >= 0, got " << initial_accumulator);
  const bool has_init = algo_has_initial_value(layout.algo);
  ZERO8_CHECK_ARG(initial_accumulator == 0.0f || has_init, "initial_accumulator",
                  algo_name(layout.algo) << " states start at 0 (only an algorithm whose table row has an init "
                                            "entry, Adagrad's initial_accumulator_value, starts elsewhere)");
  const quant::MapKind kinds[2] = {map1, map2};
  for (int k = 0; k < layout_.num_states; ++k) {
    const float init = has_init ? initial_accumulator : 0.0f;
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
  if (memory_ == MemSpace::device) to_device(kinds);
}

// Moves the initial values to the current device. The copies run on the legacy default stream and are
// waited for: a one-time cost at construction, before any of the caller's streams uses the state.
void State::to_device(const quant::MapKind* kinds) {
  const std::string what = std::string("optim::State (") + algo_name(layout_.algo) + ", " +
                           std::to_string(layout_.bits) + "-bit, " + std::to_string(layout_.n) + " elements) on the device";
  device::require_cuda(what);
  for (int k = 0; k < layout_.num_states; ++k) {
    const void* src[3] = {codes_[k].data(), absmax_[k].data(), fp32_[k].data()};
    const int64_t bytes[3] = {int64_t(codes_[k].size()), int64_t(absmax_[k].size() * 4), int64_t(fp32_[k].size() * 4)};
    for (int part = 0; part < 3; ++part) {
      if (bytes[part] == 0) continue;
      device_[k][part] = device::Buffer(bytes[part], what);
      device::copy(device_[k][part].data(), src[part], bytes[part], nullptr, what);
    }
    if (layout_.bits == 8) device_maps_[k] = quant::table_get_device(kinds[k]);
  }
  device::synchronize(nullptr, what);
  for (int k = 0; k < 2; ++k) {
    std::vector<uint8_t>().swap(codes_[k]);
    std::vector<float>().swap(absmax_[k]);
    std::vector<float>().swap(fp32_[k]);
  }
}

State::State(const State& o)
    : layout_(o.layout_), memory_(o.memory_), maps_{o.maps_[0], o.maps_[1]}, device_maps_{o.device_maps_[0], o.device_maps_[1]} {
  for (int k = 0; k < 2; ++k) {
    codes_[k] = o.codes_[k];
    absmax_[k] = o.absmax_[k];
    fp32_[k] = o.fp32_[k];
  }
  if (memory_ != MemSpace::device) return;
  const std::string what = "copying a device optim::State";
  for (int k = 0; k < 2; ++k)
    for (int part = 0; part < 3; ++part) {
      const device::Buffer& b = o.device_[k][part];
      if (b.empty()) continue;
      device_[k][part] = device::Buffer(b.bytes(), what);
      device::copy(device_[k][part].data(), b.data(), b.bytes(), nullptr, what);
    }
  device::synchronize(nullptr, what);
}

State& State::operator=(const State& o) {
  if (this != &o) *this = State(o);
  return *this;
}

int State::index(int which) const {
  ZERO8_CHECK_ARG(which >= 1 && which <= layout_.num_states, "which",
                  "state " << which << " of " << algo_name(layout_.algo) << " (" << layout_.num_states << " states)");
  return which - 1;
}

uint8_t* State::codes(int which) {
  const int k = index(which);
  if (layout_.bits != 8) return nullptr;
  return memory_ == MemSpace::device ? device_[k][0].as<uint8_t>() : codes_[k].data();
}
float* State::absmax(int which) {
  const int k = index(which);
  if (layout_.bits != 8) return nullptr;
  return memory_ == MemSpace::device ? device_[k][1].as<float>() : absmax_[k].data();
}
float* State::fp32(int which) {
  const int k = index(which);
  if (layout_.bits != 32) return nullptr;
  return memory_ == MemSpace::device ? device_[k][2].as<float>() : fp32_[k].data();
}
const quant::QuantTable* State::map(int which) const { return maps_[index(which)]; }

std::vector<float> State::values(int which) const {
  const int k = index(which);
  std::vector<uint8_t> codes_host;
  std::vector<float> absmax_host, fp32_host;
  const uint8_t* codes = codes_[k].data();
  const float* absmax = absmax_[k].data();
  if (memory_ == MemSpace::device) {
    const std::string what = "optim::State::values";
    if (layout_.bits == 32) {
      fp32_host.resize(size_t(layout_.n));
      device::copy(fp32_host.data(), device_[k][2].data(), layout_.n * 4, nullptr, what);
    } else {
      codes_host.resize(size_t(layout_.n));
      absmax_host.resize(size_t(layout_.num_blocks()));
      device::copy(codes_host.data(), device_[k][0].data(), layout_.n, nullptr, what);
      device::copy(absmax_host.data(), device_[k][1].data(), layout_.num_blocks() * 4, nullptr, what);
      codes = codes_host.data();
      absmax = absmax_host.data();
    }
    device::synchronize(nullptr, what);
    if (layout_.bits == 32) return fp32_host;
  }
  if (layout_.bits == 32) return fp32_[k];
  std::vector<float> out(size_t(layout_.n));
  quant::DecodeArgs d;
  d.codes = codes;
  d.absmax = absmax;
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
  const bool dev = memory_ == MemSpace::device;
  if (layout_.bits == 8) {
    a.code1 = codes(1);
    a.absmax1 = absmax(1);
    a.map1 = dev ? device_maps_[0] : maps_[0];
    if (layout_.num_states == 2) {
      a.code2 = codes(2);
      a.absmax2 = absmax(2);
      a.map2 = dev ? device_maps_[1] : maps_[1];
    }
  } else {
    a.state1 = fp32(1);
    if (layout_.num_states == 2) a.state2 = fp32(2);
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
  if (h.nesterov && algo_has_field(algo, HyperField::nesterov))
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

namespace {
// The host view of device step arguments, for args_validate: the segment arrays from their host copies.
StepArgs host_checked(const StepArgs& a, const int64_t* seg_offsets_host, const float* seg_trust_host) {
  StepArgs h = a;
  h.seg_offsets = a.seg_offsets ? seg_offsets_host : nullptr;
  h.seg_trust = a.seg_trust ? seg_trust_host : nullptr;
  ZERO8_CHECK_ARG(a.seg_offsets == nullptr || seg_offsets_host != nullptr, "seg_offsets_host",
                  "null, but the device arguments have segment offsets");
  ZERO8_CHECK_ARG(a.seg_trust == nullptr || seg_trust_host != nullptr, "seg_trust_host",
                  "null, but the device arguments have trust ratios");
  return h;
}
}  // namespace

void norms_range_cuda(const StepArgs& a, const int64_t* seg_offsets_host, NormSums* out_dev, void* stream) {
  args_validate(host_checked(a, seg_offsets_host, nullptr), false);
  ZERO8_CHECK_ARG(out_dev != nullptr, "out_dev", "null pointer");
#if ZERO8_WITH_CUDA
  optim_norms_cuda(a, out_dev, stream);
#else
  (void)stream;
  device::require_cuda("optim::norms_range_cuda");
#endif
}

void step_range_cuda(const StepArgs& a, const int64_t* seg_offsets_host, const float* seg_trust_host, void* stream) {
  args_validate(host_checked(a, seg_offsets_host, seg_trust_host), true);
#if ZERO8_WITH_CUDA
  optim_step_cuda(a, stream);
#else
  (void)stream;
  device::require_cuda("optim::step_range_cuda");
#endif
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
