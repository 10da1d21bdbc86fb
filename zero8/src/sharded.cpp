// ZeRO stage 1/2 sharded optimizer (see sharded.h): bucketed gradient reduce-scatter, overflow and
// norm agreement across ranks, the fused step on this rank's partitions, and the parameter all-gather.
#include "zero8/sharded.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/hd.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zero8::shard {

// A contiguous flat range [begin, end) of a group whose gradients are reduced together. Bounds are
// multiples of the group's alignment, so every rank's owned piece is whole wire and state blocks.
struct ShardedOptimizer::Bucket {
  int64_t begin = 0, end = 0;
  int nparams = 0;  // parameters overlapping the bucket
};

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
  dp.all_gather(mine.data(), all.data(), int64_t(k * sizeof(int64_t)));
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
    if (common > 0) dp.all_gather(h.data(), hs.data(), common * int64_t(sizeof(uint64_t)));
    int64_t first = common;  // none of the common ones: a rank has more parameters
    for (int64_t i = 0; i < common && first == common; ++i)
      for (int r = 1; r < world; ++r)
        if (hs[size_t(r * common + i)] != hs[size_t(i)]) first = i;
    // Every rank's description of that parameter, in fixed-size records.
    constexpr size_t kText = 240;
    std::string t = param_text(params, size_t(first)).substr(0, kText - 1);
    t.resize(kText, '\0');
    std::vector<char> texts(kText * size_t(world));
    dp.all_gather(t.data(), texts.data(), int64_t(kText));
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

ShardedOptimizer::ShardedOptimizer(const std::vector<ParamSpec>& params, const ShardConfig& cfg,
                                   comm::Communicator& dp)
    : params_(params), cfg_(cfg), dp_(dp), scaler_(cfg.fp16 ? cfg.loss_scaler : LossScalerConfig{false, 1.0}) {
  // Its buffers (working copy, gradients, state, norms) and the checkpoint code's are host memory.
  comm::check_host_memory(dp, "dp", "ShardedOptimizer");
  ZERO8_CHECK_ARG(cfg.stage == 1 || cfg.stage == 2, "stage", "zero8 implements ZeRO stage 1 and 2, got " << cfg.stage);
  ZERO8_CHECK_ARG(cfg.bits == 8 || cfg.bits == 32, "bits", "must be 8 or 32, got " << cfg.bits);
  ZERO8_CHECK_ARG(cfg.reduce_bucket_size > 0, "reduce_bucket_size", "must be > 0, got " << cfg.reduce_bucket_size);
  ZERO8_CHECK_ARG(cfg.threads >= 0, "threads", "must be >= 0 (0: OpenMP's default), got " << cfg.threads);
  ZERO8_CHECK_ARG(cfg.gradient_clipping >= 0 && std::isfinite(cfg.gradient_clipping), "gradient_clipping",
                  "must be a finite number >= 0, got " << cfg.gradient_clipping);
  ZERO8_CHECK_ARG(!cfg.fp16 || cfg.working_dtype == DType::f16, "fp16",
                  "loss scaling is for float16 parameters; the working dtype is " << dtype_name(cfg.working_dtype));
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
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    working_[g].assign(size_t(gl.padded() * esize), 0);
    part_grad_[g].assign(size_t(gl.chunk), 0.0f);
    master_[g].assign(size_t(gl.chunk), 0.0f);
    // The 8-bit group holds cfg.bits states; the fp32 group (small or marked tensors) 32-bit ones.
    const int bits = g == int(Group::q8) ? cfg.bits : 32;
    const int64_t valid = gl.part_valid(r);
    states_[g] = std::make_unique<optim::State>(optim::StateLayout(cfg.algo, valid, bits, cfg.layout.state_block),
                                                cfg.initial_accumulator);
    if (cfg.error_feedback && cfg.int8_grads) residual_[g].assign(size_t(gl.padded()), 0.0f);
    // Buckets: cut the padded range into aligned pieces of about reduce_bucket_size elements.
    const int64_t bs = std::max<int64_t>(gl.align, (cfg.reduce_bucket_size + gl.align - 1) / gl.align * gl.align);
    for (int64_t b = 0; b < gl.padded(); b += bs) buckets_[g].push_back(Bucket{b, std::min(gl.padded(), b + bs), 0});
    // release_grads: stage 2 with several buckets hands the memory of each reduced bucket back at once,
    // so a rank holds only the gradients not yet reduced. Stage 1 keeps every gradient until the
    // boundary, and one bucket is reduced at the end of backward: there, refaulting the pages each step
    // would cost time and save nothing at the peak.
    grads_[g] = GradBuffer(gl.padded(), cfg.release_grads && cfg.stage == 2 && buckets_[g].size() > 1);
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
  pending_.resize(kNumGroups);
  for (int g = 0; g < kNumGroups; ++g) reset_progress(g);
}

