// ckpt::save: every rank writes its shard (fp32 master, 8-bit codes and absmax or fp32 states, the
// error-feedback residual) into a temporary directory, rank 0 the model files and the manifest; the
// directory becomes the tag only once complete, and latest follows (see checkpoint.h). A device
// optimizer's parts are staged through a small host buffer; the files are the same bytes either way.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "checkpoint/collective.h"
#include "checkpoint/io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tags.h"
#include "zero8/checkpoint.h"
#include "zero8/version.h"

namespace zero8::ckpt {

using namespace detail;

namespace {

namespace fs = std::filesystem;
using shard::Group;
using shard::kNumGroups;
using shard::ShardedOptimizer;

using Part = ShardedOptimizer::Part;

// The parts of this rank's buffers as the files are written: a host optimizer's own memory, in place; a
// device optimizer's copied in pieces of at most kStageBytes through one page-locked buffer, so a save
// holds no host copy of a whole part or of the model.
class PartWriter {
 public:
  static constexpr int64_t kStageBytes = int64_t(64) << 20;
  explicit PartWriter(ShardedOptimizer& opt) : opt_(opt), device_(opt.config().memory == MemSpace::device) {}

  // Bytes [offset, offset + bytes) of part p of group g, appended to w.
  void write(FileWriter& w, Group g, Part p, int64_t offset, int64_t bytes) {
    if (bytes <= 0) return;
    if (!device_) {
      w.write(static_cast<const uint8_t*>(opt_.part_data(g, p)) + offset, bytes);
      return;
    }
    uint8_t* stage = static_cast<uint8_t*>(stage_.reserve(std::min(bytes, kStageBytes), "checkpoint save (staging)"));
    for (int64_t done = 0; done < bytes;) {
      const int64_t n = std::min(bytes - done, kStageBytes);
      opt_.copy_to_host(g, p, offset + done, n, stage);
      w.write(stage, n);
      done += n;
    }
  }

 private:
  ShardedOptimizer& opt_;
  const bool device_;
  device::PinnedBuffer stage_;
};

struct SectionSource {
  SectionInfo info;
  Group group;
  Part part;
};

FileInfo shard_write(ShardedOptimizer& opt, PartWriter& parts, const std::string& tmp, uint64_t nonce, const Env& env) {
  const int r = opt.rank();
  const shard::Layout& lay = opt.layout();
  std::vector<SectionSource> secs;
  // A section is a whole part of this rank's buffers, named (kind) as the part is.
  auto add = [&](int g, Part part, int64_t b, int64_t e) {
    SectionInfo s;
    s.group = shard::group_name(Group(g));
    s.kind = ShardedOptimizer::part_name(part);
    s.begin = b;
    s.end = e;
    s.bytes = (e - b) * section_esize(s.kind);
    ZERO8_ASSERT(s.bytes == opt.part_bytes(Group(g), part));
    secs.push_back(SectionSource{s, Group(g), part});
  };
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    const int64_t b = gl.part_begin(r), valid = gl.part_valid(r);
    if (valid > 0) {
      add(g, Part::master, b, b + valid);
      const optim::StateLayout& sl = opt.state(Group(g))->layout();
      for (int k = 1; k <= sl.num_states; ++k) {
        if (sl.bits == 8) {
          add(g, k == 1 ? Part::codes1 : Part::codes2, b, b + valid);
          add(g, k == 1 ? Part::absmax1 : Part::absmax2, b / sl.block, b / sl.block + sl.num_blocks());
        } else {
          add(g, k == 1 ? Part::state1 : Part::state2, b, b + valid);
        }
      }
    }
    if (opt.part_bytes(Group(g), Part::residual) > 0) add(g, Part::residual, 0, gl.padded());
  }

  FileInfo fi;
  fi.name = shard_file_name(r);
  fi.role = "shard";
  fi.rank = r;
  FileWriter w(join(tmp, fi.name), true);
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, sizeof(h.magic));
  h.version = uint32_t(kFormatVersion);
  h.header_bytes = sizeof(ShardHeader);
  h.rank = r;
  h.world = opt.world();
  h.step = opt.steps();
  h.nonce = nonce;
  w.write(&h, sizeof(h));
  for (size_t i = 0; i < secs.size(); ++i) {
    if (i == secs.size() / 2) crash_at(env, "mid_shard", r);
    w.pad_to(kSectionAlign);
    secs[i].info.offset = w.offset();
    parts.write(w, secs[i].group, secs[i].part, 0, secs[i].info.bytes);
    fi.sections.push_back(secs[i].info);
  }
  if (secs.empty()) crash_at(env, "mid_shard", r);
  w.finish();
  fi.bytes = w.offset();
  fi.xxh3 = w.digest();
  return fi;
}

