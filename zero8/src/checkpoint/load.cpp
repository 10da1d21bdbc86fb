// ckpt::load: every rank validates the manifest and reads the ranges of the old shards that overlap
// its partition (any saved world size) into staging buffers; only when every rank succeeded are the
// masters, states, working copy, step and loss scaler replaced (see checkpoint.h), in host or device
// memory alike.
#include <algorithm>

#include "checkpoint/collective.h"
#include "checkpoint/io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tag_files.h"
#include "checkpoint/tags.h"
#include "zero8/checkpoint.h"

namespace zero8::ckpt {

using namespace detail;

namespace {

using shard::Group;
using shard::kNumGroups;
using shard::ShardedOptimizer;

// The checkpoint against the optimizer it is loaded into: what must match exactly.
void compat_check(const Manifest& m, ShardedOptimizer& opt, const std::string& src) {
  const shard::Layout& lay = opt.layout();
  const shard::ShardConfig& cfg = opt.config();
  const size_t n = std::min(m.params.size(), lay.params.size());
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& a = m.params[i];
    const shard::ParamSpec& b = lay.params[i];
    if (a.name != b.name) {
      std::vector<std::string> saved, here;
      for (const ParamInfo& p : m.params) saved.push_back(p.name);
      for (const shard::ParamSpec& p : lay.params) here.push_back(p.name);
      std::sort(saved.begin(), saved.end());
      std::sort(here.begin(), here.end());
      CKPT_FAIL(src, (saved == here ? "the same parameters in another order" : "another model") + std::string(": parameter ") +
                       std::to_string(i) + " is '" + a.name + "' in the checkpoint, '" + b.name + "' in this model" +
                       (saved == here ? " (the optimizer keeps the order it was given, param groups included)" : ""));
    }
    if (a.shape != b.shape)
      CKPT_FAIL(src, "another model: parameter '" + a.name + "' has shape " + shape_text(a.shape) + " in the checkpoint, " +
                       shape_text(b.shape) + " in this model");
  }
  if (m.params.size() != lay.params.size())
    CKPT_FAIL(src, "another model: the checkpoint has " + std::to_string(m.params.size()) + " parameters, this model " +
                     std::to_string(lay.params.size()) + " ('" +
                     (m.params.size() > n ? m.params[n].name : lay.params[n].name) + "' is only in the " +
                     (m.params.size() > n ? "checkpoint" : "model") + ")");
  if (m.algo != cfg.algo)
    CKPT_FAIL(src, std::string("different optimizer: the checkpoint holds ") + optim::algo_name(m.algo) + " states, this optimizer is " +
                     optim::algo_name(cfg.algo));
  if (m.state_bits != cfg.bits)
    CKPT_FAIL(src, "different optimizer: the checkpoint holds " + std::to_string(m.state_bits) + "-bit states, this optimizer " +
                     std::to_string(cfg.bits) + "-bit ones");
  if (m.state_bits == 8 && m.state_block != lay.cfg.state_block)
    CKPT_FAIL(src, "different state block size: " + std::to_string(m.state_block) + " in the checkpoint, " +
                     std::to_string(lay.cfg.state_block) + " in this optimizer (8-bit blocks cannot be re-cut)");
  for (size_t i = 0; i < n; ++i)
    if (m.params[i].hyper_group != lay.params[i].hyper_group)
      CKPT_FAIL(src, "parameter '" + m.params[i].name + "' is in param group " + std::to_string(m.params[i].hyper_group) +
                       " in the checkpoint, param group " + std::to_string(lay.params[i].hyper_group) +
                       " here (the optimizer states are laid out by param group; load with the same groups, or "
                       "without the optimizer states)");
  for (size_t i = 0; i < n; ++i)
    if (m.params[i].group != shard::group_name(lay.slots[i].group))
      CKPT_FAIL(src, "parameter '" + m.params[i].name + "' has " + m.params[i].group + " states in the checkpoint, " +
                       shard::group_name(lay.slots[i].group) + " states here (min_8bit_size " + std::to_string(m.min_8bit_size) +
                       " vs " + std::to_string(lay.cfg.min_8bit_size) + ", fp32_state " + (m.params[i].fp32_state ? "true" : "false") +
                       " vs " + (lay.params[i].fp32_state ? "true" : "false") + ")");
  if (cfg.bits == 8) {
    optim::State* st = opt.state(Group::q8);
    if (int(m.maps.size()) != m.num_states)
      CKPT_FAIL(src, std::to_string(m.maps.size()) + " quantization maps listed for " + std::to_string(m.num_states) + " states");
    for (const MapInfo& mi : m.maps) {
      if (mi.state < 1 || mi.state > m.num_states) CKPT_FAIL(src, "map of state " + std::to_string(mi.state) + " out of range");
      const quant::QuantTable* t = st->map(mi.state);
      const std::string kind = map_kind_of(t);
      const uint64_t h = map_hash(*t);
      if (kind != mi.kind || h != mi.xxh3)
        CKPT_FAIL(src, "state " + std::to_string(mi.state) + " quantization map: '" + mi.kind + "' (xxh3 " + hex64(mi.xxh3) +
                         ") in the checkpoint, '" + kind + "' (xxh3 " + hex64(h) + ") here");
    }
  }
}

// This rank's partitions read from the old shards, held until everything has been read and checked.
struct Staged {
  std::vector<float> master[kNumGroups];
  std::vector<uint8_t> codes[kNumGroups][2];
  std::vector<float> absmax[kNumGroups][2];
  std::vector<float> fp32[kNumGroups][2];
  std::vector<float> residual[kNumGroups];
  bool residual_restore = false;
  std::vector<uint8_t> working[kNumGroups];  // rank 0 only, when the working dtype matches
  bool working_restore = false;
  bool scaler_restore = false;
};

void stage_read(ShardedOptimizer& opt, FileSet& files, Staged& s) {
  const int r = opt.rank();
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = opt.layout().groups[g];
    const int64_t b = gl.part_begin(r), valid = gl.part_valid(r);
    s.master[g].resize(size_t(valid));
    files.read_range(g, "master", b, b + valid, s.master[g].data());
    const optim::StateLayout& sl = opt.state(Group(g))->layout();
    ZERO8_ASSERT(sl.n == valid);
    for (int k = 1; k <= sl.num_states; ++k) {
      const std::string n = std::to_string(k);
      if (sl.bits == 8) {
        s.codes[g][k - 1].resize(size_t(valid));
        files.read_range(g, "codes" + n, b, b + valid, s.codes[g][k - 1].data());
        s.absmax[g][k - 1].resize(size_t(sl.num_blocks()));
        files.read_range(g, "absmax" + n, b / sl.block, b / sl.block + sl.num_blocks(), s.absmax[g][k - 1].data());
      } else {
        s.fp32[g][k - 1].resize(size_t(valid));
        files.read_range(g, "state" + n, b, b + valid, s.fp32[g][k - 1].data());
      }
    }
    if (s.residual_restore && gl.padded() > 0) {
      s.residual[g].resize(size_t(gl.padded()));
      files.read_local(g, "residual", r, s.residual[g].data(), gl.padded() * 4);
    }
  }
}