ShardedOptimizer::~ShardedOptimizer() = default;

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
  return working_[int(s.group)].data() + s.offset * dtype_size(cfg_.working_dtype);
}

float* ShardedOptimizer::param_grad(int param) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  const ParamSlot& s = layout_.slots[param];
  return grads_[int(s.group)].data() + s.offset;
}

void ShardedOptimizer::init(int root) {
  for (int g = 0; g < kNumGroups; ++g)
    if (!working_[g].empty()) dp_.broadcast(working_[g].data(), int64_t(working_[g].size()), root);
  refresh_masters();
  discard_gradients();
}

void ShardedOptimizer::discard_gradients() {
  clear_grad_inputs();
  for (int g = 0; g < kNumGroups; ++g) {
    std::fill(part_grad_[g].begin(), part_grad_[g].end(), 0.0f);
    std::fill(residual_[g].begin(), residual_[g].end(), 0.0f);
  }
  micro_ = 0;
  reported_ = false;
  wire_calls_ = 0;
}

void ShardedOptimizer::refresh_masters() {
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    const int64_t b = gl.part_begin(rank()), valid = gl.part_valid(rank());
    for (int64_t i = 0; i < valid; ++i) master_[g][i] = dtype_load(working_[g].data(), cfg_.working_dtype, b + i);
  }
  initialized_ = true;
}

// ---- gradient reduction ----

static std::vector<int64_t> owner_offsets(const GroupLayout& gl, int64_t begin, int64_t end) {
  std::vector<int64_t> off(size_t(gl.world) + 1);
  for (int p = 0; p <= gl.world; ++p) off[p] = std::clamp(gl.part_begin(p), begin, end) - begin;
  return off;
}

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

void ShardedOptimizer::reduce_bucket(int g, const Bucket& b) {
  const GroupLayout& gl = layout_.groups[g];
  const std::vector<int64_t> off = owner_offsets(gl, b.begin, b.end);
  const int r = rank();
  const int64_t mine = off[r + 1] - off[r];
  scratch_.resize(size_t(std::max<int64_t>(mine, 1)));
  const comm::WireOptions opt = wire_options(cfg_.int8_grads ? comm::WireFormat::int8
                                             : cfg_.bf16_grads ? comm::WireFormat::bf16
                                                               : comm::WireFormat::f32);
  float* residual = residual_[g].empty() ? nullptr : residual_[g].data() + b.begin;
  comm::bucket_reduce_scatter(dp_, grads_[g].data() + b.begin, b.end - b.begin, off, scratch_.data(), opt, residual,
                              &wire_ws_);
  // Accumulate into this rank's partition gradient (several micro-batches in stage 2).
  float* dst = part_grad_[g].data() + (b.begin + off[r] - gl.part_begin(r));
  for (int64_t i = 0; i < mine; ++i) dst[i] += scratch_[i];
}