// The working copy in its dtype, in model order.
FileInfo model_write(ShardedOptimizer& opt, PartWriter& parts, const std::string& tmp, const std::string& tag) {
  const shard::Layout& lay = opt.layout();
  const std::string dtype = safetensors_dtype(opt.config().working_dtype);
  const int es = dtype_size(opt.config().working_dtype);
  std::vector<SafetensorsTensor> tensors;
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSpec& p = lay.params[i];
    ZERO8_CHECK_ARG(p.name != "__metadata__", "params", "a parameter named '__metadata__' cannot be saved as safetensors");
    tensors.push_back({p.name, dtype, p.shape, nullptr, lay.slots[i].numel * es});
  }
  return safetensors_write(tmp, kModelName, "model", tag, opt.steps(), tensors, [&](FileWriter& w, size_t i) {
    const shard::ParamSlot& slot = lay.slots[i];
    parts.write(w, slot.group, Part::working, slot.offset * es, slot.numel * es);
  });
}

// SaveOptions::state_dict and module_tensors checked and resolved against opt (rank 0, before anything
// is written): the manifest's state_dict.
std::vector<StateDictEntry> state_dict_of(ShardedOptimizer& opt, const SaveOptions& o) {
  std::vector<StateDictEntry> out;
  if (o.state_dict.empty()) {
    ZERO8_CHECK_ARG(o.module_tensors.empty(), "module_tensors", "given without a state_dict naming them");
    return out;
  }
  std::set<std::string> params;
  for (const shard::ParamSpec& p : opt.layout().params) params.insert(p.name);
  std::map<std::string, const SaveOptions::ModuleTensor*> rest;
  for (const SaveOptions::ModuleTensor& t : o.module_tensors) {
    const int es = st_dtype_size(t.dtype);
    ZERO8_CHECK_ARG(es > 0, "module_tensors", "'" << t.name << "': unsupported dtype '" << t.dtype << "'");
    ZERO8_CHECK_ARG(!t.name.empty() && t.name != "__metadata__", "module_tensors", "'" << t.name << "' cannot be a safetensors name");
    ZERO8_CHECK_ARG(!params.count(t.name), "module_tensors", "'" << t.name << "' is also the name of a trained parameter");
    int64_t n = 1;
    for (int64_t d : t.shape) {
      ZERO8_CHECK_ARG(d >= 0, "module_tensors", "'" << t.name << "': negative dimension");
      n *= d;
    }
    ZERO8_CHECK_ARG(t.bytes.size == n * es, "module_tensors",
                    "'" << t.name << "': " << t.bytes.size << " bytes for " << n << " elements of " << t.dtype);
    ZERO8_CHECK_ARG(t.bytes.data != nullptr || n == 0, "module_tensors", "'" << t.name << "': no data (null pointer)");
    ZERO8_CHECK_ARG(rest.emplace(t.name, &t).second, "module_tensors", "'" << t.name << "' is given twice");
  }
  std::set<std::string> keys, used;
  for (const auto& [key, from] : o.state_dict) {
    ZERO8_CHECK_ARG(!key.empty() && key != "__metadata__", "state_dict", "key '" << key << "' cannot be a safetensors name");
    ZERO8_CHECK_ARG(keys.insert(key).second, "state_dict", "key '" << key << "' is given twice");
    StateDictEntry e;
    e.name = key;
    e.tensor = from;
    auto it = rest.find(from);
    if (it != rest.end()) {
      e.source = "model_rest";
      e.dtype = it->second->dtype;
      e.shape = it->second->shape;
      used.insert(from);
    } else {
      ZERO8_CHECK_ARG(params.count(from), "state_dict",
                      "key '" << key << "': '" << from << "' is neither a trained parameter nor one of module_tensors");
      e.source = "param";
    }
    out.push_back(std::move(e));
  }
  for (const SaveOptions::ModuleTensor& t : o.module_tensors)
    ZERO8_CHECK_ARG(used.count(t.name), "module_tensors", "'" << t.name << "' is not the source of any state_dict key");
  return out;
}

// The module's other state_dict entries (SaveOptions::module_tensors) at their dtype.
FileInfo model_rest_write(const std::vector<SaveOptions::ModuleTensor>& tensors, const std::string& tmp, const std::string& tag,
                          int64_t step) {
  std::vector<SafetensorsTensor> out;
  for (const SaveOptions::ModuleTensor& t : tensors)
    out.push_back({t.name, t.dtype, t.shape, t.bytes.data, t.bytes.size});
  return safetensors_write(tmp, kModelRestName, "extra", tag, step, out);
}

