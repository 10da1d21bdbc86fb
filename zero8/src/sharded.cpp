// ZeRO stage 1/2 sharded optimizer (see sharded.h): bucketed gradient reduce-scatter, overflow and
// norm agreement across ranks, the fused step on this rank's partitions, and the parameter all-gather,
// on host or device buffers: each step below is a vec.h operation, a codec or optimizer kernel, or a
// collective, which runs on whichever side the buffers live.
#include "zero8/sharded.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/vec.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zero8::shard {

// A contiguous flat range [begin, end) of a group whose gradients are reduced together. Bounds are
// multiples of the group's alignment, so every rank's owned piece is whole wire and state blocks.
struct ShardedOptimizer::Bucket {
  int64_t begin = 0, end = 0;
  int nparams = 0;  // parameters overlapping the bucket
};

// The fp32 buffer of one stage 2 bucket for one micro-batch (see "Gradient memory" in sharded.h): zeros
// while free (or no memory at all with release_grads). On a device it is cleared on the reduction stream,
// and `cleared` marks that, for the caller's stream to wait on before it writes the slot again.
struct ShardedOptimizer::Slot {
  Store buf;
  int64_t used = 0;  // floats the last bucket used (all zeros again once it is cleared)
  std::unique_ptr<device::Event> cleared;
  bool pending_clear = false;  // `cleared` was recorded and the caller's stream has not waited for it yet
};

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// ---- agreement across ranks ----

namespace {

// A parameter's spec as text ('name' shape [a, b] ...): every field that must be equal on every rank
// (hashed for the comparison, shown in the error).
std::string spec_text(const ParamSpec& p) {
  std::string t = "'" + p.name + "' shape [";
  for (size_t d = 0; d < p.shape.size(); ++d) t += (d ? ", " : "") + std::to_string(p.shape[d]);
  t += "]";
  if (p.fp32_state) t += " fp32_state";
  if (p.hyper_group != 0) t += " hyper group " + std::to_string(p.hyper_group);
  return t;
}

uint64_t param_hash(const ParamSpec& p) {
  const std::string t = spec_text(p);
  return XXH3_64bits(t.data(), t.size());
}

std::string param_text(const std::vector<ParamSpec>& params, size_t i) {
  if (i >= params.size()) return "no such parameter (" + std::to_string(params.size()) + " parameters)";
  return spec_text(params[i]);
}

// The config fields that decide the collectives a step makes and the values it computes.
struct ConfigField {
  const char* name;
  int64_t value;
};
std::vector<ConfigField> config_fields(const ShardConfig& c) {
  int64_t clip = 0;
  std::memcpy(&clip, &c.gradient_clipping, sizeof(clip));
  return {{"stage", c.stage},
          {"algo", int64_t(c.algo)},
          {"bits", c.bits},
          {"working_dtype", int64_t(c.working_dtype)},
          {"int8_grads", c.int8_grads},
          {"bf16_grads", c.bf16_grads},
          {"int8_params", c.int8_params},
          {"stochastic_wire", c.stochastic_wire},
          {"reduce_bucket_size", c.reduce_bucket_size},
          {"allgather_bucket_size", c.allgather_bucket_size},
          {"gradient_clipping (bits)", clip},
          {"fp16", c.fp16},
          {"layout.state_block", c.layout.state_block},
          {"layout.wire_block", c.layout.wire_block},
          {"layout.min_8bit_size", c.layout.min_8bit_size}};
}

// "rank 1 (x), rank 3 (y)": the ranks whose value differs from rank 0's.
template <class T, class Text>
std::string ranks_differing(const std::vector<T>& per_rank, Text text) {
  std::string out;
  for (size_t r = 1; r < per_rank.size(); ++r)
    if (per_rank[r] != per_rank[0]) out += (out.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " " + text(r));
  return out;
}

}  // namespace

// Collective: every rank must pass the same parameters and config (sharded.h); otherwise the ranks'
// collectives differ in size or number, which ends in garbage, MPI errors or a timeout much later.
// One all-gather of the counts, a hash of the specs and the config fields; on a difference (every
// rank sees the same records, so all throw) more all-gathers find the first differing parameter.
static void check_same_on_every_rank(const std::vector<ParamSpec>& params, const ShardConfig& cfg,
                                     comm::Communicator& dp) {
  const int world = dp.size();
  if (world == 1) return;
  const std::vector<ConfigField> fields = config_fields(cfg);
  uint64_t ph = rng_mix(0x7368617264ull, params.size());
  for (const ParamSpec& p : params) ph = rng_mix(ph, param_hash(p));
  std::vector<int64_t> mine = {int64_t(params.size()), int64_t(ph)};
  for (const ConfigField& f : fields) mine.push_back(f.value);
  const size_t k = mine.size();
  std::vector<int64_t> all(k * size_t(world));
  comm::all_gather_host(dp, mine.data(), all.data(), int64_t(k * sizeof(int64_t)));
  auto column = [&](size_t j) {
    std::vector<int64_t> c(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) c[size_t(r)] = all[size_t(r) * k + j];
    return c;
  };
  const std::string who = "ShardedOptimizer (rank " + std::to_string(dp.rank()) + " of " + std::to_string(world) + "): ";
  if (column(1) != std::vector<int64_t>(size_t(world), all[1])) {
    // The first parameter that differs: compare the specs of the parameters every rank has.
    const std::vector<int64_t> counts = column(0);
    const int64_t common = *std::min_element(counts.begin(), counts.end());
    std::vector<uint64_t> h(static_cast<size_t>(common)), hs(static_cast<size_t>(common * world));
    for (int64_t i = 0; i < common; ++i) h[size_t(i)] = param_hash(params[size_t(i)]);
    if (common > 0) comm::all_gather_host(dp, h.data(), hs.data(), common * int64_t(sizeof(uint64_t)));
    int64_t first = common;  // none of the common ones: a rank has more parameters
    for (int64_t i = 0; i < common && first == common; ++i)
      for (int r = 1; r < world; ++r)
        if (hs[size_t(r * common + i)] != hs[size_t(i)]) first = i;
    // Every rank's description of that parameter, in fixed-size records.
    constexpr size_t kText = 240;
    std::string t = param_text(params, size_t(first)).substr(0, kText - 1);
    t.resize(kText, '\0');
    std::vector<char> texts(kText * size_t(world));
    comm::all_gather_host(dp, t.data(), texts.data(), int64_t(kText));
    std::vector<std::string> per_rank;
    for (int r = 0; r < world; ++r) per_rank.emplace_back(texts.data() + size_t(r) * kText);
    std::string msg = who + "the ranks passed different parameters (every rank must pass the same names, shapes " +
                      "and order): parameter " + std::to_string(first) + " is " + per_rank[0] + " on rank 0, ";
    msg += ranks_differing(per_rank, [&](size_t r) { return per_rank[r]; });
    if (counts != std::vector<int64_t>(size_t(world), counts[0]))
      msg += "; parameter counts: " + ranks_differing(counts, [&](size_t r) { return std::to_string(counts[r]); }) +
             " (rank 0: " + std::to_string(counts[0]) + ")";
    throw Error(ErrorCode::invalid_argument, msg);
  }
  for (size_t j = 0; j < fields.size(); ++j) {
    const std::vector<int64_t> c = column(2 + j);
    if (c != std::vector<int64_t>(size_t(world), c[0]))
      throw Error(ErrorCode::invalid_argument,
                  who + "the ranks passed different configs: '" + fields[j].name + "' is " + std::to_string(c[0]) +
                      " on rank 0, " + ranks_differing(c, [&](size_t r) { return std::to_string(c[r]); }));
  }
}

// Offsets of the ranks' ranges in bucket [begin, end) of a group (the bucket collectives' layout).
static std::vector<int64_t> owner_offsets(const GroupLayout& gl, int64_t begin, int64_t end) {
  std::vector<int64_t> off(size_t(gl.world) + 1);
  for (int p = 0; p <= gl.world; ++p) off[p] = std::clamp(gl.part_begin(p), begin, end) - begin;
  return off;
}

// ---- what the collectives carry ----

// The one place that turns the config's wire options into what the step does (sharded.h, WirePlan).
WirePlan wire_plan(const ShardConfig& cfg, int world) {
  WirePlan p;
  if (world <= 1) return p;  // nothing crosses a wire: exact, no int8 scratch, no residual
  p.grads = cfg.int8_grads ? comm::WireFormat::int8 : cfg.bf16_grads ? comm::WireFormat::bf16 : comm::WireFormat::f32;
  p.int8_params = cfg.int8_params;
  p.error_feedback = cfg.error_feedback && cfg.int8_grads;
  return p;
}

// ---- memory and streams ----

ShardedOptimizer::Store::Store(MemSpace mem, int64_t bytes, void* stream) : mem_(mem) {
  if (mem == MemSpace::host) {
    host_.assign(size_t(bytes), 0);
    return;
  }
  dev_ = device::Buffer(bytes, "ShardedOptimizer buffer of " + std::to_string(bytes) + " bytes");
  device::zero(dev_.data(), bytes, stream, "ShardedOptimizer");
}

