// The ZeRO stage 1/2 sharded optimizer: every rank of a data-parallel group keeps the full working
// copy of the parameters, the fp32 master and the (8-bit) optimizer state of its own partition only.
// Gradients are reduce-scattered (as int8 blocks by default), the owner steps its partition, and the
// updated partitions are all-gathered (in the working dtype, or as int8 blocks of the update delta).
// The buffers live in host memory or on a CUDA device; one code path serves both (see "Devices" below).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/grad_buffer.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/vec.h"
#include "zero8/layout.h"
#include "zero8/loss_scaler.h"
#include "zero8/optim.h"

namespace zero8::shard {

struct ShardConfig {
  LayoutConfig layout;                 // layout.world is ignored: the communicator's size is used
  optim::Algo algo = optim::Algo::adamw;
  optim::Hyper hyper;                  // hyper.step is managed by the optimizer (steps taken so far + 1)
  // Per hyper group (ParamSpec::hyper_group: the engine's param groups), at least one entry per group
  // the parameters use; empty: every hyper group starts from `hyper`. algo and bits are shared.
  std::vector<optim::Hyper> group_hypers;
  int bits = 8;                        // optimizer state bits of the 8-bit group (8 or 32)
  float initial_accumulator = 0.0f;    // adagrad
  int stage = 2;                       // 1: reduce at the accumulation boundary; 2: per bucket in backward
  DType working_dtype = DType::f32;    // dtype of the model's parameters (the working copy)
  bool int8_grads = true;              // gradient reduce-scatter as int8 blocks (else bf16_grads picks)
  bool bf16_grads = false;             // unquantized gradient reduce-scatter in bf16 (else fp32)
  bool int8_params = false;            // parameter all-gather as int8 blocks of the update delta
  bool error_feedback = false;         // keep the int8 gradient quantization residual (per rank)
  bool stochastic_wire = false;        // int8 blocks on the wire round stochastically (unbiased), else nearest
  uint64_t wire_seed = 0;              // their stream: (wire_seed, step, collective of the step, rank, element)
  bool release_grads = false;          // stage 2, several buckets: reduced buckets' memory goes back to the OS
  int64_t reduce_bucket_size = 500000000;  // elements per gradient bucket (DeepSpeed's default 5e8)
  double gradient_clipping = 0.0;      // global gradient-norm clip (0: off)
  bool fp16 = false;                   // dynamic loss scaling (loss_scaler) applies
  LossScalerConfig loss_scaler;
  int threads = 0;                     // OpenMP threads of the kernels (0: default)
  // Where the buffers live: host memory, or the CUDA device current at construction (see "Devices").
  MemSpace memory = MemSpace::host;
  // Device memory: the caller's CUDA stream (a cudaStream_t; Python passes
  // torch.cuda.current_stream().cuda_stream), on which it reads and writes the working copy and the
  // gradient input. nullptr: the legacy default stream (torch's default stream). Must be null for host.
  void* stream = nullptr;
};

// Devices (ShardConfig::memory = device). The working copy, the gradient input, the fp32 masters, the
// optimizer states (codes and scales, or fp32), the reduction buckets, the error-feedback residuals and
// every scratch buffer are device memory (cudaMalloc, never managed) of the device current at
// construction, which each call makes current while it runs. The same steps as on the host run as CUDA
// kernels (the codec, optim_step_cuda, the vec.h operations), so a device optimizer and a host one fed
// the same gradients hold the same bits (codes, scales, masters, working copy) after every step; LAMB and
// LARS excepted, whose per-tensor norms the device sums in another order (optim_norms_cuda).
// Streams: the step, init(), the parameter all-gather and the checkpoint copies run on cfg.stream. The
// gradient reductions (stage 2: per bucket during backward; stage 1: at the boundary) run on a side
// stream of the optimizer, which first waits for cfg.stream (backward wrote the gradient there); the
// reduced buckets are cleared there too, and cfg.stream waits for the side stream at backward_end, so
// the next micro-batch's backward and the step see them done. The communicator's stream is set to the
// stream of each call for its duration and restored after it.
// Host syncs: one per step, reading the global gradient norm (whose finiteness is the overflow test:
// one all_reduce of two doubles, one 16-byte read); LAMB and LARS add some per hyper-group run (their
// per-tensor norms, and their segment tables going to the device). The collectives themselves wait
// for their work (communicator.h). The communicator may be NCCL (device
// memory) or a host backend (single, MPI: device buffers staged through page-locked memory, so two
// processes can share one GPU); each needs CUDA. release_grads is host only (it hands pages back to the
// operating system). Accessors return device pointers (working, grad_input, master, state's codes...);
// residual() is host only; copy_to_host / copy_from_host serve either memory.

// What one step did.
struct StepInfo {
  bool skipped = false;     // a gradient held NaN/Inf on some rank: nothing was updated
  double grad_norm = 0.0;   // global norm of the averaged, unscaled gradient (before clipping)
  double clip_coef = 1.0;   // factor applied to the gradient by clipping (1: not clipped)
  double loss_scale = 1.0;  // the scale the gradients of this step were computed with
  int64_t step = 0;         // optimizer steps taken so far (skipped steps not counted)
};

// Memory held by one rank, in bytes.
struct MemoryStats {
  int64_t working = 0;  // the full working copy (all parameters, working dtype, padded)
  int64_t grads = 0;    // the gradient input buffers (fp32, padded): the bytes resident now
  int64_t master = 0;   // fp32 master of this rank's partitions
  int64_t state = 0;    // optimizer state of this rank's partitions (codes + scales, or fp32)
  int64_t buffers = 0;  // reduction/sync scratch and the error-feedback residual
};

class ShardedOptimizer {
 public:
  // Collective over `dp` (every rank passes the same params and config). `dp` must outlive this.
  // Ranks whose parameter specs (names, shapes, order, fp32_state, hyper_group) or config fields that
  // shape the collectives differ all throw zero8::Error naming the first difference and the ranks.
  ShardedOptimizer(const std::vector<ParamSpec>& params, const ShardConfig& cfg, comm::Communicator& dp);
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  const Layout& layout() const { return layout_; }
  // The config, with the hyperparameters of now (schedulers change them through hyper(i)): hyper is
  // hyper group 0's, group_hypers every group's (left empty with one group when none was given).
  ShardConfig config() const;
  comm::Communicator& comm() { return dp_; }
  int rank() const { return dp_.rank(); }
  int world() const { return dp_.size(); }

