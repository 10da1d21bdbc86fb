// The ZeRO stage 1/2 sharded optimizer: every rank of a data-parallel group keeps the full working
// copy of the parameters, the fp32 master and the (8-bit) optimizer state of its own partition only.
// Gradients are reduce-scattered (as int8 blocks by default), the owner steps its partition, and the
// updated partitions are all-gathered (in the working dtype, or as int8 blocks of the update delta);
// one rank sends nothing and so quantizes nothing (WirePlan).
// The buffers live in host memory or on a CUDA device; one code path serves both (see "Devices" below).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/config.h"
#include "zero8/grad_buffer.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/vec.h"
#include "zero8/layout.h"
#include "zero8/loss_scaler.h"
#include "zero8/optim.h"

namespace zero8::shard {

// The most elements (over all ranks) of one piece of the int8 parameter all-gather, whatever
// allgather_bucket_size says: each rank expands every rank's piece to fp32 (4 bytes per element) before
// adding it to its working copy, so this bounds that scratch at 16 MiB; the int8 blocks are the same
// however the partition is cut (whole alignment units).
constexpr int64_t kInt8GatherPiece = int64_t(1) << 22;

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
  // The wire options apply over more than one rank (WirePlan: one rank sends nothing, exactly).
  bool int8_grads = true;              // gradient reduce-scatter as int8 blocks (else bf16_grads picks)
  bool bf16_grads = false;             // unquantized gradient reduce-scatter in bf16 (else fp32)
  bool int8_params = true;             // parameter all-gather as int8 blocks of the update delta
  bool error_feedback = false;         // keep the int8 gradient quantization residual (per rank)
  bool stochastic_wire = false;        // int8 blocks on the wire round stochastically (unbiased), else nearest
  uint64_t wire_seed = 0;              // their stream: (wire_seed, step, collective of the step, rank, element)
  bool release_grads = false;          // reduced gradient buckets' memory goes back to the OS ("Gradient memory")
  int64_t reduce_bucket_size = config::kDefaultReduceBucket;  // elements per gradient bucket
  // Elements of the parameter all-gather per piece, over all ranks (DeepSpeed's allgather_bucket_size): with
  // overlap, the step hands each piece of its partition to the all-gather as soon as it is stepped.
  int64_t allgather_bucket_size = 500000000;
  // Overlap ("Overlap" below): stage 2 reduces each bucket on a thread of the optimizer while the caller's
  // backward goes on, and the step's all-gather runs there while the step goes on. false: both in the
  // caller's thread. Either way the same collectives in the same order: the results are the same bits.
  bool overlap = false;
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

// What a step's collectives carry over `world` data-parallel ranks: the config's wire options, except
// that one rank sends nothing (its reduce-scatter and all-gather are local copies), so it quantizes
// nothing. Its gradients and parameters stay exact, the bits of fp32 communication, and it holds no
// int8 sync scratch and no error-feedback residual (a checkpoint it saves has none, as with error
// feedback off); the masters and the optimizer states are the same either way. The optimizer decides
// this once (wire_plan at construction, on host and device alike) and every step reads the plan, never
// the config's int8 options.
struct WirePlan {
  comm::WireFormat grads = comm::WireFormat::f32;  // the gradient reduce-scatter
  bool int8_params = false;     // the all-gather sends int8 blocks of the update; else the working dtype, exact
  bool error_feedback = false;  // each rank keeps the residual of its int8 gradient blocks
};
WirePlan wire_plan(const ShardConfig& cfg, int world);

// Devices (ShardConfig::memory = device). The working copy, the gradient input, the fp32 masters, the
// optimizer states (codes and scales, or fp32), the reduction buckets, the error-feedback residuals and
// every scratch buffer are device memory (cudaMalloc, never managed) of the device current at
// construction, which each call makes current while it runs. The same steps as on the host run as CUDA
// kernels (the codec, optim_step_cuda, the vec.h operations), so a device optimizer and a host one fed
// the same gradients hold the same bits (codes, scales, masters, working copy) after every step; LAMB and
// LARS excepted, whose per-tensor norms the device sums in another order (optim_norms_cuda).
// Streams: the step, init(), the parameter all-gather and the checkpoint copies run on cfg.stream, except
// that with the overlap thread each piece of the step's all-gather runs on the side stream, after an event
// its piece's step recorded on cfg.stream (see "Deferred all-gather"). The gradient reductions (stage 2:
// per bucket during backward; stage 1: at the boundary) run on a side stream of the optimizer, which first
// waits for an event recorded on cfg.stream when the bucket was posted (backward wrote its gradients there
// before grad_ready; with overlap the reduction runs later); the reduced buckets are cleared there too, and
// cfg.stream waits for the side stream at backward_end, so the next micro-batch's backward and the step see
// them done; a bucket buffer of grad_add cleared there is waited for on cfg.stream (an event per buffer)
// before grad_add writes it again. The communicator's stream is set to the stream of each call for its
// duration and restored after it.
// Host syncs: one per step, reading the global gradient norm (whose finiteness is the overflow test:
// one all_reduce of two doubles, one 16-byte read); LAMB and LARS add some per hyper-group run (their
// per-tensor norms, and their segment tables going to the device). The collectives themselves wait
// for their work (communicator.h). The communicator may be NCCL (device
// memory) or a host backend (single, MPI: device buffers staged through page-locked memory, so two
// processes can share one GPU); each needs CUDA. release_grads is host only (it hands pages back to the
// operating system). Accessors return device pointers (working, grad_input, master, state's codes...);
// residual() is host only; copy_to_host / copy_from_host serve either memory.

// Gradient memory. The gradients come in one of two ways:
//  * grad_add(param, grad, dtype): the caller hands each parameter's gradient over (autograd's, in a hook),
//    and it is added to the bucket that carries it. Stage 2 keeps no full-size gradient buffer then: a
//    bucket's fp32 buffer comes from a pool when its first gradient arrives, and goes back to the pool once
//    the bucket is reduced, so a rank holds its partition of the reduced gradient (chunk floats per group)
//    plus the buckets in flight: those backward is filling (a parameter's whole span at least) and, with
//    overlap, at most 4 more waiting for their reduction (a gradient that needs a new buffer beyond that
//    waits for one, as DeepSpeed's stage 2 holds two buffers with overlap_comm). Stage 1 reduces at the
//    accumulation boundary, so it keeps a full buffer until then (as DeepSpeed's stage 1 keeps its
//    gradients).
//  * grad_input(g) / param_grad(i): a full-size fp32 buffer that the caller writes in place (autograd or
//    libtorch accumulating into views of it). Stage 1 has it from the start; in stage 2 the first call
//    makes it (4 bytes per parameter for the optimizer's lifetime) and grad_add adds into it from then on.
// release_grads: stage 2's reduced buckets are freed instead of kept for the next ones (the pool holds
// nothing between backwards, at the cost of allocating again); the full buffer (stage 2 only) hands the
// pages of each reduced bucket back to the operating system (GradBuffer).
//
// Overlap (ShardConfig::overlap; stage 2, more than one rank, and a communicator whose calls
// may come from another thread: communicator.h, "Threads"). The optimizer runs a thread that takes jobs in
// the order the caller posts them: grad_ready posts each bucket it completes, in the fixed reduction order,
// and the caller goes on with its backward; backward_end posts the rest and waits for all. The step posts
// the all-gather of each piece of the updated partition (allgather_bucket_size elements over the ranks)
// while it steps the next piece, and waits for all before it returns. So the thread and the caller never
// use the communicator at the same time as long as the caller makes no call on dp's world from
// grad_ready until backward_end returns (a pipeline's send/recv in backward needs overlap off). A failed
// collective on the thread (a dead or stuck peer: communicator.h, "Failure") is thrown in the caller by
// the next grad_ready, backward_end or any other call, with the communicator's message, which names the
// rank. overlap_stats() says how much of the collectives' time the caller did not wait for. A device
// optimizer's jobs enqueue their work on its side stream (below) and wait for it there, off the caller's
// thread, so the GPU runs a bucket's reduction beside backward and a piece's gather beside the next
// pieces' steps; step() makes cfg.stream wait for the side stream before it returns.

// Deferred all-gather (step(true), with the overlap thread: defers_gather()). The step updates every piece
// of this rank's partition and posts each piece's all-gather to the thread, then returns: the gather of
// step t runs while the caller starts step t+1's forward. The caller must not read a parameter's working
// copy before wait_param(param) returned (the engine calls it in a forward pre-hook of each module, for
// the module's own parameters), nor write the working copy before wait_gather(). The pieces are gathered
// in a fixed order, by the first parameter each holds (so about the forward's order, both groups
// interleaved), and a parameter waits only until the pieces that hold it are done. Until the gather is
// done, a call of any communicator from another thread than the optimizer's (the training loop's own
// all-reduce of its loss) first waits for it (communicator.h, add_background_work). The results are
// the same bits as step(false), which waits for the whole gather before it returns. The int8 sync with
// stochastic rounding (one piece) is not deferred. On a device, wait_param returns once the pieces
// holding the parameter are queued (their collectives done, their last kernels on the side stream) and
// cfg.stream waits for them (an event per piece), so work queued on cfg.stream after it reads the update;
// wait_gather makes cfg.stream wait for the whole side stream. The GPU runs the pieces' gathers beside
// the forward's kernels.

// Time the collectives took and the time the caller waited for them, since construction.
struct OverlapStats {
  bool threaded = false;           // the collectives run on the optimizer's thread (see "Overlap")
  int64_t reductions = 0;          // gradient buckets reduced
  double reduce_seconds = 0.0;     // wall time of those reductions
  double reduce_wait_seconds = 0.0;  // time the caller spent in them or waiting for them
  int64_t gathers = 0;             // pieces of the parameter all-gather
  double gather_seconds = 0.0;
  double gather_wait_seconds = 0.0;
};

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
  int64_t grads = 0;    // gradient input: the full buffer's resident bytes, and the bucket buffers held now
  int64_t grads_peak = 0;  // the most `grads` has been since construction
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
  // What the collectives carry (WirePlan): the config's wire options over world() ranks.
  const WirePlan& wire() const { return wire_; }
  comm::Communicator& comm() { return dp_; }
  int rank() const { return dp_.rank(); }
  int world() const { return dp_.size(); }
  // The CUDA device of a device optimizer's buffers; -1 for host memory.
  int device() const { return device_; }