void ShardedOptimizer::Store::grow(int64_t bytes) {
  if (mem_ == MemSpace::host) {
    if (int64_t(host_.size()) < bytes) host_.resize(size_t(bytes));
    return;
  }
  dev_.reserve(bytes, "ShardedOptimizer scratch of " + std::to_string(bytes) + " bytes");
}

// Sets the communicator's stream for one call of a device optimizer and restores it after (the
// communicator may be the engine's, used with other streams elsewhere). Host optimizers leave it alone.
class ShardedOptimizer::StreamScope {
 public:
  StreamScope(ShardedOptimizer& o, const vec::Where& w) : c_(o.dp_), prev_(o.dp_.stream()), set_(o.on_device()) {
    if (set_) c_.set_stream(w.stream);
  }
  ~StreamScope() {
    if (!set_) return;
    try {
      c_.set_stream(prev_);
    } catch (...) {
      // The stream was valid when it was set: nothing to restore it from.
    }
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  comm::Communicator& c_;
  void* prev_;
  bool set_;
};

vec::Where ShardedOptimizer::where_step() const { return vec::Where{cfg_.memory, cfg_.stream}; }

vec::Where ShardedOptimizer::where_reduce() const {
  return vec::Where{cfg_.memory, side_ ? side_->get() : nullptr};
}

float* ShardedOptimizer::grad_data(int g) { return on_device() ? grads_device_[g].as<float>() : grads_[g].data(); }

float* ShardedOptimizer::residual_data(int g) {
  if (on_device()) return residual_device_[g].bytes() > 0 ? residual_device_[g].as<float>() : nullptr;
  return residual_[g].empty() ? nullptr : residual_[g].data();
}

// Called where bucket order_[pos] is posted (the caller's thread, right after the gradients it carries were
// written on the caller's stream): the mark its reduction waits for on the side stream, wherever and
// whenever that runs. Recorded later (on the overlap thread), it would also wait for the backward work
// enqueued in between.
void ShardedOptimizer::mark_posted(size_t pos) {
  if (on_device()) posted_[pos]->record(cfg_.stream);
}

void ShardedOptimizer::caller_after_side() {
  if (!on_device()) return;
  side_mark_->record(side_->get());
  side_mark_->wait_on(cfg_.stream);
}

void ShardedOptimizer::sync_caller(const char* what) {
  if (on_device()) device::synchronize(cfg_.stream, std::string("ShardedOptimizer::") + what);
}

// A device optimizer's calls run with its device current (the caller's may differ), restored after.
#define ZERO8_SHARD_DEVICE_SCOPE(what) const device::DeviceGuard device_guard_(device_, "ShardedOptimizer::" what)

ShardedOptimizer::ShardedOptimizer(const std::vector<ParamSpec>& params, const ShardConfig& cfg,
                                   comm::Communicator& dp)
    : params_(params),
      cfg_(cfg),
      dp_(dp),
      wire_(wire_plan(cfg, dp.size())),
      scaler_(cfg.fp16 ? cfg.loss_scaler : LossScalerConfig{false, 1.0}) {
  ZERO8_CHECK_ARG(cfg.memory == MemSpace::host || cfg.memory == MemSpace::device, "memory",
                  "unknown MemSpace " << int(cfg.memory));
  const bool dev = cfg.memory == MemSpace::device;
  if (!dev) {
    // Host buffers (working copy, gradients, state, norms) go to the communicator as they are, and so do
    // the checkpoint code's.
    comm::check_host_memory(dp, "dp", "ShardedOptimizer");
    ZERO8_CHECK_ARG(cfg.stream == nullptr, "stream",
                    "a CUDA stream was given for host memory; set memory = device to keep the buffers on the GPU");
  }
  ZERO8_CHECK_ARG(cfg.stage == 1 || cfg.stage == 2, "stage", "zero8 implements ZeRO stage 1 and 2, got " << cfg.stage);
  ZERO8_CHECK_ARG(cfg.bits == 8 || cfg.bits == 32, "bits", "must be 8 or 32, got " << cfg.bits);
  ZERO8_CHECK_ARG(cfg.reduce_bucket_size > 0, "reduce_bucket_size", "must be > 0, got " << cfg.reduce_bucket_size);
  ZERO8_CHECK_ARG(cfg.threads >= 0, "threads", "must be >= 0 (0: OpenMP's default), got " << cfg.threads);
  ZERO8_CHECK_ARG(cfg.gradient_clipping >= 0 && std::isfinite(cfg.gradient_clipping), "gradient_clipping",
                  "must be a finite number >= 0, got " << cfg.gradient_clipping);
  ZERO8_CHECK_ARG(!cfg.fp16 || cfg.working_dtype == DType::f16, "fp16",
                  "loss scaling is for float16 parameters; the working dtype is " << dtype_name(cfg.working_dtype));
  ZERO8_CHECK_ARG(!dev || !cfg.release_grads, "release_grads",
                  "hands gradient pages back to the operating system, which only host memory has; turn it off "
                  "(zero8.release_gradients) for memory = device");
  if (dev) {
    device::require_cuda("ShardedOptimizer (ShardConfig::memory = device)");
    device::check_stream(cfg.stream, "stream", "ShardedOptimizer");
    device_ = device::current_device("ShardedOptimizer");
    side_ = std::make_unique<device::Stream>("ShardedOptimizer: the reduction stream");
    side_mark_ = std::make_unique<device::Event>("ShardedOptimizer: reduction stream event");
  }
  check_same_on_every_rank(params, cfg, dp);
  LayoutConfig lc = cfg.layout;
  lc.world = dp.size();
  layout_ = Layout::build(params, lc);
  if (cfg.group_hypers.empty()) {
    optim::hyper_validate(cfg.algo, cfg.hyper);
    hypers_.assign(size_t(layout_.num_hyper_groups), cfg.hyper);
  } else {
    ZERO8_CHECK_ARG(int64_t(cfg.group_hypers.size()) >= layout_.num_hyper_groups, "group_hypers",
                    cfg.group_hypers.size() << " entries, but a parameter is in hyper group "
                                            << layout_.num_hyper_groups - 1);
    hypers_ = cfg.group_hypers;
    validate_hypers();
  }
  const int r = dp.rank();
  const int esize = dtype_size(cfg.working_dtype);
  const MemSpace mem = cfg.memory;
  int64_t norm_work = 0;
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    working_[g] = Store(mem, gl.padded() * esize, cfg.stream);
    part_grad_[g] = Store(mem, gl.chunk * 4, cfg.stream);
    master_[g] = Store(mem, gl.chunk * 4, cfg.stream);
    // The 8-bit group holds cfg.bits states; the fp32 group (small or marked tensors) 32-bit ones.
    const int bits = g == int(Group::q8) ? cfg.bits : 32;
    const int64_t valid = gl.part_valid(r);
    states_[g] = std::make_unique<optim::State>(optim::StateLayout(cfg.algo, valid, bits, cfg.layout.state_block),
                                                cfg.initial_accumulator, quant::MapKind::dynamic_signed,
                                                quant::MapKind::dynamic_unsigned, mem);
    if (wire_.error_feedback) {
      if (dev)
        residual_device_[g] = Store(mem, gl.padded() * 4, cfg.stream);
      else
        residual_[g].assign(size_t(gl.padded()), 0.0f);
    }
    norm_work = std::max(norm_work, vec::sum_squares_work(valid));
    // Buckets: cut the padded range into aligned pieces of about reduce_bucket_size elements.
    const int64_t bs = std::max<int64_t>(gl.align, (cfg.reduce_bucket_size + gl.align - 1) / gl.align * gl.align);
    for (int64_t b = 0; b < gl.padded(); b += bs) buckets_[g].push_back(Bucket{b, std::min(gl.padded(), b + bs), 0});
    slot_of_[g].assign(buckets_[g].size(), -1);
    param_buckets_[g].assign(params.size(), {});
    for (int idx : gl.params) {
      const ParamSlot& s = layout_.slots[idx];
      if (s.numel == 0) continue;
      for (size_t bi = 0; bi < buckets_[g].size(); ++bi) {
        Bucket& b = buckets_[g][bi];
        if (s.offset < b.end && s.offset + s.numel > b.begin) {
          ++b.nparams;
          param_buckets_[g][idx].push_back(int(bi));
        }
      }
    }
  }
  // Scratch at its largest use from the start: a device buffer that grew later would wait for the device.
  int64_t owned = 1;
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    for (const Bucket& b : buckets_[g]) {
      const std::vector<int64_t> off = owner_offsets(gl, b.begin, b.end);
      owned = std::max(owned, off[size_t(r) + 1] - off[size_t(r)]);
    }
  }
  norm_sums_ = Store(mem, 2 * int64_t(sizeof(double)), cfg.stream);
  norm_work_ = Store(mem, norm_work * int64_t(sizeof(double)), cfg.stream);
  scratch_ = Store(mem, owned * 4, cfg.stream);
  int64_t piece = 0;  // the largest all-gather piece, over all ranks
  for (int g = 0; g < kNumGroups; ++g) piece = std::max(piece, gather_piece(g) * dp.size());
  // The order of the step's pieces, the same on every rank: by the first (lowest-index) parameter each
  // holds, so that a forward, which uses the parameters in about their order, finds its first layers
  // gathered first (with a deferred gather it waits only for the pieces before its layer); the groups
  // interleave (an embedding with 32-bit states comes before the 8-bit matrices after it).
  {
    std::vector<std::pair<int64_t, std::pair<int, int64_t>>> keyed;  // (first param, (group, piece index))
    for (int g = 0; g < kNumGroups; ++g) {
      const GroupLayout& gl = layout_.groups[g];
      const int64_t gp = gather_piece(g), pieces = gp > 0 ? (gl.chunk + gp - 1) / gp : 0;
      // One pass over the parameters: each lowers the key of the pieces its span touches in every
      // partition it reaches (a piece of padding only keeps a key after every parameter).
      std::vector<int64_t> first(size_t(pieces), int64_t(layout_.params.size()));
      for (int idx : gl.params) {
        const ParamSlot& sl = layout_.slots[size_t(idx)];
        if (sl.numel == 0) continue;
        const int64_t a = sl.offset, b = sl.offset + sl.numel;
        for (int p = gl.owner(a); p <= gl.owner(b - 1); ++p) {
          const int64_t lo = std::max(a, gl.part_begin(p)) - gl.part_begin(p);
          const int64_t hi = std::min(b, gl.part_end(p)) - gl.part_begin(p);
          for (int64_t k = lo / gp; k <= (hi - 1) / gp; ++k) first[size_t(k)] = std::min<int64_t>(first[size_t(k)], idx);
        }
      }
      for (int64_t k = 0; k < pieces; ++k) keyed.push_back({first[size_t(k)], {g, k}});
      gather_pos_[g].assign(size_t(pieces), 0);
    }
    std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& e : keyed) {
      const int g = e.second.first;
      const int64_t gp = gather_piece(g), lo = e.second.second * gp;
      gather_pos_[g][size_t(e.second.second)] = int64_t(gather_order_.size());
      gather_order_.push_back({g, lo, std::min(layout_.groups[g].chunk, lo + gp)});
    }
  }
  delta_ = Store(mem, wire_.int8_params ? piece / dp.size() * 4 : 0, cfg.stream);
  full_delta_ = Store(mem, wire_.int8_params ? piece * 4 : 0, cfg.stream);
  seg_offsets_ = Store(mem, 0, cfg.stream);
  seg_trust_ = Store(mem, 0, cfg.stream);
  seg_norms_ = Store(mem, 0, cfg.stream);
  // The reduction order, the same on every rank: buckets by their first (lowest-index) parameter, last
  // first, as backward completes them when the model's parameters are listed in forward order; buckets
  // of padding only at the end.
  std::vector<std::pair<int64_t, std::pair<int, int>>> keyed;
  for (int g = 0; g < kNumGroups; ++g) {
    std::vector<int64_t> first(buckets_[g].size(), -1);
    for (int idx : layout_.groups[g].params)
      for (int bi : param_buckets_[g][size_t(idx)])
        if (first[size_t(bi)] < 0 || idx < first[size_t(bi)]) first[size_t(bi)] = idx;
    for (size_t bi = 0; bi < buckets_[g].size(); ++bi) keyed.push_back({first[bi], {g, int(bi)}});
  }
  std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& k : keyed) order_.push_back(k.second);
  for (int g = 0; g < kNumGroups; ++g) order_pos_[g].assign(buckets_[g].size(), 0);
  for (size_t i = 0; i < order_.size(); ++i) order_pos_[order_[i].first][size_t(order_[i].second)] = i;
  if (dev)
    for (size_t i = 0; i < order_.size(); ++i)
      posted_.push_back(std::make_unique<device::Event>("ShardedOptimizer: a bucket's gradients written"));
  pending_.resize(kNumGroups);
  for (int g = 0; g < kNumGroups; ++g) reset_progress(g);
  // Stage 1 reduces at the boundary: it keeps every gradient until then, in the full buffer.
  if (cfg.stage == 1) make_full_input("ShardedOptimizer");
  // One rank has nothing to hide (its reductions are local copies). A device needs the thread as much as
  // the host: its collectives are on the side stream, but each call blocks until its work is done
  // (communicator.h), so in the caller's thread backward would enqueue nothing more while a bucket is on
  // the wire, and the GPU would have no backward work to run beside it.
  threaded_ = cfg.overlap && dp.size() > 1 && dp.calls_from_any_thread();
  overlap_.threaded = threaded_;
  if (dev && threaded_)
    for (size_t i = 0; i < gather_order_.size(); ++i) {
      stepped_.push_back(std::make_unique<device::Event>("ShardedOptimizer: a gather piece's masters stepped"));
      gathered_.push_back(std::make_unique<device::Event>("ShardedOptimizer: a gather piece's all-gather done"));
    }
  if (threaded_) worker_ = std::thread([this] { worker_loop(); });
}

