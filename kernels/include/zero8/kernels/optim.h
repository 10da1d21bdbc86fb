// Fused optimizer kernels: one pass per element dequantizes the states, updates in fp32, finds each
// block's new scale, requantizes, and writes the parameter (and its fp32 master). The same kernel
// runs 32-bit states. Raw kernels: arguments are validated by zero8/optim.h, not here.
#pragma once

#include <cstdint>

#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim_table.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::optim {

// Hyperparameters of one step (Algo, its names and each algorithm's entries: optim_table.h). Names follow
// torch.optim; unused ones are ignored by an algorithm.
struct Hyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;         // adam/adamw/lamb/lion beta1; sgd/lars momentum
  float beta2 = 0.999f;       // adam/adamw/lamb/lion beta2; rmsprop alpha
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled for adamw, lion, lamb; L2 (added to the gradient) otherwise
  float dampening = 0.0f;     // sgd/lars
  bool nesterov = false;      // sgd/lars
  bool bias_correction = true;// adam/adamw/lamb
  float lr_decay = 0.0f;      // adagrad: lr / (1 + (step - 1) * lr_decay)
  float initial_accumulator = 0.0f;  // adagrad (applied by state init, recorded for completeness)
  float trust_coefficient = 0.001f;  // lars eta
  float max_trust_ratio = 10.0f;     // lamb/lars: clip of the trust ratio (0: no clip)
  float min_trust_ratio = 0.0f;      // lamb/lars: lower clip of the trust ratio (DeepSpeed Lamb's min_coeff)
  int64_t step = 1;           // the 1-based number of this step (after increment), for bias correction
  float grad_scale = 1.0f;    // the gradient is multiplied by this first (1/loss_scale * clip coef)
};

// The Hyper member a table entry names (HyperField::none: nothing; flags read and write 0 or 1).
inline double hyper_get(const Hyper& h, HyperField f) {
  switch (f) {
    case HyperField::none: return 0.0;
    case HyperField::lr: return h.lr;
    case HyperField::beta1: return h.beta1;
    case HyperField::beta2: return h.beta2;
    case HyperField::eps: return h.eps;
    case HyperField::weight_decay: return h.weight_decay;
    case HyperField::dampening: return h.dampening;
    case HyperField::nesterov: return h.nesterov ? 1.0 : 0.0;
    case HyperField::bias_correction: return h.bias_correction ? 1.0 : 0.0;
    case HyperField::lr_decay: return h.lr_decay;
    case HyperField::initial_accumulator: return h.initial_accumulator;
    case HyperField::trust_coefficient: return h.trust_coefficient;
    case HyperField::max_trust_ratio: return h.max_trust_ratio;
    case HyperField::min_trust_ratio: return h.min_trust_ratio;
  }
  return 0.0;
}

inline void hyper_set(Hyper& h, HyperField f, double v) {
  switch (f) {
    case HyperField::none: return;
    case HyperField::lr: h.lr = float(v); return;
    case HyperField::beta1: h.beta1 = float(v); return;
    case HyperField::beta2: h.beta2 = float(v); return;
    case HyperField::eps: h.eps = float(v); return;
    case HyperField::weight_decay: h.weight_decay = float(v); return;
    case HyperField::dampening: h.dampening = float(v); return;
    case HyperField::nesterov: h.nesterov = v != 0.0; return;
    case HyperField::bias_correction: h.bias_correction = v != 0.0; return;
    case HyperField::lr_decay: h.lr_decay = float(v); return;
    case HyperField::initial_accumulator: h.initial_accumulator = float(v); return;
    case HyperField::trust_coefficient: h.trust_coefficient = float(v); return;
    case HyperField::max_trust_ratio: h.max_trust_ratio = float(v); return;
    case HyperField::min_trust_ratio: h.min_trust_ratio = float(v); return;
  }
}

// Whether a step reads and writes state `which` (1 or 2): sgd and lars with momentum (beta1) 0 leave
// their state untouched, and its pointers may then be null.
bool optim_uses_state(Algo a, const Hyper& h, int which);