  // ---- the buffers the model works on ----
  // Working copy of a group: layout().group(g).padded() elements of working_dtype, identical on
  // every rank after init() and after each step. param_working(i) points at parameter i in it.
  void* working(Group g) { return working_[int(g)].data(); }
  void* param_working(int param);
  // Gradient input of a group (fp32, padded): the caller writes (and accumulates over micro-batches)
  // this rank's local gradient here. param_grad(i) points at parameter i in it. It reads as zeros
  // after each reduction; in stage 2 with several buckets the memory of each reduced bucket goes back
  // to the operating system at once (GradBuffer), so a rank holds only the gradients not yet reduced.
  float* grad_input(Group g) { return grad_data(int(g)); }
  float* param_grad(int param);

  // Collective: make rank `root`'s working copy everyone's, and set the masters from it. Call once
  // after the model's parameters were written into the working buffers. Starts a step: the gradients
  // accumulated so far are dropped (discard_gradients). Until init(), refresh_masters(),
  // sync_working_from_master() or a checkpoint load (mark_initialized) set the masters, step() throws.
  void init(int root = 0);
  // Not collective (every rank calls it at the same point). Drops every gradient not yet applied: the
  // micro-batches accumulated since the last step (grad_input, the reduced partitions) and the
  // error-feedback residuals, so that the next micro-batch starts a step. init() and a checkpoint load
  // call it: those gradients belong to weights they replace.
  void discard_gradients();
  // This rank's masters from its own working copy (not collective), after the caller changed the weights
  // in place, e.g. loaded a state dict into the model: otherwise the next step would start from the old
  // masters. Every rank should hold the same weights; after the next step each partition's owner wins.
  void refresh_masters();