ShardedOptimizer::~ShardedOptimizer() {
  if (!worker_.joinable()) return;
  comm::remove_background_work(this);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();  // a job that runs finishes (or fails: communicator.h, "Failure"); queued ones are dropped
}

ShardConfig ShardedOptimizer::config() const {
  ShardConfig c = cfg_;
  c.hyper = hypers_[0];
  if (hypers_.size() > 1 || !cfg_.group_hypers.empty()) c.group_hypers = hypers_;
  return c;
}

optim::Hyper& ShardedOptimizer::hyper(int hyper_group) {
  ZERO8_CHECK_ARG(hyper_group >= 0 && size_t(hyper_group) < hypers_.size(), "hyper_group",
                  hyper_group << " out of range (" << hypers_.size() << " hyper groups)");
  return hypers_[size_t(hyper_group)];
}

// Each hyper group's values, as the kernels would check them, with the group named when there are several.
void ShardedOptimizer::validate_hypers() const {
  for (size_t i = 0; i < hypers_.size(); ++i) {
    try {
      optim::hyper_validate(cfg_.algo, hypers_[i]);
    } catch (const Error& e) {
      if (hypers_.size() == 1) throw;
      throw Error(e.code(), "hyper group " + std::to_string(i) + ": " + e.what());
    }
  }
}

void ShardedOptimizer::reset_progress(int g) {
  pending_[g].clear();
  done_[g].assign(buckets_[g].size(), false);
  for (const Bucket& b : buckets_[g]) pending_[g].push_back(b.nparams);
}

void* ShardedOptimizer::param_working(int param) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  const ParamSlot& s = layout_.slots[param];
  return working_[int(s.group)].as<uint8_t>() + s.offset * dtype_size(cfg_.working_dtype);
}

float* ShardedOptimizer::grad_input(Group g) {
  ZERO8_CHECK_ARG(int(g) >= 0 && int(g) < kNumGroups, "group",
                  "must be 0 (8-bit states) or 1 (fp32 states), got " << int(g));
  make_full_input("ShardedOptimizer::grad_input");
  return grad_data(int(g));
}

float* ShardedOptimizer::param_grad(int param) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  make_full_input("ShardedOptimizer::param_grad");
  const ParamSlot& s = layout_.slots[param];
  return grad_data(int(s.group)) + s.offset;
}

// The full gradient input, once (see "Gradient memory"). Stage 2 may switch to it only between
// micro-batches: the buckets of the one under way hold gradients that the full buffer would not.
void ShardedOptimizer::make_full_input(const char* what) {
  if (full_input_) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    bool in_use = next_ != 0 || !jobs_.empty() || busy_;
    for (int g = 0; g < kNumGroups; ++g)
      for (int si : slot_of_[g]) in_use = in_use || si >= 0;
    if (in_use)
      throw Error(ErrorCode::invalid_argument,
                  std::string(what) + " (rank " + std::to_string(rank()) + "): the gradients of this micro-batch " +
                      "went to the reduction buckets (grad_add); the full gradient buffer can only be taken " +
                      "between micro-batches (before the first grad_add, or after backward_end)");
    slots_.clear();
    free_slots_.clear();
  }
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    // release_grads: stage 2 with several buckets hands the memory of each reduced bucket back at once,
    // so a rank holds only the gradients not yet reduced. Stage 1 keeps every gradient until the
    // boundary, and one bucket is reduced at the end of backward: there, refaulting the pages each step
    // would cost time and save nothing at the peak.
    // Cleared as each reduction clears it (written with zeros, or its pages handed back), so that the
    // memory it holds does not depend on when it was made.
    if (on_device()) {
      grads_device_[g] = Store(cfg_.memory, gl.padded() * 4, cfg_.stream);
    } else {
      grads_[g] = GradBuffer(gl.padded(), cfg_.release_grads && cfg_.stage == 2 && buckets_[g].size() > 1);
      grads_[g].zero();
    }
  }
  full_input_ = true;
  note_grads_held();
}