void model_stage(const Manifest& m, ShardedOptimizer& opt, FileSet& files, Staged& s) {
  const FileReader& f = files.get(kModelName);
  const Safetensors st = safetensors_parse(f);
  model_check(st, m, f.path());
  if (!s.working_restore) return;
  const shard::Layout& lay = opt.layout();
  const int es = dtype_size(m.working_dtype);
  for (int g = 0; g < kNumGroups; ++g) s.working[g].assign(size_t(lay.groups[g].padded() * es), 0);
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSlot& slot = lay.slots[i];
    const SafetensorsEntry& e = st.tensors.at(lay.params[i].name);
    f.read_at(st.data_start + e.begin, s.working[int(slot.group)].data() + slot.offset * es, slot.numel * es);
  }
}

// The broadcast of the restored working copy runs on the optimizer's stream (a device optimizer's
// communicator otherwise orders it after the legacy default stream only), restored after.
class CommStreamScope {
 public:
  CommStreamScope(comm::Communicator& c, const shard::ShardConfig& cfg) : c_(c), prev_(c.stream()) {
    if (cfg.memory == MemSpace::device) {
      c_.set_stream(cfg.stream);
      set_ = true;
    }
  }
  ~CommStreamScope() {
    if (!set_) return;
    try {
      c_.set_stream(prev_);
    } catch (const Error&) {  // it was valid when it was set: nothing to restore it from
    }
  }
  CommStreamScope(const CommStreamScope&) = delete;
  CommStreamScope& operator=(const CommStreamScope&) = delete;

 private:
  comm::Communicator& c_;
  void* prev_;
  bool set_ = false;
};

// The staged partitions into the optimizer, through copy_from_host (a plain copy for a host optimizer).
void commit(const Manifest& m, ShardedOptimizer& opt, Staged& s) {
  using Part = ShardedOptimizer::Part;
  opt.discard_gradients();  // of the weights being replaced (residuals too); the saved residuals are restored below
  for (int g = 0; g < kNumGroups; ++g) {
    const Group gr = Group(g);
    opt.copy_from_host(gr, Part::master, s.master[g].data());
    const optim::StateLayout& sl = opt.state(gr)->layout();
    for (int k = 1; k <= sl.num_states; ++k) {
      if (sl.bits == 8) {
        opt.copy_from_host(gr, k == 1 ? Part::codes1 : Part::codes2, s.codes[g][k - 1].data());
        opt.copy_from_host(gr, k == 1 ? Part::absmax1 : Part::absmax2, s.absmax[g][k - 1].data());
      } else {
        opt.copy_from_host(gr, k == 1 ? Part::state1 : Part::state2, s.fp32[g][k - 1].data());
      }
    }
    if (s.residual_restore && !s.residual[g].empty()) opt.copy_from_host(gr, Part::residual, s.residual[g].data());
  }
  opt.set_steps(m.step);
  if (s.scaler_restore) opt.scaler().set_state(m.loss_scaler);
  if (s.working_restore) {
    const CommStreamScope scope(opt.comm(), opt.config());
    for (int g = 0; g < kNumGroups; ++g) {
      const Group gr = Group(g);
      const int64_t bytes = opt.part_bytes(gr, Part::working);
      if (bytes == 0) continue;
      if (opt.rank() == 0) opt.copy_from_host(gr, Part::working, s.working[g].data());
      opt.comm().broadcast(opt.working(gr), bytes, 0);
    }
    opt.mark_initialized();
  } else {
    opt.sync_working_from_master();
  }
}

}  // namespace