  // ---- the buffers the model works on ----
  // Working copy of a group: layout().group(g).padded() elements of working_dtype, identical on
  // every rank after init() and after each step. param_working(i) points at parameter i in it.
  void* working(Group g) { return working_[int(g)].data(); }
  void* param_working(int param);
  // Adds `grad` (the parameter's numel values of dtype f32, bf16 or f16, contiguous, in this optimizer's
  // memory; on a device, written on cfg.stream) to parameter `param`'s gradient of this micro-batch, in
  // fp32 (y = y + x, as autograd accumulates). See "Gradient memory". Throws Error(invalid_argument) naming
  // the parameter if its bucket was already handed to the reduction this micro-batch (param_reduced).
  void grad_add(int param, const void* grad, DType dtype);
  // The full gradient input of a group (fp32, padded; see "Gradient memory": in stage 2 the first call
  // makes it): the caller writes (and accumulates over micro-batches) this rank's local gradient here.
  // param_grad(i) points at parameter i in it. It reads as zeros after each reduction. Error in stage 2
  // between a grad_add and the end of its micro-batch.
  float* grad_input(Group g);
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
  // Whether a bucket holding `param` was handed to the reduction this micro-batch.
  bool param_reduced(int param) const;
  // End of a micro-batch's backward (collective). Stage 2 reduces the buckets not yet reduced and
  // clears grad_input; stage 1 reduces everything when `boundary` (the last micro-batch of the
  // accumulation) and otherwise keeps accumulating in grad_input.
  void backward_end(bool boundary);
  // Ends an accumulation whose last micro-batch ended with backward_end(false) (collective), for a caller
  // that learns of the boundary only after it (DeepSpeed's managed_gradient_accumulation false, where
  // step() is the boundary): stage 1 reduces the accumulated gradients as backward_end(true) would have;
  // stage 2 reduced each micro-batch already, so nothing crosses the wire. Nothing to do when no
  // micro-batch is pending; throws, as step() does, after grad_ready without backward_end.
  void end_accumulation();
  // The optimizer step (collective), after backward_end(true). Gradients are averaged over the ranks
  // (the caller scales the loss by 1/gradient_accumulation_steps, as DeepSpeed's engine does). Throws
  // (before any collective) in the middle of an accumulation: after backward_end(false), or after
  // grad_ready without backward_end (that micro-batch's gradient is not reduced yet).
  // defer_gather: see "Deferred all-gather"; ignored unless defers_gather().
  StepInfo step(bool defer_gather = false);
  // step(true) returns before the all-gather is done: with the overlap thread (either memory), and not
  // the int8 sync with stochastic rounding.
  bool defers_gather() const;
  // Deferred all-gather: blocks until parameter `param`'s working copy holds the last step's update (every
  // piece of the gather that writes it is done; on a device, for the work queued on cfg.stream from now
  // on); returns at once when no gather is pending. Rethrows a failed collective as the other calls do.
  void wait_param(int param);
  // Blocks until the whole deferred all-gather is done (at once when none is pending). Every collective
  // call, and every call that reads or writes the working copy or the masters (init, discard_gradients,
  // refresh_masters, backward_end, step, sync_working_from_master, copy_to_host, copy_from_host), makes it
  // first.
  void wait_gather();
  bool gather_pending() const { return deferred_; }

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
  OverlapStats overlap_stats() const;