void ShardedOptimizer::grad_add(int param, const void* grad, DType dtype) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  ZERO8_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, "dtype",
                  "gradients are float32, bfloat16 or float16, got " << dtype_name(dtype));
  const ParamSlot& s = layout_.slots[param];
  if (s.numel == 0) return;
  ZERO8_CHECK_ARG(grad != nullptr, "grad", "null pointer for the " << s.numel << " gradient values of '"
                                                                    << params_[size_t(param)].name << "'");
  ZERO8_SHARD_DEVICE_SCOPE("grad_add");
  const int g = int(s.group);
  for (int bi : param_buckets_[g][size_t(param)])
    if (order_pos_[g][size_t(bi)] < next_)
      throw Error(ErrorCode::invalid_argument,
                  "ShardedOptimizer::grad_add (rank " + std::to_string(rank()) + "): parameter '" +
                      params_[size_t(param)].name + "' got a gradient after its bucket was handed to the " +
                      "reduction of this micro-batch (every parameter of the bucket had been reported by " +
                      "grad_ready): it would be lost; report a parameter once its gradient is whole");
  const int esize = dtype_size(dtype);
  if (full_input_) {
    vec::add(grad_data(g) + s.offset, DType::f32, grad, dtype, s.numel, where_step());
    return;
  }
  for (int bi : param_buckets_[g][size_t(param)]) {
    const Bucket& b = buckets_[g][size_t(bi)];
    const int64_t lo = std::max(s.offset, b.begin), hi = std::min(s.offset + s.numel, b.end);
    vec::add(slot_data(g, bi, true) + (lo - b.begin), DType::f32,
             static_cast<const uint8_t*>(grad) + (lo - s.offset) * esize, dtype, hi - lo, where_step());
  }
}

// How many buckets the reductions may lag behind backward (posted, not yet reduced, holding their
// buffers) before a gradient that needs a new bucket buffer waits for one: with overlap, a rank then
// holds at most this many buckets more than backward is filling, as DeepSpeed's stage 2 holds two
// buffers with overlap_comm. The waiting is what the reductions cost anyway when they are the slower.
constexpr size_t kBucketsAhead = 4;

// Bucket bi's buffer of this micro-batch, taken from the pool (a free slot large enough) or made the first
// time. for_caller: the caller's stream writes it next (a device slot cleared on the reduction stream is
// waited for there), and with overlap the caller may wait for the reductions (kBucketsAhead).
float* ShardedOptimizer::slot_data(int g, int bi, bool for_caller) {
  const Bucket& b = buckets_[g][size_t(bi)];
  const int64_t need = b.end - b.begin;
  Slot* slot = nullptr;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (slot_of_[g][size_t(bi)] < 0) {
      auto fitting = [&]() -> size_t {  // index in free_slots_ of the smallest free slot that holds the bucket
        size_t best = free_slots_.size();
        for (size_t k = 0; k < free_slots_.size(); ++k) {
          const int64_t cap = slots_[size_t(free_slots_[k])]->buf.bytes() / 4;
          if (cap >= need && (best == free_slots_.size() || cap < slots_[size_t(free_slots_[best])]->buf.bytes() / 4))
            best = k;
        }
        return best;
      };
      if (for_caller && threaded_) {
        const double t0 = now_s();
        done_cv_.wait(lk, [&] {
          return failure_ || fitting() < free_slots_.size() || jobs_.size() + size_t(busy_) < kBucketsAhead;
        });
        count_job(Phase::reduce, 0, 0.0, now_s() - t0);
        if (failure_) std::rethrow_exception(failure_);
      }
      size_t k = fitting();
      if (k == free_slots_.size() && !free_slots_.empty()) k = free_slots_.size() - 1;  // too small: made anew
      if (k == free_slots_.size()) {
        slots_.push_back(std::make_unique<Slot>());
        if (on_device()) slots_.back()->cleared = std::make_unique<device::Event>("ShardedOptimizer: bucket cleared");
        free_slots_.push_back(int(slots_.size()) - 1);
      }
      slot_of_[g][size_t(bi)] = free_slots_[k];
      free_slots_.erase(free_slots_.begin() + std::ptrdiff_t(k));
    }
    slot = slots_[size_t(slot_of_[g][size_t(bi)])].get();
    if (slot->buf.bytes() < need * 4) {
      // Zeros, on the stream that uses it first: the caller's for grad_add, else the reduction's.
      slot->buf = Store(cfg_.memory, need * 4, for_caller ? cfg_.stream : where_reduce().stream);
      slot->used = 0;
      slot->pending_clear = false;
    }
    slot->used = std::max(slot->used, need);
  }
  if (for_caller && slot->pending_clear) {
    slot->cleared->wait_on(cfg_.stream);
    slot->pending_clear = false;
  }
  note_grads_held();
  return slot->buf.as<float>();
}

// After bucket bi's reduction (on the thread of "Overlap", or on the device's reduction stream): its
// slot is zeros again, or loses its memory with release_grads, and goes back to the pool.
void ShardedOptimizer::slot_clear(int g, int bi) {
  Slot* slot = nullptr;
  int si = -1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    si = slot_of_[g][size_t(bi)];
    if (si < 0) return;
    slot = slots_[size_t(si)].get();
  }
  if (!cfg_.release_grads) {
    vec::zero(slot->buf.data(), slot->used * 4, where_reduce());
    if (on_device()) {
      slot->cleared->record(side_->get());
      slot->pending_clear = true;
    }
  }
  std::lock_guard<std::mutex> lk(mu_);  // memory() reads the slots' sizes
  if (cfg_.release_grads) slot->buf = Store();
  slot->used = 0;
  slot_of_[g][size_t(bi)] = -1;
  free_slots_.push_back(si);
}

// grads_peak: the bucket buffers held, and the full buffer's size.
void ShardedOptimizer::note_grads_held() {
  int64_t held = 0;
  for (int g = 0; g < kNumGroups; ++g)
    held += on_device() ? grads_device_[g].bytes() : grads_[g].size() * int64_t(sizeof(float));
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& slot : slots_) held += slot->buf.bytes();
  grads_peak_ = std::max(grads_peak_, held);
}

std::vector<float>& ShardedOptimizer::residual(Group g) {
  ZERO8_CHECK_ARG(!on_device(), "residual",
                  "the error-feedback residual of a device optimizer is device memory; read it with "
                  "copy_to_host(group, Part::residual, ...)");
  return residual_[int(g)];
}

void ShardedOptimizer::init(int root) {
  ZERO8_SHARD_DEVICE_SCOPE("init");
  wait_gather();
  drain(Phase::reduce);  // the communicator is the caller's again
  {
    StreamScope scope(*this, where_step());
    for (int g = 0; g < kNumGroups; ++g)
      if (working_[g].bytes() > 0) dp_.broadcast(working_[g].data(), working_[g].bytes(), root);
  }
  refresh_masters();
  discard_gradients();
}

void ShardedOptimizer::discard_gradients() {
  ZERO8_SHARD_DEVICE_SCOPE("discard_gradients");
  wait_gather();
  drain(Phase::reduce);  // the buckets posted so far are reduced (the other ranks reduce them too), then dropped
  clear_grad_inputs();
  for (int g = 0; g < kNumGroups; ++g) {
    vec::zero(part_grad_[g].data(), part_grad_[g].bytes(), where_step());
    float* res = residual_data(g);
    if (res != nullptr) vec::zero(res, layout_.groups[g].padded() * 4, where_step());
  }
  micro_ = 0;
  reported_ = false;
  wire_calls_ = 0;
}

void ShardedOptimizer::refresh_masters() {
  ZERO8_SHARD_DEVICE_SCOPE("refresh_masters");
  wait_gather();
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    const int64_t b = gl.part_begin(rank()), valid = gl.part_valid(rank());
    vec::convert(master_[g].data(), DType::f32, working_[g].as<uint8_t>() + b * dtype_size(cfg_.working_dtype),
                 cfg_.working_dtype, valid, where_step());
  }
  initialized_ = true;
}

// ---- gradient reduction ----

// The options of one wire collective. Stochastic rounding draws from (wire_seed, step, the collective's
// index within the step) here, and the collective adds the rank and the element, so no two collectives of
// a run reuse a draw and a resumed run repeats the draws of an uninterrupted one.
comm::WireOptions ShardedOptimizer::wire_options(comm::WireFormat format) {
  comm::WireOptions opt;
  opt.format = format;
  opt.block = cfg_.layout.wire_block;
  opt.threads = cfg_.threads;
  opt.stochastic = cfg_.stochastic_wire && format == comm::WireFormat::int8;
  if (opt.stochastic) opt.seed = rng_mix(rng_mix(cfg_.wire_seed, uint64_t(steps_)), wire_calls_);
  ++wire_calls_;
  return opt;
}