LoadResult load(ShardedOptimizer& opt, const std::string& dir, const LoadOptions& opts) {
  comm::Communicator& c = opt.comm();
  const int r = c.rank();
  const TimeoutRaise patient(c, env_read().io_timeout);

  // 1. Rank 0 resolves the tag and reads the manifest; every rank works from that same text.
  std::string tag, path, text;
  Failure f = attempt([&] {
    if (r != 0) return;
    if (opts.tag.empty()) {
      tag = latest_read(dir);
    } else {
      std::string why;
      ZERO8_CHECK_ARG(tag_check(opts.tag, &why), "tag", "'" << opts.tag << "' " << why);
      tag = opts.tag;
    }
    path = tag_path(dir, tag);
    text = file_read_text(join(path, kManifestName));
  });
  agree(c, f);
  tag = broadcast_string(c, tag, 0);
  path = broadcast_string(c, path, 0);
  text = broadcast_string(c, text, 0);

  // 2. Validate and read everything into staging buffers.
  LoadResult res;
  res.tag = tag;
  res.path = path;
  Manifest m;
  Staged s;
  f = attempt([&] {
    const std::string src = join(path, kManifestName);
    m = manifest_parse(text, src);
    if (m.tag != tag)  // a renamed tag directory: harmless, the nonce ties its files together
      res.warnings.push_back("the manifest was saved as tag '" + m.tag + "', it is now in '" + path + "'");
    compat_check(m, opt, src);
    const shard::ShardConfig& cfg = opt.config();
    const bool has_residual = opt.part_bytes(Group::q8, ShardedOptimizer::Part::residual) > 0 ||
                              opt.part_bytes(Group::fp32, ShardedOptimizer::Part::residual) > 0;
    // A residual is one rank's share of the gradient in flat coordinates: it carries over only to
    // the same rank of the same layout.
    bool same_layout = m.world == opt.world() && m.wire_block == opt.layout().cfg.wire_block;
    for (int g = 0; g < kNumGroups; ++g) same_layout = same_layout && m.groups[g].padded == opt.layout().groups[g].padded();
    s.residual_restore = has_residual && m.error_feedback && same_layout;
    // The config keeps residuals over several ranks, and this optimizer none: it is a single rank, which
    // quantizes no gradients (sharded.h, WirePlan).
    const bool single = !has_residual && shard::wire_plan(cfg, 2).error_feedback;
    const char* none_kept = "a single rank quantizes no gradients, so it keeps none";
    if (has_residual && !m.error_feedback)
      res.warnings.push_back("the checkpoint holds no error-feedback residuals: they start from zero");
    else if (m.error_feedback && !same_layout && (has_residual || single))
      res.warnings.push_back("error-feedback residuals dropped: saved with " + std::to_string(m.world) + " ranks and wire block " +
                             std::to_string(m.wire_block) + ", loaded with " + std::to_string(opt.world()) + " and " +
                             std::to_string(opt.layout().cfg.wire_block) +
                             (single ? std::string(" (") + none_kept + ")" : std::string("; they start from zero")));
    else if (!has_residual && m.error_feedback)
      res.warnings.push_back(std::string("the checkpoint's error-feedback residuals are not used: ") +
                             (single ? none_kept : "error feedback is off"));
    s.working_restore = m.working_dtype == cfg.working_dtype;
    if (!s.working_restore)
      res.warnings.push_back(std::string("the checkpoint's working copy is ") + dtype_name(m.working_dtype) + ", this optimizer's " +
                             dtype_name(cfg.working_dtype) + ": the working copy is recomputed from the fp32 masters");
    // Without fp16 the scaler is static (scale 1) but still counts iterations: restored too.
    s.scaler_restore = m.fp16 == cfg.fp16;
    if (m.fp16 != cfg.fp16)
      res.warnings.push_back(std::string("loss scaler state not restored: the checkpoint was saved ") + (m.fp16 ? "with" : "without") +
                             " fp16 loss scaling, this optimizer runs " + (cfg.fp16 ? "with" : "without"));
    FileSet files(path, m, opts.verify);
    stage_read(opt, files, s);
    if (r == 0) model_stage(m, opt, files, s);
    extras_check(files, m, r == 0);
    res.bytes_hashed = files.hashed();
    res.step = m.step;
    res.saved_world = m.world;
    res.client_state = m.client_state;
    res.config_json = m.config_json;
    if (opts.before_commit) opts.before_commit(res);
  });
  agree(c, f);

  // 3. Nothing failed anywhere: install.
  commit(m, opt, s);
  return res;
}

}  // namespace zero8::ckpt