// One contiguous range of a flat parameter buffer. The range starts on a state-block boundary;
// the last block may be partial. Optional segments split the range into tensors (for LAMB/LARS
// per-tensor trust ratios): seg_offsets[0] = 0 < ... < seg_offsets[nseg] = n.
struct StepArgs {
  Algo algo = Algo::adamw;
  Hyper h;
  int64_t n = 0;
  void* param = nullptr;            // n elements of param_dtype: written (rounded from the master)
  DType param_dtype = DType::f32;
  float* master = nullptr;          // fp32 master (required when param is 16-bit, else null)
  const void* grad = nullptr;       // n elements of grad_dtype
  DType grad_dtype = DType::f32;
  int bits = 8;                     // 8: codes + scales; 32: fp32 states
  int32_t block = 256;              // state block (8-bit)
  uint8_t* code1 = nullptr;  float* absmax1 = nullptr;  const quant::QuantTable* map1 = nullptr;
  uint8_t* code2 = nullptr;  float* absmax2 = nullptr;  const quant::QuantTable* map2 = nullptr;
  float* state1 = nullptr;   float* state2 = nullptr;   // 32-bit states
  int64_t nseg = 0;                 // 0: the whole range is one tensor
  const int64_t* seg_offsets = nullptr;
  const float* seg_trust = nullptr; // lamb/lars phase 2: trust ratio per segment (nseg or 1 values);
                                    // null: 1 (the kernels; the validated API requires it)
  bool update_params = true;        // false: update states only (never used by the public API)
};

// Per-segment partial sums of the LAMB/LARS first phase: ||w||^2 and ||update||^2 (double, so that
// sums reduced across ranks in any order stay well within fp32 tolerance).
struct NormSums {
  double w_sq = 0.0;
  double u_sq = 0.0;
};

// Phase 1 of lamb/lars (reads only): out[s] for each segment (nseg or 1 entries).
void optim_norms_ref(const StepArgs& a, NormSums* out);
void optim_norms_avx2(const StepArgs& a, NormSums* out);
void optim_norms_avx512(const StepArgs& a, NormSums* out);
void optim_norms_avx512vbmi(const StepArgs& a, NormSums* out);
// The step (phase 2 for lamb/lars, using seg_trust).
void optim_step_ref(const StepArgs& a);
void optim_step_avx2(const StepArgs& a);
void optim_step_avx512(const StepArgs& a);
void optim_step_avx512vbmi(const StepArgs& a);

// Dispatch + OpenMP across blocks (threads = 0: OpenMP default, at most one thread per 32768
// elements; an explicit count is used as given). Results are bit-identical for every thread count
// and ISA: the step is element-wise, and the norms follow the fixed order of optim_math.h.
void optim_norms(const StepArgs& a, NormSums* out, Isa isa, int threads = 0);
void optim_step(const StepArgs& a, Isa isa, int threads = 0);

// Trust ratio from the reduced norms: as in the LAMB paper (You et al. 2020) and LARS (You et al.
// 2017): ||w|| / ||u|| (times eta for lars), 1 when either norm is 0, clipped at max_trust_ratio, then
// raised to min_trust_ratio (the order and the exemption of zero norms are DeepSpeed FusedLamb's).
// Defined by optim_trust_ratio_of (optim_math.h), which the CUDA step also runs on the device.
float optim_trust_ratio(Algo a, const Hyper& h, const NormSums& s);

#if ZERO8_WITH_CUDA
// CUDA kernels: every pointer in StepArgs is a device pointer (maps, seg_offsets and seg_trust
// included), and so is out_dev (nseg or 1 entries). Both are asynchronous on `stream`: a caller with
// several ranges queues their norms into one array and reads it once.
void optim_norms_cuda(const StepArgs& a, NormSums* out_dev, void* stream);
void optim_step_cuda(const StepArgs& a, void* stream);
// One tensor, or each segment as its own tensor, as step_tensor: LAMB/LARS run norms -> trust ratio
// (optim_trust_ratio_of, on the device) -> step, all queued on `stream` with no host sync (a.seg_trust
// is ignored; temporaries are stream-ordered allocations); the others the step.
void optim_step_tensor_cuda(const StepArgs& a, void* stream);
// 8-bit states take the form of cuda_quant_kernels() (dispatch.h; its warp form for blocks of 64..256).
#endif

}  // namespace zero8::optim