// On a device, on the side stream: the gradient was written on the caller's stream, and the side stream
// waits for the mark recorded there when the bucket was posted. With overlap, on the optimizer's thread.
void ShardedOptimizer::reduce_bucket(int g, int bi) {
  const Bucket& b = buckets_[g][size_t(bi)];
  const GroupLayout& gl = layout_.groups[g];
  const std::vector<int64_t> off = owner_offsets(gl, b.begin, b.end);
  const int r = rank();
  const int64_t mine = off[r + 1] - off[r];
  const vec::Where w = where_reduce();
  // A bucket that got no gradient on this rank (unused parameters, padding) sends zeros from a slot.
  const float* input = full_input_ ? grad_data(g) + b.begin : slot_data(g, bi, false);
  if (on_device()) posted_[order_pos_[g][size_t(bi)]]->wait_on(side_->get());
  scratch_.grow(std::max<int64_t>(mine, 1) * 4);
  const comm::WireOptions opt = wire_options(wire_.grads);
  float* residual = residual_data(g);
  {
    StreamScope scope(*this, w);
    comm::bucket_reduce_scatter(dp_, input, b.end - b.begin, off, scratch_.as<float>(), opt,
                                residual ? residual + b.begin : nullptr, &wire_ws_);
  }
  // Accumulate into this rank's partition gradient (several micro-batches in stage 2).
  float* dst = part_grad_[g].as<float>() + (b.begin + off[r] - gl.part_begin(r));
  vec::add(dst, DType::f32, scratch_.data(), DType::f32, mine, w);
  done_[g][size_t(bi)] = true;
  if (full_input_)
    release_reduced(g, bi);
  else
    slot_clear(g, bi);
}

void ShardedOptimizer::grad_ready(int param) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  ZERO8_SHARD_DEVICE_SCOPE("grad_ready");
  reported_ = true;
  if (cfg_.stage != 2) return;
  const int g = int(layout_.slots[param].group);
  for (int bi : param_buckets_[g][param]) --pending_[g][bi];
  reduce_in_order(true);
}

// Reduce buckets along the order every rank follows: during backward (only_ready) those at its head whose
// parameters have all been reported, stopping at the first one still waiting; at the end of backward all
// that are left. With overlap they are posted to the optimizer's thread, in that order.
void ShardedOptimizer::reduce_in_order(bool only_ready) {
  for (; next_ < order_.size(); ++next_) {
    const auto [g, bi] = order_[next_];
    if (only_ready && pending_[g][size_t(bi)] > 0) break;
    mark_posted(next_);
    post(Phase::reduce, [this, g = g, bi = bi] { reduce_bucket(g, bi); });
  }
}

bool ShardedOptimizer::param_reduced(int param) const {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  const int g = int(layout_.slots[param].group);
  for (int bi : param_buckets_[g][param])
    if (order_pos_[g][size_t(bi)] < next_) return true;
  return false;
}

// Hand back the memory of the run of reduced buckets around bucket bi of the full gradient input (a huge
// page may straddle two buckets: it goes back once both are reduced).
void ShardedOptimizer::release_reduced(int g, int bi) {
  if (on_device() || !grads_[g].releases()) return;
  int lo = bi, hi = bi;
  while (lo > 0 && done_[g][size_t(lo - 1)]) --lo;
  while (size_t(hi + 1) < done_[g].size() && done_[g][size_t(hi + 1)]) ++hi;
  grads_[g].release(buckets_[g][size_t(lo)].begin, buckets_[g][size_t(hi)].end);
}

// Every gradient of the micro-batch is dropped: the full input is cleared (on a device, on the side stream
// after the reductions that read it, and the caller's stream waits for that before the next backward
// writes it or the step reads the sums); buckets still holding gradients (none after backward_end) are
// cleared and go back to the pool. The thread has no job (drained).
void ShardedOptimizer::clear_grad_inputs() {
  for (int g = 0; g < kNumGroups; ++g) {
    if (full_input_) {
      if (on_device())
        vec::zero(grads_device_[g].data(), grads_device_[g].bytes(), where_reduce());
      else
        grads_[g].zero();
    }
    for (size_t bi = 0; bi < buckets_[g].size(); ++bi) slot_clear(g, int(bi));
    reset_progress(g);
  }
  next_ = 0;
  caller_after_side();
}

void ShardedOptimizer::backward_end(bool boundary) {
  ZERO8_SHARD_DEVICE_SCOPE("backward_end");
  wait_gather();
  ++micro_;
  reported_ = false;
  if (cfg_.stage == 2 || boundary) {
    reduce_in_order(false);
    drain(Phase::reduce);
    clear_grad_inputs();
  }
  if (boundary) micro_ = 0;
}

void ShardedOptimizer::end_accumulation() {
  ZERO8_SHARD_DEVICE_SCOPE("end_accumulation");
  wait_gather();
  if (reported_)
    throw Error(ErrorCode::invalid_argument, "ShardedOptimizer::end_accumulation (rank " + std::to_string(rank()) +
                                                 "): gradients were reported by grad_ready() without backward_end()");
  if (micro_ == 0) return;
  if (cfg_.stage == 1) {
    reduce_in_order(false);
    drain(Phase::reduce);
    clear_grad_inputs();
  }
  micro_ = 0;
}

// ---- the thread of "Overlap" ----

void ShardedOptimizer::post(Phase phase, std::function<void()> job) {
  if (!threaded_) {
    const double t0 = now_s();
    job();
    const double dt = now_s() - t0;
    std::lock_guard<std::mutex> lk(mu_);
    count_job(phase, 1, dt, dt);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_) std::rethrow_exception(failure_);
    jobs_.emplace_back(phase, std::move(job));
  }
  work_cv_.notify_one();
}

void ShardedOptimizer::drain(Phase phase) {
  if (!threaded_) return;
  const double t0 = now_s();
  std::unique_lock<std::mutex> lk(mu_);
  // Bounded: each job's collectives end within the communicator's timeout, or fail (and end the thread).
  done_cv_.wait(lk, [&] { return failure_ || (jobs_.empty() && !busy_); });
  count_job(phase, 0, 0.0, now_s() - t0);
  if (failure_) std::rethrow_exception(failure_);
}

void ShardedOptimizer::wait_gather() {
  if (!deferred_) return;
  drain(Phase::gather);
  caller_after_side();  // a device's last pieces were added into the working copy on the side stream
  if (deferred_.exchange(false)) comm::remove_background_work(this);
}

void ShardedOptimizer::wait_param(int param) {
  ZERO8_CHECK_ARG(param >= 0 && param < int(layout_.slots.size()), "param",
                  "index " + std::to_string(param) + " out of range [0, " + std::to_string(layout_.slots.size()) + ")");
  if (!deferred_) return;
  const int64_t need = gather_index(param);
  if (need < 0) return;
  const double t0 = now_s();
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return failure_ || gathers_done_ > gather_base_ + need; });
  count_job(Phase::gather, 0, 0.0, now_s() - t0);
  if (failure_) std::rethrow_exception(failure_);
  lk.unlock();
  // The job has queued the piece's last kernels on the side stream: the caller's stream runs after them.
  if (on_device()) gathered_[size_t(need)]->wait_on(cfg_.stream);
}

// The index, in the step's order of gather pieces (gather_order_), of the last piece that writes parameter
// `param` (-1: none, an empty parameter). Piece k of group g gathers offsets [k * piece, (k + 1) * piece)
// of every partition; within a group the pieces go in the order of k.
int64_t ShardedOptimizer::gather_index(int param) const {
  const ParamSlot& slot = layout_.slots[size_t(param)];
  if (slot.numel == 0) return -1;
  const int g = int(slot.group);
  const GroupLayout& gl = layout_.groups[g];
  const int64_t piece = gather_piece(g), a = slot.offset, b = slot.offset + slot.numel;
  int64_t last = 0;
  for (int p = gl.owner(a); p <= gl.owner(b - 1); ++p)
    last = std::max(last, (std::min(b, gl.part_end(p)) - gl.part_begin(p) - 1) / piece);
  return gather_pos_[g][size_t(last)];
}

// Runs the jobs in the order they were posted. The first that throws ends the thread: its collective
// failed (communicator.h, "Failure": the communicator is unusable after it), and the caller rethrows the
// error at its next post or drain.
void ShardedOptimizer::worker_loop() {
  std::unique_ptr<device::DeviceGuard> device_guard;  // a device optimizer's device: current per thread
  try {
    device_guard = std::make_unique<device::DeviceGuard>(device_, "ShardedOptimizer's overlap thread");
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    failure_ = std::current_exception();
    done_cv_.notify_all();
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    std::pair<Phase, std::function<void()>> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lk.unlock();
    std::exception_ptr err;
    const double t0 = now_s();
    try {
      job.second();
    } catch (...) {
      err = std::current_exception();
    }
    const double dt = now_s() - t0;
    lk.lock();
    busy_ = false;
    if (job.first == Phase::gather) ++gathers_done_;
    count_job(job.first, 1, dt, 0.0);
    if (err) {
      failure_ = err;
      jobs_.clear();
      done_cv_.notify_all();
      return;
    }
    done_cv_.notify_all();  // drain waits for the last job, a gradient for a free bucket buffer
  }
}