  // ---- the training loop ----
  // Stage 2: parameter `param`'s gradient of this micro-batch is complete in grad_input; the buckets
  // it completes are reduced now (overlapping the rest of backward), in one fixed order of all buckets
  // (by their first parameter, last first: the order backward usually completes them), so a bucket waits
  // for those before it in that order. Ranks may report different parameters or orders (a branch or an
  // expert unused on one rank): each rank reduces a prefix of the same order during backward and the
  // rest at backward_end, so their collectives match. Stage 1: records nothing. Report each parameter
  // at most once per micro-batch, once its gradient is whole: a later addition to it is lost if its
  // bucket was reduced (param_reduced says whether it was).
  void grad_ready(int param);
  // Whether a bucket holding `param` was reduced this micro-batch.
  bool param_reduced(int param) const;
  // End of a micro-batch's backward (collective). Stage 2 reduces the buckets not yet reduced and
  // clears grad_input; stage 1 reduces everything when `boundary` (the last micro-batch of the
  // accumulation) and otherwise keeps accumulating in grad_input.
  void backward_end(bool boundary);
  // The optimizer step (collective), after backward_end(true). Gradients are averaged over the ranks
  // (the caller scales the loss by 1/gradient_accumulation_steps, as DeepSpeed's engine does). Throws
  // (before any collective) in the middle of an accumulation: after backward_end(false), or after
  // grad_ready without backward_end (that micro-batch's gradient is not reduced yet).
  StepInfo step();

  // The step's agreement over the data-parallel group, the squared gradient norm (whose finiteness is
  // the overflow flag), is also reduced over `outer` when one is set: the pipeline engine passes its
  // pipeline group, so that an overflow in any stage skips the step in every stage and clipping uses the
  // norm of the whole model. Then step() is collective over `outer` too (one all_reduce of two doubles in
  // host memory, after the one over the data-parallel group). nullptr (the default) turns it off.
  // `outer` must outlive this optimizer.
  void set_step_group(comm::Communicator* outer) { outer_ = outer; }

  // Learning rate and other hyperparameters of the next steps of one hyper group (schedulers change lr
  // between steps). Each is validated at every step.
  optim::Hyper& hyper(int hyper_group = 0);
  int num_hyper_groups() const { return int(hypers_.size()); }
  double loss_scale() const { return scaler_.scale(); }
  int64_t steps() const { return steps_; }
  MemoryStats memory() const;

  // ---- state access (checkpoints) ----
  // Partition of group g on this rank: [part_begin, part_begin + part_valid) in flat coordinates.
  float* master(Group g) { return master_[int(g)].as<float>(); }
  optim::State* state(Group g) { return states_[int(g)].get(); }
  LossScaler& scaler() { return scaler_; }
  // Error-feedback residual of group g (full padded length; empty when error feedback is off). Host
  // memory only: Error(invalid_argument) for a device optimizer (copy_to_host(g, Part::residual, ...)).
  std::vector<float>& residual(Group g);
  void set_steps(int64_t s) { steps_ = s; }
  // Recompute the working copy from the masters (all-gather in the working dtype): after loading a
  // checkpoint, so every replica holds the rounded masters.
  void sync_working_from_master();
  // A checkpoint load wrote the masters and the state directly: the optimizer may step.
  void mark_initialized() { initialized_ = true; }
  bool initialized() const { return initialized_; }

  // ---- host copies of this rank's buffers (checkpoints; either memory) ----
  // The parts a checkpoint holds, named as its shard sections (part_name): the working copy (whole
  // group, padded, working dtype), the fp32 master of this rank's partition (part_valid elements), the
  // states (8-bit: codes, part_valid bytes, and absmax, one float per state block; 32-bit: part_valid
  // floats), and the error-feedback residual (whole group, padded floats).
  enum class Part : uint8_t { working, master, codes1, absmax1, codes2, absmax2, state1, state2, residual };
  static const char* part_name(Part p);  // "working", "master", "codes1", "absmax1", ..., "residual"
  // Bytes of part p of group g on this rank; 0 when not held (codes of 32-bit states, state 2 of a
  // one-state algorithm, the residual without error feedback, an empty partition).
  int64_t part_bytes(Group g, Part p) const;
  // Copies part p of group g (part_bytes bytes) to host memory, or from it into the optimizer; both
  // return when the copy is complete (device: ordered on cfg.stream after the optimizer's work there).
  // Master padding beyond part_valid and everything else keeps its value.
  void copy_to_host(Group g, Part p, void* dst);
  void copy_from_host(Group g, Part p, const void* src);
  // Bytes [offset, offset + bytes) of part p only, so that a caller can stage a large part through a
  // small host buffer (checkpoints of device optimizers); the range must lie within part_bytes.
  void copy_to_host(Group g, Part p, int64_t offset, int64_t bytes, void* dst);
  // Where part p of group g lives: the optimizer's own memory (a device pointer when memory = device),
  // null when it is not held. A host optimizer's parts can be read in place (its checkpoints do).
  void* part_data(Group g, Part p);