  // ---- state access (checkpoints) ----
  // Partition of group g on this rank: [part_begin, part_begin + part_valid) in flat coordinates.
  float* master(Group g) { return master_[int(g)].as<float>(); }
  optim::State* state(Group g) { return states_[int(g)].get(); }
  LossScaler& scaler() { return scaler_; }
  // Error-feedback residual of group g (full padded length; empty when the plan keeps none: WirePlan). Host
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
  struct Slot;
  enum class Phase : uint8_t { reduce, gather };
  void reset_progress(int g);
  void reduce_bucket(int g, int bi);
  void reduce_in_order(bool only_ready);
  void release_reduced(int g, int bi);
  void clear_grad_inputs();
  void validate_hypers() const;
  void step_group(int g, float grad_scale, int64_t lo, int64_t hi, size_t* next_run);
  double grad_sq_sum_global(bool* overflow);
  template <class F>
  void for_each_run(int g, F&& f) const;
  std::vector<float> trust_ratios(float grad_scale);
  int64_t gather_piece(int g) const;
  // int8: the wire options of the int8 sync of this piece (taken in the caller's thread: they count the
  // step's collectives); null: an exact all-gather in the working dtype. w: where it runs (a device's
  // stream: the caller's, or the side stream on the optimizer's thread).
  void param_sync(int g, int64_t lo, int64_t hi, const comm::WireOptions* int8, const vec::Where& w);
  int64_t gather_index(int param) const;  // deferred gather: the piece (in the step's order) param needs last
  void fill_step_args(int g, optim::StepArgs& a, float grad_scale);
  // The gradient input (see "Gradient memory").
  void make_full_input(const char* what);
  float* slot_data(int g, int bi, bool for_caller);
  void slot_clear(int g, int bi);
  void note_grads_held();
  // The thread of "Overlap": post() queues a job (or runs it now without the thread), drain() waits until
  // every job posted so far has run and rethrows the thread's failure.
  void post(Phase phase, std::function<void()> job);
  void drain(Phase phase);
  void worker_loop();
  void count_job(Phase phase, int jobs, double ran, double waited);

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
  float* grad_data(int g);           // the full gradient input
  float* residual_data(int g);      // null without error feedback
  void mark_posted(size_t pos);     // device: bucket order_[pos]'s gradients are written (posted_)
  void caller_after_side();         // the caller's stream waits for the side stream's work so far
  void sync_caller(const char* what);
  // LAMB/LARS: the runs of one hyper group in a sequence of ranges of this rank's partitions, each with its
  // parameters' segments, for the norms and the step (plan_segments; seg_ holds the host arrays).
  struct SegmentRun {
    int group, hyper;
    int64_t lo, hi;     // offsets from the partition's start
    size_t offsets_at;  // where its nseg + 1 offsets (from lo, closed by hi - lo) start in seg_.offsets
    size_t first;       // its first segment's index in seg_.params and seg_.trust
    int64_t nseg;
  };
  struct SegmentPlan {
    std::vector<SegmentRun> runs;
    std::vector<int64_t> offsets;
    std::vector<int> params;   // per segment: its parameter
    std::vector<float> trust;  // per segment: its trust ratio (the step's plan)
  };