// Under mu_: jobs run, their wall time, and the time the caller waited for them.
void ShardedOptimizer::count_job(Phase phase, int jobs, double ran, double waited) {
  const bool reduce = phase == Phase::reduce;
  (reduce ? overlap_.reductions : overlap_.gathers) += jobs;
  (reduce ? overlap_.reduce_seconds : overlap_.gather_seconds) += ran;
  (reduce ? overlap_.reduce_wait_seconds : overlap_.gather_wait_seconds) += waited;
}

OverlapStats ShardedOptimizer::overlap_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return overlap_;
}

// ---- the step ----

// The sum over ranks of every gradient element squared (the global norm's square, before averaging and
// unscaling), in the fixed order of vec::sum_squares per group, both groups' sums reduced over the ranks
// in one all_reduce, then added: the same bits on the host and on a device. It is finite exactly when
// every rank's gradients are: *overflow says whether it is not. On a device this is the step's one host
// read (16 bytes).
double ShardedOptimizer::grad_sq_sum_global(bool* overflow) {
  const vec::Where w = where_step();
  double* sums = norm_sums_.as<double>();
  for (int g = 0; g < kNumGroups; ++g)
    vec::sum_squares(part_grad_[g].as<float>(), layout_.groups[g].part_valid(rank()), sums + g,
                     norm_work_.as<double>(), w);
  {
    StreamScope scope(*this, w);
    dp_.all_reduce(sums, sums, kNumGroups, comm::ScalarType::f64, comm::ReduceOp::sum);
  }
  double host[kNumGroups];
  static_assert(kNumGroups == 2, "one sum per group");
  if (on_device()) {
    device::copy(host, sums, int64_t(sizeof(host)), cfg_.stream, "ShardedOptimizer::step (the gradient norm)");
    sync_caller("step (the gradient norm)");
  } else {
    std::memcpy(host, sums, sizeof(host));
  }
  // A pipeline's stages share one norm and one overflow verdict (set_step_group): the stages' sums are
  // added over the pipe group, on the host (16 bytes; the group's backend may want device memory).
  if (outer_) comm::all_reduce_host(*outer_, host, kNumGroups, comm::ScalarType::f64, comm::ReduceOp::sum);
  const double total = host[0] + host[1];
  *overflow = !std::isfinite(total);
  return total;
}

void ShardedOptimizer::fill_step_args(int g, optim::StepArgs& a, float grad_scale) {
  const int64_t valid = layout_.groups[g].part_valid(rank());
  a.algo = cfg_.algo;
  a.h.step = steps_ + 1;  // a.h carries the step and the scale only: narrowed() adds a hyper group's values
  a.h.grad_scale = grad_scale;
  a.n = valid;
  a.grad = part_grad_[g].data();
  a.grad_dtype = DType::f32;
  states_[g]->bind(a);
  if (wire_.int8_params || cfg_.working_dtype == DType::f32) {
    // The master is the parameter the kernel updates; param_sync brings it to the working copy.
    a.param = master_[g].data();
    a.param_dtype = DType::f32;
    a.master = nullptr;
  } else {
    // 16-bit working copy: the kernel writes the rounded parameter next to the fp32 master.
    a.param = working_[g].as<uint8_t>() + layout_.groups[g].part_begin(rank()) * dtype_size(cfg_.working_dtype);
    a.param_dtype = cfg_.working_dtype;
    a.master = master_[g].as<float>();
  }
}

// Calls f(hyper group, begin, end) for each hyper group's piece of this rank's partition of group g,
// in offsets from the partition's start. Runs start on state blocks and partitions on whole blocks, so
// every piece but a run's last starts and ends on a block boundary.
template <class F>
void ShardedOptimizer::for_each_run(int g, F&& f) const {
  const GroupLayout& gl = layout_.groups[g];
  const int64_t b = gl.part_begin(rank()), e = b + gl.part_valid(rank());
  for (const HyperRun& run : gl.runs) {
    const int64_t lo = std::max(b, run.begin), hi = std::min(e, run.end);
    if (lo < hi) f(run.hyper_group, lo - b, hi - b);
  }
}

// The kernel arguments of a whole partition (fill_step_args), narrowed to [lo, hi) of it and to the
// hyperparameters of one hyper group. lo is a multiple of the state block (see for_each_run).
static optim::StepArgs narrowed(const optim::StepArgs& whole, const optim::Hyper& h, int64_t lo, int64_t hi) {
  optim::StepArgs a = whole;
  a.h = h;
  a.h.step = whole.h.step;
  a.h.grad_scale = whole.h.grad_scale;
  a.n = hi - lo;
  a.param = static_cast<uint8_t*>(a.param) + lo * dtype_size(a.param_dtype);
  if (a.master) a.master += lo;
  a.grad = static_cast<const uint8_t*>(a.grad) + lo * dtype_size(a.grad_dtype);
  if (a.bits == 8) {
    ZERO8_ASSERT(lo % a.block == 0);
    if (a.code1) a.code1 += lo, a.absmax1 += lo / a.block;
    if (a.code2) a.code2 += lo, a.absmax2 += lo / a.block;
  } else {
    if (a.state1) a.state1 += lo;
    if (a.state2) a.state2 += lo;
  }
  return a;
}

// Segment offsets (from lo) of the parameters in [lo, hi) of group g's partition on this rank, closed
// by hi - lo, for per-tensor norms and trust ratios.
static std::vector<int64_t> segment_offsets(const Layout& lay, int g, int64_t part_begin, int64_t lo, int64_t hi,
                                            std::vector<int>* params) {
  std::vector<int64_t> offs;
  for (const Segment& s : lay.segments(Group(g), part_begin + lo, part_begin + hi)) {
    offs.push_back(s.begin - part_begin - lo);
    params->push_back(s.param);
  }
  offs.push_back(hi - lo);
  return offs;
}

// The runs of one hyper group in `ranges` of this rank's partitions (for_each_run, cut to each range), in
// order, each with its parameters' segments; with trust_by_param, each segment's trust ratio. The kernels
// of a device optimizer read these arrays from device memory: one copy of each per plan, ordered on the
// caller's stream after the kernels that read the previous plan's, so the runs' kernels queue without a
// host wait. The host arrays stay until the next plan: the copies never outlive their source.
void ShardedOptimizer::plan_segments(const std::vector<GatherPiece>& ranges, const std::vector<float>* trust_by_param) {
  SegmentPlan& s = seg_;
  s.runs.clear();
  s.offsets.clear();
  s.params.clear();
  s.trust.clear();
  for (const GatherPiece& r : ranges) {
    const int g = r.group;
    if (layout_.groups[g].part_valid(rank()) == 0) continue;
    const int64_t b = layout_.groups[g].part_begin(rank());
    for_each_run(g, [&](int h, int64_t lo, int64_t hi) {
      lo = std::max(lo, r.lo);
      hi = std::min(hi, r.hi);
      if (lo >= hi) return;
      const size_t offsets_at = s.offsets.size(), first = s.params.size();
      const std::vector<int64_t> offs = segment_offsets(layout_, g, b, lo, hi, &s.params);
      s.offsets.insert(s.offsets.end(), offs.begin(), offs.end());
      s.runs.push_back(SegmentRun{g, h, lo, hi, offsets_at, first, int64_t(s.params.size() - first)});
    });
  }
  if (trust_by_param != nullptr)
    for (int p : s.params) s.trust.push_back((*trust_by_param)[size_t(p)]);
  if (!on_device()) return;
  const std::string where = "ShardedOptimizer::step (segments of LAMB/LARS)";
  seg_offsets_.grow(int64_t(s.offsets.size() * sizeof(int64_t)));
  device::copy(seg_offsets_.data(), s.offsets.data(), int64_t(s.offsets.size() * sizeof(int64_t)), cfg_.stream, where);
  if (s.trust.empty()) return;
  seg_trust_.grow(int64_t(s.trust.size() * sizeof(float)));
  device::copy(seg_trust_.data(), s.trust.data(), int64_t(s.trust.size() * sizeof(float)), cfg_.stream, where);
}

// Run r's segments (and trust ratios, in the step's plan) in a's segment arrays: device or host memory,
// as the kernels that read them.
void ShardedOptimizer::segment_args(optim::StepArgs& a, const SegmentRun& r) {
  const bool dev = on_device();
  a.nseg = r.nseg;
  a.seg_offsets = (dev ? seg_offsets_.as<const int64_t>() : seg_.offsets.data()) + r.offsets_at;
  if (!seg_.trust.empty())
    a.seg_trust = (dev ? seg_trust_.as<const float>() : seg_.trust.data()) + r.first;
}