 private:
  struct Bucket;
  void reset_progress(int g);
  void reduce_bucket(int g, const Bucket& b);
  void reduce_in_order(bool only_ready);
  void release_reduced(int g, int bi);
  void clear_grad_inputs();
  void validate_hypers() const;
  void step_group(int g, float grad_scale, const std::vector<float>& trust_by_param);
  double grad_sq_sum_global(bool* overflow);
  template <class F>
  void for_each_run(int g, F&& f) const;
  std::vector<float> trust_ratios(float grad_scale);
  void param_sync(int g);
  void fill_step_args(int g, optim::StepArgs& a, float grad_scale);

  // Zeroed bytes in the optimizer's memory: a host vector, or device memory. grow() keeps nothing.
  class Store {
   public:
    Store() = default;
    Store(MemSpace mem, int64_t bytes, void* stream);
    void* data() { return mem_ == MemSpace::device ? dev_.data() : static_cast<void*>(host_.data()); }
    template <class T> T* as() { return static_cast<T*>(data()); }
    int64_t bytes() const { return mem_ == MemSpace::device ? dev_.bytes() : int64_t(host_.size()); }
    void grow(int64_t bytes);

   private:
    MemSpace mem_ = MemSpace::host;
    std::vector<uint8_t> host_;
    device::Buffer dev_;
  };
  class StreamScope;  // the communicator's stream for one call

  bool on_device() const { return cfg_.memory == MemSpace::device; }
  vec::Where where_step() const;    // the caller's stream (cfg.stream)
  vec::Where where_reduce() const;  // the reduction side stream
  float* grad_data(int g);
  float* residual_data(int g);      // null without error feedback
  void side_after_caller();         // the side stream waits for the caller's work so far
  void caller_after_side();         // and the other way round
  void sync_caller(const char* what);
  void step_args_upload(int g, optim::StepArgs& a, const std::vector<int64_t>& offs, const std::vector<float>& trust);

  std::vector<ParamSpec> params_;
  ShardConfig cfg_;
  comm::Communicator& dp_;
  comm::Communicator* outer_ = nullptr;            // set_step_group
  Layout layout_;
  LossScaler scaler_;
  std::vector<optim::Hyper> hypers_;               // per hyper group
  int64_t steps_ = 0;
  bool initialized_ = false;                       // the masters were set (init, a load): step() may run
  int device_ = -1;                                // the CUDA device of a device optimizer
  Store working_[kNumGroups];                      // bytes
  GradBuffer grads_[kNumGroups];                   // host: full, padded; pages handed back once reduced
  Store grads_device_[kNumGroups];                 // device: the same, cleared after each reduction
  Store part_grad_[kNumGroups];                    // this rank's reduced gradient (chunk floats)
  Store master_[kNumGroups];                       // chunk floats
  std::unique_ptr<optim::State> states_[kNumGroups];
  std::vector<float> residual_[kNumGroups];        // host: error feedback (full, padded) when enabled
  Store residual_device_[kNumGroups];              // device: the same
  Store scratch_;                                  // reduction output
  Store delta_;                                    // int8 parameter sync: this rank's delta (chunk floats)
  Store full_delta_;                               // int8 parameter sync: the gathered deltas
  Store norm_sums_;                                // per group: the squared-gradient sums (2 doubles)
  Store norm_work_;                                // vec::sum_squares' work
  Store seg_offsets_, seg_trust_;                  // device LAMB/LARS: a run's segments and trust ratios
  comm::WireWorkspace wire_ws_;
  std::unique_ptr<device::Stream> side_;           // device: the reduction stream
  std::unique_ptr<device::Event> caller_mark_, side_mark_;
  std::vector<std::vector<int>> pending_;          // per group, per bucket: parameters not yet ready
  std::vector<bool> done_[kNumGroups];             // per group, per bucket: reduced this micro-batch
  std::vector<Bucket> buckets_[kNumGroups];
  std::vector<std::vector<int>> param_buckets_[kNumGroups];  // per param index: buckets it overlaps
  std::vector<std::pair<int, int>> order_;         // every (group, bucket), in the order all ranks reduce them
  size_t next_ = 0;                                // order_[next_] is the next bucket to reduce
  int micro_ = 0;                                  // micro-batches since the last boundary
  bool reported_ = false;                          // grad_ready since the last backward_end
  uint64_t wire_calls_ = 0;                        // wire collectives since the last step (stochastic seeds)
  comm::WireOptions wire_options(comm::WireFormat format);
};

}  // namespace zero8::shard
