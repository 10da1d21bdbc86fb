// The fused 8-bit (and 32-bit) optimizers, validated: a state layout that reports its bytes, an
// owning state, and a step over one tensor or over a raw range (the sharded optimizer's building block).
// Every entry validates its arguments once and throws zero8::Error naming the bad one.
#pragma once

#include <cstdint>
#include <vector>

#include "zero8/kernels/device.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::optim {

// Shape of one optimizer state for n parameters. 8-bit: per state n codes + one float32 scale per
// block; 32-bit: n floats per state. num_states is algo_num_states(algo).
struct StateLayout {
  Algo algo = Algo::adamw;
  int64_t n = 0;
  int bits = 8;
  int32_t block = 256;
  int num_states = 2;

  StateLayout() = default;
  StateLayout(Algo algo, int64_t n, int bits = 8, int32_t block = 256);  // validates
  int64_t num_blocks() const { return (n + block - 1) / block; }
  int64_t bytes() const;            // all states, codes and scales included
  double bytes_per_param() const;   // 8-bit AdamW at block 256: 2 + 8/256
};

// Owning optimizer state, initialised as torch does: zeros, or initial_accumulator for Adagrad.
// State 1 uses map1 (default dynamic signed), state 2 map2 (default dynamic unsigned, Adam's second
// moment); the maps matter only at 8 bits. `memory`: host, or the current CUDA device (cudaMalloc; the
// initial values are built on the host and copied over, then the host copy is dropped), which needs
// CUDA (Error(unsupported) naming the State otherwise).
class State {
 public:
  explicit State(const StateLayout& layout, float initial_accumulator = 0.0f,
                 quant::MapKind map1 = quant::MapKind::dynamic_signed,
                 quant::MapKind map2 = quant::MapKind::dynamic_unsigned, MemSpace memory = MemSpace::host);

  // Copies are deep (a device state's copy is new device memory, copied on the legacy default stream
  // and waited for).
  State(const State& o);
  State& operator=(const State& o);
  State(State&&) noexcept = default;
  State& operator=(State&&) noexcept = default;

  const StateLayout& layout() const { return layout_; }
  MemSpace memory() const { return memory_; }
  int64_t bytes() const { return layout_.bytes(); }
  // State which = 1 or 2. 8-bit: codes/absmax/map; 32-bit: fp32. Null when not held. Pointers into the
  // state's memory (device pointers for a device state); map() is the host table either way.
  uint8_t* codes(int which);
  float* absmax(int which);
  float* fp32(int which);
  const quant::QuantTable* map(int which) const;
  // The state's values as float32 on the host (dequantized at 8 bits; a device state is copied first).
  std::vector<float> values(int which) const;
  // Point the state fields of a StepArgs (bits, block, codes, scales, maps, fp32 states) at this state:
  // for a device state, device pointers and the maps' device copies (table_get_device).
  void bind(StepArgs& a);

 private:
  int index(int which) const;
  void to_device(const quant::MapKind* kinds);
  StateLayout layout_;
  MemSpace memory_ = MemSpace::host;
  std::vector<uint8_t> codes_[2];
  std::vector<float> absmax_[2];
  std::vector<float> fp32_[2];
  device::Buffer device_[2][3];  // device state: codes, absmax, fp32 of each state
  const quant::QuantTable* maps_[2] = {nullptr, nullptr};
  const quant::QuantTable* device_maps_[2] = {nullptr, nullptr};
};

// Check a set of hyperparameters for an algorithm (lr finite and >= 0, betas in [0, 1), eps >= 0,
// ...). Throws zero8::Error naming the field.
void hyper_validate(Algo algo, const Hyper& h);

// One step of one tensor of n = state.layout().n elements: param (param_dtype; a 16-bit parameter
// needs its fp32 master, a float32 one must pass master = null), grad (grad_dtype). LAMB and LARS
// run both phases (norms, trust ratio, step). threads = 0: OpenMP default. The numel overload also
// checks the lengths of param and grad against the state.
void step(State& state, const Hyper& h, void* param, DType param_dtype, float* master, const void* grad,
          DType grad_dtype, int threads = 0);
void step(State& state, const Hyper& h, void* param, DType param_dtype, int64_t param_numel, float* master,
          const void* grad, DType grad_dtype, int64_t grad_numel, int threads = 0);

// Raw ranges (the sharded optimizer): validated, then the dispatched kernel on the active ISA.
// norms_range is phase 1 of LAMB/LARS (out: nseg or 1 entries, to be reduced across ranks before
// optim_trust_ratio); step_range is the step (phase 2 for LAMB/LARS, which then need seg_trust).
void norms_range(const StepArgs& a, NormSums* out, int threads = 0);
void step_range(const StepArgs& a, int threads = 0);
// The same on a CUDA device (optim_step_cuda / optim_norms_cuda on `stream`): every pointer of `a` is a
// device pointer (State::bind of a device state gives them), including the segment arrays the kernels
// read; these are validated from their host copies seg_offsets_host / seg_trust_host (the same values;
// null where `a` has none). Both are asynchronous on the stream: the norms land in `out_dev`, device
// memory, for the caller to read when all its ranges' norms are queued. Error(unsupported) without CUDA
// or a usable device.
void norms_range_cuda(const StepArgs& a, const int64_t* seg_offsets_host, NormSums* out_dev, void* stream);
void step_range_cuda(const StepArgs& a, const int64_t* seg_offsets_host, const float* seg_trust_host, void* stream);

// One tensor, or each segment of the range as its own tensor: LAMB/LARS run norms -> trust ratio ->
// step (any seg_trust given is ignored), the others the step. Validated.
void step_tensor(StepArgs a, int threads = 0);

// step_tensor on CUDA: one tensor (nseg must be 0) whose pointers are all device memory on the current
// device, the maps included (quant::table_get_device). Validated as step_tensor; then queued on
// `stream` (a cudaStream_t, null for the default stream) without any host sync: LAMB/LARS compute
// their norms and trust ratio on the device. Throws ErrorCode::unsupported when zero8 was built
// without CUDA.
void step_tensor_cuda(StepArgs a, void* stream = nullptr);

// Validation used by the entries above (phase2: the step, which needs seg_trust for LAMB/LARS).
void args_validate(const StepArgs& a, bool phase2);

}  // namespace zero8::optim