std::vector<float> ShardedOptimizer::trust_ratios(float grad_scale) {
  // Per-tensor norms: each rank sums its segments, one all_reduce adds them up per parameter. A device's
  // norms of every run go into one device array, read once: the step's second host read, after the
  // gradient norm's (the norms need its clipping).
  std::vector<GatherPiece> partitions;
  for (int g = 0; g < kNumGroups; ++g) partitions.push_back({g, 0, layout_.groups[g].part_valid(rank())});
  plan_segments(partitions, nullptr);
  std::vector<optim::NormSums> out(seg_.params.size());
  if (on_device()) seg_norms_.grow(int64_t(out.size() * sizeof(optim::NormSums)));
  optim::StepArgs whole[kNumGroups];
  for (int g = 0; g < kNumGroups; ++g)
    if (layout_.groups[g].part_valid(rank()) > 0) fill_step_args(g, whole[g], grad_scale);
  for (const SegmentRun& r : seg_.runs) {
    optim::StepArgs a = narrowed(whole[r.group], hypers_[size_t(r.hyper)], r.lo, r.hi);
    segment_args(a, r);
    if (on_device())
      optim::norms_range_cuda(a, seg_.offsets.data() + r.offsets_at, seg_norms_.as<optim::NormSums>() + r.first,
                              cfg_.stream);
    else
      optim::norms_range(a, out.data() + r.first, cfg_.threads);
  }
  if (on_device() && !out.empty()) {
    device::copy(out.data(), seg_norms_.data(), int64_t(out.size() * sizeof(optim::NormSums)), cfg_.stream,
                 "ShardedOptimizer::step (the norms of LAMB/LARS)");
    sync_caller("step (the norms of LAMB/LARS)");
  }
  std::vector<double> sums(params_.size() * 2, 0.0);
  for (size_t i = 0; i < out.size(); ++i) {
    sums[2 * size_t(seg_.params[i])] += out[i].w_sq;
    sums[2 * size_t(seg_.params[i]) + 1] += out[i].u_sq;
  }
  comm::all_reduce_host(dp_, sums.data(), int64_t(sums.size()), comm::ScalarType::f64, comm::ReduceOp::sum);
  std::vector<float> trust(params_.size());
  for (size_t p = 0; p < params_.size(); ++p)
    trust[p] = optim::optim_trust_ratio(cfg_.algo, hypers_[size_t(params_[p].hyper_group)],
                                        optim::NormSums{sums[2 * p], sums[2 * p + 1]});
  return trust;
}

// Steps [lo, hi) of this rank's partition of group g (offsets from its start; lo on a state block). LAMB and
// LARS take their runs from the step's plan (plan_segments over gather_order_), *next_run the next one.
void ShardedOptimizer::step_group(int g, float grad_scale, int64_t lo, int64_t hi, size_t* next_run) {
  if (layout_.groups[g].part_valid(rank()) == 0) return;
  optim::StepArgs whole;
  fill_step_args(g, whole, grad_scale);
  const bool trust = optim::algo_has_trust_ratio(cfg_.algo);
  for_each_run(g, [&](int h, int64_t run_lo, int64_t run_hi) {
    run_lo = std::max(run_lo, lo);
    run_hi = std::min(run_hi, hi);
    if (run_lo >= run_hi) return;
    optim::StepArgs a = narrowed(whole, hypers_[size_t(h)], run_lo, run_hi);
    const SegmentRun* r = nullptr;
    if (trust) {
      ZERO8_ASSERT(*next_run < seg_.runs.size());
      r = &seg_.runs[(*next_run)++];
      ZERO8_ASSERT(r->group == g && r->lo == run_lo && r->hi == run_hi);
      segment_args(a, *r);
    }
    if (on_device()) {
      optim::step_range_cuda(a, r ? seg_.offsets.data() + r->offsets_at : nullptr,
                             r ? seg_.trust.data() + r->first : nullptr, cfg_.stream);
    } else {
      optim::step_range(a, cfg_.threads);
    }
  });
}

// Elements per rank of one all-gather piece of group g: allgather_bucket_size over the ranks, in whole
// alignment units (so each piece holds whole state and wire blocks), at most the partition. The
// stochastic int8 parameter sync keeps one piece: its draws follow the collectives of the step, which
// more pieces would change.
int64_t ShardedOptimizer::gather_piece(int g) const {
  const GroupLayout& gl = layout_.groups[g];
  if (gl.chunk == 0) return 0;
  if (wire_.int8_params && cfg_.stochastic_wire) return gl.chunk;
  int64_t want = cfg_.allgather_bucket_size / world();
  // The int8 sync expands every rank's piece to fp32 before adding it (4 bytes per element over the
  // ranks): capped so that this scratch stays small next to the model whatever allgather_bucket_size is.
  if (wire_.int8_params) want = std::min<int64_t>(want, kInt8GatherPiece / world());
  const int64_t piece = std::max<int64_t>(gl.align, (want + gl.align - 1) / gl.align * gl.align);
  return std::min(piece, gl.chunk);
}

// The all-gather of [lo, hi) of every rank's partition of group g (offsets from each partition's start,
// whole alignment units), after this rank stepped its own: the same bytes, and the same int8 blocks, as
// one gather of the whole partitions.
void ShardedOptimizer::param_sync(int g, int64_t lo, int64_t hi, const comm::WireOptions* int8, const vec::Where& w) {
  const GroupLayout& gl = layout_.groups[g];
  if (gl.padded() == 0 || lo >= hi) return;
  const int esize = dtype_size(cfg_.working_dtype);
  const int r = rank();
  const int64_t valid = gl.part_valid(r), n = hi - lo, mine_valid = std::clamp<int64_t>(valid - lo, 0, n);
  StreamScope scope(*this, w);
  uint8_t* working = working_[g].as<uint8_t>();
  if (int8 == nullptr) {
    if (cfg_.working_dtype == DType::f32)
      vec::copy(working + (gl.part_begin(r) + lo) * esize, master_[g].as<float>() + lo, mine_valid * 4, w);
    const size_t ranks = size_t(world());
    std::vector<int64_t> bytes(ranks, n * esize), displs(ranks, 0);
    for (int p = 0; p < world(); ++p) displs[size_t(p)] = (gl.part_begin(p) + lo) * esize;
    dp_.all_gather_v(working + displs[size_t(r)], bytes[size_t(r)], working, bytes, displs);
    return;
  }
  // int8 parameter sync: the owner sends int8 blocks of (master - working); every rank, the owner
  // included, adds the same decoded delta to its working copy, so replicas stay identical and the
  // next delta carries what this one's rounding lost.
  const DType wt = cfg_.working_dtype;
  delta_.grow(n * 4);  // one piece: the pieces are synced one after the other (on the thread with overlap)
  float* delta = delta_.as<float>();
  vec::zero(delta + mine_valid, (n - mine_valid) * 4, w);
  vec::diff(delta, master_[g].as<float>() + lo, working + (gl.part_begin(r) + lo) * esize, wt, mine_valid, w);
  std::vector<int64_t> off(size_t(world()) + 1);
  for (int p = 0; p <= world(); ++p) off[size_t(p)] = n * p;
  full_delta_.grow(n * world() * 4);
  comm::bucket_all_gather(dp_, delta, n * world(), off, full_delta_.as<float>(), *int8, &wire_ws_);
  for (int p = 0; p < world(); ++p) {
    const int64_t at = gl.part_begin(p) + lo;
    vec::add(working + at * esize, wt, full_delta_.as<float>() + n * p, DType::f32,
             std::clamp<int64_t>(gl.numel - at, 0, n), w);
  }
}

void ShardedOptimizer::sync_working_from_master() {
  ZERO8_SHARD_DEVICE_SCOPE("sync_working_from_master");
  wait_gather();
  drain(Phase::reduce);
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    const int64_t b = gl.part_begin(rank()), valid = gl.part_valid(rank());
    vec::convert(working_[g].as<uint8_t>() + b * dtype_size(cfg_.working_dtype), cfg_.working_dtype,
                 master_[g].data(), DType::f32, valid, where_step());
    param_sync(g, 0, gl.chunk, nullptr, where_step());  // an exact gather: the masters are the truth after a load
  }
  initialized_ = true;
}

// The int8 sync with stochastic rounding is one piece: nothing to overlap.
bool ShardedOptimizer::defers_gather() const { return threaded_ && !(wire_.int8_params && cfg_.stochastic_wire); }