void ShardedOptimizer::grad_ready(int param) {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  reported_ = true;
  if (cfg_.stage != 2) return;
  const int g = int(layout_.slots[param].group);
  for (int bi : param_buckets_[g][param]) --pending_[g][bi];
  reduce_in_order(true);
}

// Reduce buckets along the order every rank follows: during backward (only_ready) those at its head whose
// parameters have all been reported, stopping at the first one still waiting, and handing their memory
// back; at the end of backward all that are left (grad_input is cleared next).
void ShardedOptimizer::reduce_in_order(bool only_ready) {
  for (; next_ < order_.size(); ++next_) {
    const auto [g, bi] = order_[next_];
    if (only_ready && pending_[g][size_t(bi)] > 0) break;
    reduce_bucket(g, buckets_[g][size_t(bi)]);
    done_[g][size_t(bi)] = true;
    if (only_ready) release_reduced(g, bi);
  }
}

bool ShardedOptimizer::param_reduced(int param) const {
  ZERO8_CHECK_ARG(param >= 0 && size_t(param) < params_.size(), "param", "index " << param << " out of range");
  const int g = int(layout_.slots[param].group);
  for (int bi : param_buckets_[g][param])
    if (done_[g][size_t(bi)]) return true;
  return false;
}

// Hand back the memory of the run of reduced buckets around bucket bi (a huge page may straddle two
// buckets: it goes back once both are reduced).
void ShardedOptimizer::release_reduced(int g, int bi) {
  if (!grads_[g].releases()) return;
  int lo = bi, hi = bi;
  while (lo > 0 && done_[g][size_t(lo - 1)]) --lo;
  while (size_t(hi + 1) < done_[g].size() && done_[g][size_t(hi + 1)]) ++hi;
  grads_[g].release(buckets_[g][size_t(lo)].begin, buckets_[g][size_t(hi)].end);
}

void ShardedOptimizer::clear_grad_inputs() {
  for (int g = 0; g < kNumGroups; ++g) {
    grads_[g].zero();
    reset_progress(g);
  }
  next_ = 0;
}

void ShardedOptimizer::backward_end(bool boundary) {
  ++micro_;
  reported_ = false;
  if (cfg_.stage == 2 || boundary) {
    reduce_in_order(false);
    clear_grad_inputs();
  }
  if (boundary) micro_ = 0;
}

// ---- the step ----

bool ShardedOptimizer::overflow_anywhere() {
  int32_t bad = 0;
  for (int g = 0; g < kNumGroups && !bad; ++g) {
    const int64_t valid = layout_.groups[g].part_valid(rank());
    const float* x = part_grad_[g].data();
    for (int64_t i = 0; i < valid; ++i)
      if (!std::isfinite(x[i])) {
        bad = 1;
        break;
      }
  }
  bad = dp_.all_reduce_value<int32_t>(bad, comm::ReduceOp::max);
  if (outer_) bad = outer_->all_reduce_value<int32_t>(bad, comm::ReduceOp::max);
  return bad != 0;
}