  std::vector<ParamSpec> params_;
  ShardConfig cfg_;
  comm::Communicator& dp_;
  WirePlan wire_;                                  // wire_plan(cfg_, dp_.size()): what the collectives carry
  comm::Communicator* outer_ = nullptr;            // set_step_group
  Layout layout_;
  LossScaler scaler_;
  std::vector<optim::Hyper> hypers_;               // per hyper group
  int64_t steps_ = 0;
  bool initialized_ = false;                       // the masters were set (init, a load): step() may run
  int device_ = -1;                                // the CUDA device of a device optimizer
  Store working_[kNumGroups];                      // bytes
  bool full_input_ = false;                        // the full gradient input exists (see "Gradient memory")
  GradBuffer grads_[kNumGroups];                   // host: full, padded; pages handed back once reduced
  Store grads_device_[kNumGroups];                 // device: the same, cleared after each reduction
  std::vector<std::unique_ptr<Slot>> slots_;       // stage 2 bucket buffers, in use or free
  std::vector<int> free_slots_;                    // slots_ not in use (zeros, or no memory with release_grads)
  std::vector<int> slot_of_[kNumGroups];           // per bucket: its slot this micro-batch, -1: none
  int64_t grads_peak_ = 0;                         // MemoryStats::grads_peak
  Store part_grad_[kNumGroups];                    // this rank's reduced gradient (chunk floats)
  Store master_[kNumGroups];                       // chunk floats
  std::unique_ptr<optim::State> states_[kNumGroups];
  std::vector<float> residual_[kNumGroups];        // host: error feedback (full, padded) when enabled
  Store residual_device_[kNumGroups];              // device: the same
  Store scratch_;                                  // reduction output
  Store delta_;                                    // int8 parameter sync: this rank's delta (one piece)
  Store full_delta_;                               // int8 parameter sync: the gathered deltas
  Store norm_sums_;                                // per group: the squared-gradient sums (2 doubles)
  Store norm_work_;                                // vec::sum_squares' work
  SegmentPlan seg_;                                // LAMB/LARS: the runs of the norms', then the step's ranges
  Store seg_offsets_, seg_trust_, seg_norms_;      // device LAMB/LARS: seg_'s arrays there, the segments' norms
  comm::WireWorkspace wire_ws_;
  std::unique_ptr<device::Stream> side_;           // device: the reduction stream
  std::unique_ptr<device::Event> side_mark_;      // device: the reductions so far, for the caller's stream
  std::vector<std::unique_ptr<device::Event>> posted_;  // device, per place in order_: recorded when posted
  // Device with the thread, per place in gather_order_: the piece's masters stepped (on cfg.stream), and
  // its all-gather done (on the side stream).
  std::vector<std::unique_ptr<device::Event>> stepped_, gathered_;
  std::vector<std::vector<int>> pending_;          // per group, per bucket: parameters not yet ready
  std::vector<bool> done_[kNumGroups];             // per group, per bucket: reduced this micro-batch
  std::vector<Bucket> buckets_[kNumGroups];
  std::vector<std::vector<int>> param_buckets_[kNumGroups];  // per param index: buckets it overlaps
  std::vector<std::pair<int, int>> order_;         // every (group, bucket), in the order all ranks reduce them
  std::vector<size_t> order_pos_[kNumGroups];      // per bucket: its index in order_
  struct GatherPiece {
    int group;
    int64_t lo, hi;  // offsets from each partition's start
  };
  std::vector<GatherPiece> gather_order_;          // the step's all-gather pieces, in the order every rank posts them
  void plan_segments(const std::vector<GatherPiece>& ranges, const std::vector<float>* trust_by_param);
  void segment_args(optim::StepArgs& a, const SegmentRun& r);
  std::vector<int64_t> gather_pos_[kNumGroups];    // per group, per piece index: its place in gather_order_
  size_t next_ = 0;                                // order_[next_] is the next bucket to reduce (or post)
  int micro_ = 0;                                  // micro-batches since the last boundary
  bool reported_ = false;                          // grad_ready since the last backward_end
  uint64_t wire_calls_ = 0;                        // wire collectives since the last step (stochastic seeds)
  comm::WireOptions wire_options(comm::WireFormat format);
  // The thread of "Overlap". mu_ guards the jobs, busy_, stop_, failure_, overlap_, the slot pool
  // (slots_, free_slots_, slot_of_) and grads_peak_; a job's buffers are the thread's from post() until
  // the job has run, and the caller's otherwise.
  bool threaded_ = false;
  std::thread worker_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::pair<Phase, std::function<void()>>> jobs_;
  bool busy_ = false;                              // the thread is running a job
  int64_t gathers_done_ = 0;                       // gather jobs the thread finished since construction
  // Deferred all-gather: a gather is pending (set by the caller's step; cleared by wait_gather, which a
  // communicator call from any thread runs first: communicator.h, add_background_work); gathers_done_
  // when the step posted it.
  std::atomic<bool> deferred_{false};
  int64_t gather_base_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;                     // the first job that threw; every later post/drain rethrows it
  OverlapStats overlap_;
};

}  // namespace zero8::shard