StepInfo ShardedOptimizer::step(bool defer_gather) {
  wait_gather();
  // Zero masters would overwrite the model's weights with the update from zero (every rank alike).
  if (!initialized_)
    throw Error(ErrorCode::invalid_argument, "ShardedOptimizer::step called before init() (rank " +
                                                 std::to_string(rank()) + "): the masters were never set");
  // A step inside an accumulation would step on part of the gradient (stage 2: the buckets reduced so far;
  // stage 1: none) and leave the rest to the next step.
  if (micro_ != 0 || reported_)
    throw Error(ErrorCode::invalid_argument,
                "ShardedOptimizer::step called in the middle of an accumulation (rank " + std::to_string(rank()) +
                    "): " + (reported_ ? "gradients were reported by grad_ready() without backward_end()"
                                       : std::to_string(micro_) + " micro-batch(es) ended with backward_end(false)") +
                    "; end the accumulation's last micro-batch with backward_end(true) first");
  validate_hypers();  // before any collective: a scheduler's bad value fails here, the same on every rank
  ZERO8_SHARD_DEVICE_SCOPE("step");
  caller_after_side();  // the reduced partitions (backward_end made it wait already; a cheap guarantee)
  StepInfo info;
  info.loss_scale = scaler_.scale();
  bool overflow = false;
  const double sq = grad_sq_sum_global(&overflow);
  if (overflow) {
    scaler_.update(true);
    info.skipped = true;
  } else {
    // part_grad holds sum over ranks of (loss_scale * grad): average and unscale.
    const double unscale = 1.0 / (double(world()) * scaler_.scale());
    info.grad_norm = std::sqrt(sq) * unscale;
    if (cfg_.gradient_clipping > 0.0) {
      // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
      const double coef = cfg_.gradient_clipping / (info.grad_norm + 1e-6);
      if (coef < 1.0) info.clip_coef = coef;
    }
    const float grad_scale = float(unscale * info.clip_coef);
    if (optim::algo_has_trust_ratio(cfg_.algo)) {
      const std::vector<float> trust = trust_ratios(grad_scale);
      plan_segments(gather_order_, &trust);
    }
    size_t next_run = 0;  // step_group's place in the plan
    // Each piece of the partition is gathered (with overlap: on the optimizer's thread) while the next
    // one is stepped; the gathers run in the same order on every rank (gather_index counts on it). On a
    // device with the thread, a piece's gather runs on the side stream after the event its step recorded
    // on the caller's stream, so the GPU runs it beside the next pieces' steps (and, deferred, beside the
    // next forward); each piece records its own end (wait_param), and the caller's stream waits for the
    // side stream before the working copy is read as a whole (below, or wait_gather).
    const bool defer = defer_gather && defers_gather();
    if (defer) {
      std::lock_guard<std::mutex> lk(mu_);
      gather_base_ = gathers_done_;
    }
    const bool side = on_device() && threaded_;
    for (size_t k = 0; k < gather_order_.size(); ++k) {
      const int g = gather_order_[k].group;
      const int64_t lo = gather_order_[k].lo, hi = gather_order_[k].hi;
      step_group(g, grad_scale, lo, hi, &next_run);
      if (side) stepped_[k]->record(cfg_.stream);
      const bool int8 = wire_.int8_params;
      const comm::WireOptions opt = int8 ? wire_options(comm::WireFormat::int8) : comm::WireOptions{};
      post(Phase::gather, [this, g, lo, hi, opt, int8, side, k] {
        const comm::WireOptions* o = int8 ? &opt : nullptr;
        if (!side) {
          param_sync(g, lo, hi, o, where_step());
          return;
        }
        stepped_[k]->wait_on(side_->get());
        param_sync(g, lo, hi, o, where_reduce());
        gathered_[k]->record(side_->get());
      });
    }
    if (defer) {
      deferred_ = true;
      comm::add_background_work(this, worker_.get_id(), [this] { wait_gather(); });
    } else {
      drain(Phase::gather);
      caller_after_side();
    }
    ++steps_;
    scaler_.update(false);
  }
  for (int g = 0; g < kNumGroups; ++g) vec::zero(part_grad_[g].data(), part_grad_[g].bytes(), where_step());
  wire_calls_ = 0;
  info.step = steps_;
  return info;
}

MemoryStats ShardedOptimizer::memory() const {
  MemoryStats m;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& slot : slots_) m.grads += slot->buf.bytes();
    m.grads_peak = grads_peak_;
  }
  for (int g = 0; g < kNumGroups; ++g) {
    m.working += working_[g].bytes();
    m.grads += on_device() ? grads_device_[g].bytes() : grads_[g].resident_bytes();
    m.master += master_[g].bytes();
    m.state += states_[g]->bytes();
    m.buffers += part_grad_[g].bytes() + int64_t(residual_[g].size() * sizeof(float)) + residual_device_[g].bytes();
  }
  m.buffers += scratch_.bytes() + delta_.bytes() + full_delta_.bytes();
  m.grads_peak = std::max(m.grads_peak, m.grads);
  return m;
}

// ---- host copies ----

const char* ShardedOptimizer::part_name(Part p) {
  switch (p) {
    case Part::working: return "working";
    case Part::master: return "master";
    case Part::codes1: return "codes1";
    case Part::absmax1: return "absmax1";
    case Part::codes2: return "codes2";
    case Part::absmax2: return "absmax2";
    case Part::state1: return "state1";
    case Part::state2: return "state2";
    case Part::residual: return "residual";
  }
  return "?";
}

int64_t ShardedOptimizer::part_bytes(Group g, Part p) const {
  ZERO8_CHECK_ARG(int(g) >= 0 && int(g) < kNumGroups, "group", "must be 0 (8-bit states) or 1 (fp32 states), got " << int(g));
  const GroupLayout& gl = layout_.groups[int(g)];
  const optim::StateLayout& sl = states_[int(g)]->layout();
  const int64_t valid = gl.part_valid(rank());
  auto state_part = [&](int which, bool codes, bool absmax) -> int64_t {
    if (which > sl.num_states) return 0;
    if (sl.bits == 8) return codes ? valid : absmax ? 4 * sl.num_blocks() : 0;
    return codes || absmax ? 0 : 4 * valid;
  };
  switch (p) {
    case Part::working: return gl.padded() * dtype_size(cfg_.working_dtype);
    case Part::master: return 4 * valid;
    case Part::codes1: return state_part(1, true, false);
    case Part::absmax1: return state_part(1, false, true);
    case Part::codes2: return state_part(2, true, false);
    case Part::absmax2: return state_part(2, false, true);
    case Part::state1: return state_part(1, false, false);
    case Part::state2: return state_part(2, false, false);
    case Part::residual:
      return on_device() ? residual_device_[int(g)].bytes() : int64_t(residual_[int(g)].size() * sizeof(float));
  }
  ZERO8_CHECK_ARG(false, "part", "unknown Part " << int(p));
  return 0;
}

void* ShardedOptimizer::part_data(Group g, Part p) {
  ZERO8_CHECK_ARG(int(g) >= 0 && int(g) < kNumGroups, "group", "must be 0 (8-bit states) or 1 (fp32 states), got " << int(g));
  if (part_bytes(g, p) == 0) return nullptr;
  optim::State* st = state(g);
  switch (p) {
    case Part::working: return working(g);
    case Part::master: return master(g);
    case Part::codes1: return st->codes(1);
    case Part::absmax1: return st->absmax(1);
    case Part::codes2: return st->codes(2);
    case Part::absmax2: return st->absmax(2);
    case Part::state1: return st->fp32(1);
    case Part::state2: return st->fp32(2);
    case Part::residual: return residual_data(int(g));
  }
  return nullptr;
}

void ShardedOptimizer::copy_to_host(Group g, Part p, void* dst) { copy_to_host(g, p, 0, part_bytes(g, p), dst); }

void ShardedOptimizer::copy_to_host(Group g, Part p, int64_t offset, int64_t bytes, void* dst) {
  const int64_t whole = part_bytes(g, p);
  ZERO8_CHECK_ARG(offset >= 0 && bytes >= 0 && offset <= whole && bytes <= whole - offset, "bytes",
                  "[" << offset << ", +" << bytes << ") is not within the " << whole << " bytes of " << part_name(p));
  if (bytes == 0) return;
  ZERO8_CHECK_ARG(dst != nullptr, "dst", "null pointer for " << bytes << " bytes of " << part_name(p));
  ZERO8_SHARD_DEVICE_SCOPE("copy_to_host");
  wait_gather();
  const uint8_t* src = static_cast<const uint8_t*>(part_data(g, p)) + offset;
  if (!on_device()) {
    std::memcpy(dst, src, size_t(bytes));
    return;
  }
  caller_after_side();  // the residual is written on the reduction stream
  device::copy(dst, src, bytes, cfg_.stream, std::string("ShardedOptimizer::copy_to_host (") + part_name(p) + ")");
  sync_caller("copy_to_host");
}

void ShardedOptimizer::copy_from_host(Group g, Part p, const void* src) {
  const int64_t bytes = part_bytes(g, p);
  if (bytes == 0) return;
  ZERO8_CHECK_ARG(src != nullptr, "src", "null pointer for " << bytes << " bytes of " << part_name(p));
  ZERO8_SHARD_DEVICE_SCOPE("copy_from_host");
  wait_gather();
  void* dst = part_data(g, p);
  if (!on_device()) {
    std::memcpy(dst, src, size_t(bytes));
    return;
  }
  caller_after_side();
  device::copy(dst, src, bytes, cfg_.stream, std::string("ShardedOptimizer::copy_from_host (") + part_name(p) + ")");
  sync_caller("copy_from_host");
}

}  // namespace zero8::shard