double ShardedOptimizer::grad_sq_sum_local() const {
  double s = 0.0;
  for (int g = 0; g < kNumGroups; ++g) {
    const int64_t valid = layout_.groups[g].part_valid(rank());
    const float* x = part_grad_[g].data();
    for (int64_t i = 0; i < valid; ++i) s += double(x[i]) * double(x[i]);
  }
  return s;
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
  if (cfg_.int8_params || cfg_.working_dtype == DType::f32) {
    // The master is the parameter the kernel updates; param_sync brings it to the working copy.
    a.param = master_[g].data();
    a.param_dtype = DType::f32;
    a.master = nullptr;
  } else {
    // 16-bit working copy: the kernel writes the rounded parameter next to the fp32 master.
    a.param = working_[g].data() + layout_.groups[g].part_begin(rank()) * dtype_size(cfg_.working_dtype);
    a.param_dtype = cfg_.working_dtype;
    a.master = master_[g].data();
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

std::vector<float> ShardedOptimizer::trust_ratios(float grad_scale) {
  // Per-tensor norms: each rank sums its segments, one all_reduce adds them up per parameter.
  std::vector<double> sums(params_.size() * 2, 0.0);
  for (int g = 0; g < kNumGroups; ++g) {
    const int64_t b = layout_.groups[g].part_begin(rank());
    if (layout_.groups[g].part_valid(rank()) == 0) continue;
    optim::StepArgs whole;
    fill_step_args(g, whole, grad_scale);
    for_each_run(g, [&](int h, int64_t lo, int64_t hi) {
      std::vector<int> seg_params;
      const std::vector<int64_t> offs = segment_offsets(layout_, g, b, lo, hi, &seg_params);
      optim::StepArgs a = narrowed(whole, hypers_[size_t(h)], lo, hi);
      a.nseg = int64_t(seg_params.size());
      a.seg_offsets = offs.data();
      std::vector<optim::NormSums> out(seg_params.size());
      if (out.empty()) return;
      optim::norms_range(a, out.data(), cfg_.threads);
      for (size_t i = 0; i < seg_params.size(); ++i) {
        sums[2 * size_t(seg_params[i])] += out[i].w_sq;
        sums[2 * size_t(seg_params[i]) + 1] += out[i].u_sq;
      }
    });
  }
  dp_.all_reduce(sums.data(), int64_t(sums.size()), comm::ReduceOp::sum);
  std::vector<float> trust(params_.size());
  for (size_t p = 0; p < params_.size(); ++p)
    trust[p] = optim::optim_trust_ratio(cfg_.algo, hypers_[size_t(params_[p].hyper_group)],
                                        optim::NormSums{sums[2 * p], sums[2 * p + 1]});
  return trust;
}

void ShardedOptimizer::step_group(int g, float grad_scale, const std::vector<float>& trust_by_param) {
  const int64_t b = layout_.groups[g].part_begin(rank());
  if (layout_.groups[g].part_valid(rank()) == 0) return;
  optim::StepArgs whole;
  fill_step_args(g, whole, grad_scale);
  for_each_run(g, [&](int h, int64_t lo, int64_t hi) {
    optim::StepArgs a = narrowed(whole, hypers_[size_t(h)], lo, hi);
    std::vector<int> seg_params;
    std::vector<int64_t> offs;
    std::vector<float> trust;
    if (optim::algo_has_trust_ratio(cfg_.algo)) {
      offs = segment_offsets(layout_, g, b, lo, hi, &seg_params);
      for (int p : seg_params) trust.push_back(trust_by_param[size_t(p)]);
      a.nseg = int64_t(trust.size());
      a.seg_offsets = offs.data();
      a.seg_trust = trust.data();
    }
    optim::step_range(a, cfg_.threads);
  });
}

void ShardedOptimizer::param_sync(int g) {
  const GroupLayout& gl = layout_.groups[g];
  if (gl.padded() == 0) return;
  const int esize = dtype_size(cfg_.working_dtype);
  const int r = rank();
  if (!cfg_.int8_params) {
    if (cfg_.working_dtype == DType::f32)
      std::memcpy(working_[g].data() + gl.part_begin(r) * esize, master_[g].data(), size_t(gl.part_valid(r)) * 4);
    const size_t w = size_t(world());
    std::vector<int64_t> bytes(w, gl.chunk * esize), displs(w, 0);
    for (int p = 0; p < world(); ++p) displs[p] = gl.part_begin(p) * esize;
    dp_.all_gather_v(working_[g].data() + displs[r], bytes[r], working_[g].data(), bytes, displs);
    return;
  }
  // int8 parameter sync: the owner sends int8 blocks of (master - working); every rank, the owner
  // included, adds the same decoded delta to its working copy, so replicas stay identical and the
  // next delta carries what this one's rounding lost.
  const int64_t valid = gl.part_valid(r), b = gl.part_begin(r);
  std::vector<float> delta(size_t(gl.chunk), 0.0f);
  const float* m = master_[g].data();
  const void* wk = working_[g].data();
  const DType wt = cfg_.working_dtype;
#pragma omp parallel for schedule(static) if (valid > 65536)
  for (int64_t i = 0; i < valid; ++i) delta[i] = m[i] - dtype_load(wk, wt, b + i);
  std::vector<int64_t> off(size_t(world()) + 1);
  for (int p = 0; p <= world(); ++p) off[p] = gl.chunk * p;
  full_delta_.resize(size_t(gl.padded()));
  const comm::WireOptions opt = wire_options(comm::WireFormat::int8);
  comm::bucket_all_gather(dp_, delta.data(), gl.padded(), off, full_delta_.data(), opt, &wire_ws_);
  void* w = working_[g].data();
  const float* d = full_delta_.data();
#pragma omp parallel for schedule(static) if (gl.numel > 65536)
  for (int64_t i = 0; i < gl.numel; ++i) dtype_store(w, wt, i, dtype_load(w, wt, i) + d[i]);
}

void ShardedOptimizer::sync_working_from_master() {
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = layout_.groups[g];
    const int64_t b = gl.part_begin(rank()), valid = gl.part_valid(rank());
    for (int64_t i = 0; i < valid; ++i) dtype_store(working_[g].data(), cfg_.working_dtype, b + i, master_[g][i]);
    const bool q = cfg_.int8_params;
    cfg_.int8_params = false;  // an exact gather: the masters are the truth after a load
    param_sync(g);
    cfg_.int8_params = q;
  }
  initialized_ = true;
}

StepInfo ShardedOptimizer::step() {
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
  StepInfo info;
  info.loss_scale = scaler_.scale();
  const bool overflow = overflow_anywhere();
  if (overflow) {
    scaler_.update(true);
    info.skipped = true;
  } else {
    // part_grad holds sum over ranks of (loss_scale * grad): average and unscale.
    const double unscale = 1.0 / (double(world()) * scaler_.scale());
    double sq = dp_.all_reduce_value<double>(grad_sq_sum_local(), comm::ReduceOp::sum);
    if (outer_) sq = outer_->all_reduce_value<double>(sq, comm::ReduceOp::sum);
    info.grad_norm = std::sqrt(sq) * unscale;
    if (cfg_.gradient_clipping > 0.0) {
      // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
      const double coef = cfg_.gradient_clipping / (info.grad_norm + 1e-6);
      if (coef < 1.0) info.clip_coef = coef;
    }
    const float grad_scale = float(unscale * info.clip_coef);
    std::vector<float> trust;
    if (optim::algo_has_trust_ratio(cfg_.algo)) trust = trust_ratios(grad_scale);
    for (int g = 0; g < kNumGroups; ++g) step_group(g, grad_scale, trust);
    for (int g = 0; g < kNumGroups; ++g) param_sync(g);
    ++steps_;
    scaler_.update(false);
  }
  for (int g = 0; g < kNumGroups; ++g) std::fill(part_grad_[g].begin(), part_grad_[g].end(), 0.0f);
  wire_calls_ = 0;
  info.step = steps_;
  return info;
}

MemoryStats ShardedOptimizer::memory() const {
  MemoryStats m;
  for (int g = 0; g < kNumGroups; ++g) {
    m.working += int64_t(working_[g].size());
    m.grads += grads_[g].resident_bytes();
    m.master += int64_t(master_[g].size() * sizeof(float));
    m.state += states_[g]->bytes();
    m.buffers += int64_t((part_grad_[g].size() + residual_[g].size()) * sizeof(float));
  }
  m.buffers += int64_t((scratch_.capacity() + full_delta_.capacity()) * sizeof(float));
  return m;
}

}  // namespace zero8::shard