// What the manifest says about the optimizer itself (everything but the files and the names).
Manifest manifest_of(ShardedOptimizer& opt) {
  const shard::ShardConfig& cfg = opt.config();
  const shard::Layout& lay = opt.layout();
  Manifest m;
  m.format_version = kFormatVersion;
  m.zero8_version = zero8::version();
  m.step = opt.steps();
  m.world = opt.world();
  m.algo = cfg.algo;
  m.state_bits = cfg.bits;
  m.num_states = optim::algo_num_states(cfg.algo);
  m.hyper = cfg.hyper;
  m.initial_accumulator = cfg.initial_accumulator;
  m.state_block = lay.cfg.state_block;
  m.wire_block = lay.cfg.wire_block;
  m.min_8bit_size = lay.cfg.min_8bit_size;
  m.working_dtype = cfg.working_dtype;
  m.error_feedback = opt.part_bytes(Group::q8, Part::residual) > 0 || opt.part_bytes(Group::fp32, Part::residual) > 0;
  m.fp16 = cfg.fp16;
  m.loss_scaler = opt.scaler().state();
  if (cfg.bits == 8) {
    optim::State* st = opt.state(Group::q8);
    for (int k = 1; k <= m.num_states; ++k)
      m.maps.push_back(MapInfo{k, map_kind_of(st->map(k)), map_hash(*st->map(k))});
  }
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    GroupInfo& gi = m.groups[g];
    gi.name = shard::group_name(Group(g));
    gi.numel = gl.numel;
    gi.align = gl.align;
    gi.chunk = gl.chunk;
    gi.padded = gl.padded();
    gi.state_bits = g == int(Group::q8) ? cfg.bits : 32;
    gi.num_blocks = gi.state_bits == 8 ? (gl.numel + m.state_block - 1) / m.state_block : 0;
  }
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSlot& s = lay.slots[i];
    m.params.push_back(ParamInfo{lay.params[i].name, lay.params[i].shape, shard::group_name(s.group), s.offset, s.numel,
                                 lay.params[i].fp32_state, lay.params[i].hyper_group});
  }
  return m;
}

std::string json_option(const std::string& text, const char* name) {
  if (text.empty()) return "null";
  try {
    return json::parse(text).dump();
  } catch (const json::exception& e) {
    ZERO8_CHECK_ARG(false, name, "not valid JSON: " << e.what());
  }
  return "null";
}

uint64_t nonce_make() {
  std::random_device rd;
  uint64_t x = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  x ^= uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  x ^= uint64_t(::getpid()) << 17;
  return x ? x : 1;
}

}  // namespace

SaveResult save(ShardedOptimizer& opt, const std::string& dir, const SaveOptions& opts) {
  comm::Communicator& c = opt.comm();
  const int r = c.rank();
  // Its masters would be zeros beside the model's real weights, and a load of them would zero the model.
  if (!opt.initialized())
    throw Error(ErrorCode::invalid_argument, "checkpoint save (rank " + std::to_string(r) +
                                                 "): the optimizer was never initialized (init() or a load): "
                                                 "its fp32 masters are not the model's weights");
  const Env env = env_read();
  const std::string tag = opts.tag.empty() ? "global_step" + std::to_string(opt.steps()) : opts.tag;
  std::string why;
  ZERO8_CHECK_ARG(tag_check(tag, &why), "tag", "'" << tag << "' " << why);
  ZERO8_CHECK_ARG(!dir.empty(), "dir", "is empty");
  ZERO8_CHECK_ARG(opts.keep_last >= 0, "keep_last", "must be >= 0, got " << opts.keep_last);
  for (size_t i = 0; i < opts.extra_files.size(); ++i) {
    const std::string& name = opts.extra_files[i].first;
    ZERO8_CHECK_ARG(extra_name_ok(name), "extra_files",
                    "'" << name << "' is not a plain file name of its own (no '/', no leading '.', not the "
                        "manifest, model or shard names)");
    for (size_t k = 0; k < i; ++k)
      ZERO8_CHECK_ARG(opts.extra_files[k].first != name, "extra_files", "'" << name << "' is given twice");
    ZERO8_CHECK_ARG(name != kModelRestName, "extra_files", "'" << name << "' is reserved for module_tensors");
    const ByteSpan& b = opts.extra_files[i].second;
    ZERO8_CHECK_ARG(b.size >= 0 && (b.data != nullptr || b.size == 0), "extra_files",
                    "'" << name << "': " << b.size << " bytes at " << b.data);
  }
  const TimeoutRaise patient(c, env.io_timeout);

  // 1. Rank 0 prepares the temporary directory; its nonce names it for everyone.
  uint64_t nonce = 0;
  std::string client_state, config_json;
  std::vector<StateDictEntry> state_dict;
  Failure f = attempt([&] {
    if (r != 0) return;
    client_state = json_option(opts.client_state, "client_state");
    state_dict = state_dict_of(opt, opts);
    config_json = json_option(opts.config_json, "config_json");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) CKPT_FAIL(dir, "cannot create the checkpoint directory: " + ec.message());
    leftovers_remove(dir);
    nonce = nonce_make();
    const std::string tmp = join(dir, kTmpPrefix + tag + "-" + hex64(nonce));
    if (::mkdir(tmp.c_str(), 0755) != 0) CKPT_FAIL(tmp, "cannot create: " + errno_text(errno));
    crash_at(env, "begin", r);
  });
  agree(c, f);
  comm::broadcast_host(c, &nonce, sizeof(nonce), 0);
  const std::string tmp = join(dir, kTmpPrefix + tag + "-" + hex64(nonce));
  auto tmp_remove = [&] {
    if (r != 0) return;
    std::error_code ec;
    fs::remove_all(tmp, ec);
  };

  // 2. Every rank writes and syncs its shard; rank 0 also the model file.
  std::string entries;
  f = attempt([&] {
    json arr = json::array();
    PartWriter parts(opt);
    arr.push_back(file_to_json(shard_write(opt, parts, tmp, nonce, env)));
    if (r == 0) {
      arr.push_back(file_to_json(model_write(opt, parts, tmp, tag)));
      if (!opts.module_tensors.empty()) arr.push_back(file_to_json(model_rest_write(opts.module_tensors, tmp, tag, opt.steps())));
      for (const auto& [name, bytes] : opts.extra_files) {
        FileInfo fi;
        fi.name = name;
        fi.role = "extra";
        FileWriter w(join(tmp, name), true);
        w.write(bytes.data, bytes.size);
        w.finish();
        fi.bytes = w.offset();
        fi.xxh3 = w.digest();
        arr.push_back(file_to_json(fi));
      }
    }
    entries = arr.dump();
    crash_at(env, "after_shard", r);
  });
  try {
    agree(c, f);
  } catch (...) {
    tmp_remove();
    throw;
  }
  const std::vector<std::string> all = all_gather_strings(c, entries);

  // 3. Rank 0: manifest, rename into place, latest, cleanup.
  std::string outcome;
  bool installed = false;
  f = attempt([&] {
    if (r != 0) return;
    Manifest m = manifest_of(opt);
    m.tag = tag;
    m.nonce = nonce;
    m.saved_unix_s = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    m.config_json = config_json;
    m.client_state = client_state;
    m.state_dict = state_dict;
    FileInfo model;
    const std::string src = join(tmp, kManifestName);
    for (const std::string& e : all)
      for (const json& j : json::parse(e)) {
        FileInfo fi = file_from_json(j, src, "files");
        if (fi.role == "model") model = fi;
        else m.files.push_back(fi);
      }
    m.files.push_back(model);
    crash_at(env, "before_manifest", r);
    const std::string text = manifest_to_json(m).dump(1) + "\n";
    manifest_parse(text, src);  // what load will check, checked before anything is renamed
    FileWriter w(src, true);
    const int64_t half = int64_t(text.size()) / 2;
    w.write(text.data(), half);
    crash_at(env, "mid_manifest", r);
    w.write(text.data() + half, int64_t(text.size()) - half);
    w.finish();
    fsync_dir(tmp);
    crash_at(env, "before_rename", r);
    const std::string old = tag_install(dir, tag, tmp, nonce, env);
    installed = true;
    fsync_dir(dir);
    crash_at(env, "before_latest", r);
    if (opts.update_latest) latest_write(dir, tag, env);
    crash_at(env, "before_cleanup", r);
    if (!old.empty()) remove_tree(old);
    leftovers_remove(dir);
    std::string latest = tag;
    if (!opts.update_latest) {
      try {
        latest = latest_read(dir);
      } catch (const Error&) {
        latest.clear();  // none (or unreadable): only the new tag is protected
      }
    }
    const std::vector<std::string> removed = keep_last_prune(dir, opts.keep_last, tag, latest);
    int64_t bytes = int64_t(text.size());
    for (const FileInfo& fi : m.files) bytes += fi.bytes;
    outcome = json{{"bytes", bytes}, {"removed", removed}}.dump();
  });
  if (f.failed && !installed) tmp_remove();
  agree(c, f);
  const json o = json::parse(broadcast_string(c, outcome, 0));
  SaveResult res;
  res.tag = tag;
  res.path = join(dir, tag);
  res.bytes = o.at("bytes").get<int64_t>();
  res.removed = o.at("removed").get<std::vector<std::string>>();
  return res;
}

}  // namespace zero8::ckpt
