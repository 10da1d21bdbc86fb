// The manifest of a checkpoint tag (manifest.h): ckpt::Manifest to JSON and back. The parser checks
// everything a load relies on before any shard is read, and names the file and the field of each fault.
#include "checkpoint/manifest.h"

#include <algorithm>
#include <map>
#include <set>

#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"

namespace zero8::ckpt::detail {

using shard::Group;
using shard::kNumGroups;

int group_index(const std::string& name) {
  for (int g = 0; g < kNumGroups; ++g)
    if (name == shard::group_name(Group(g))) return g;
  return -1;
}

uint64_t map_hash(const quant::QuantTable& t) { return xxh3_64(t.values, sizeof(t.values)); }

std::string map_kind_of(const quant::QuantTable* t) {
  for (int k = 0; k <= int(quant::MapKind::linear_unsigned); ++k)
    if (t == &quant::table_get(quant::MapKind(k))) return quant::map_kind_name(quant::MapKind(k));
  return "custom";
}

bool extra_name_ok(const std::string& name) {
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos || name.find('\\') != std::string::npos)
    return false;
  if (name == kManifestName || name == kModelName) return false;
  return name.rfind(kShardPrefix, 0) != 0;
}

namespace {

bool dtype_parse(const std::string& s, DType* t) {
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    if (s == dtype_name(d) || s == safetensors_dtype(d)) {
      *t = d;
      return true;
    }
  return false;
}

bool algo_parse(const std::string& s, optim::Algo* a) {
  for (const optim::AlgoSpec& r : optim::kAlgos)
    if (s == r.name) {
      *a = r.algo;
      return true;
    }
  return false;
}

json hyper_to_json(const optim::Hyper& h) {
  return json{{"lr", h.lr},
              {"beta1", h.beta1},
              {"beta2", h.beta2},
              {"eps", h.eps},
              {"weight_decay", h.weight_decay},
              {"dampening", h.dampening},
              {"nesterov", h.nesterov},
              {"bias_correction", h.bias_correction},
              {"lr_decay", h.lr_decay},
              {"initial_accumulator", h.initial_accumulator},
              {"trust_coefficient", h.trust_coefficient},
              {"max_trust_ratio", h.max_trust_ratio},
              {"min_trust_ratio", h.min_trust_ratio}};
}

// The manifest's own checksum: xxh3 of the compact dump of every other field, keys in the order the file
// lists them (json is nlohmann's ordered_json, so a parsed manifest dumps to the same text). It covers what
// no file checksum does: the layout, the config and the client state (the engine's step counters, the scheduler).
uint64_t manifest_hash(json j) {
  j.erase(kManifestHashKey);
  const std::string text = j.dump();
  return xxh3_64(text.data(), text.size());
}

// Typed field access for the parser: every failure names the file and the field.
struct Fields {
  const std::string& src;

  const json& at(const json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) CKPT_FAIL(src, "'" + where + "' is not an object");
    auto it = j.find(key);
    if (it == j.end()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is missing");
    return *it;
  }
  int64_t i64(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_number_integer()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not an integer");
    return v.get<int64_t>();
  }
  double num(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_number()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not a number");
    return v.get<double>();
  }
  bool boolean(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_boolean()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not true/false");
    return v.get<bool>();
  }
  std::string str(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_string()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not a string");
    return v.get<std::string>();
  }
  uint64_t hash(const json& j, const char* key, const std::string& where = "") const {
    uint64_t h = 0;
    if (!hex64_parse(str(j, key, where), &h))
      CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not 16 lowercase hex digits");
    return h;
  }
  const json& arr(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_array()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not an array");
    return v;
  }
};

// The section kinds a group holds (besides the rank-local residual).
std::vector<std::string> group_kinds(const Manifest& m, int g) {
  std::vector<std::string> k = {"master"};
  const bool q8 = m.groups[g].state_bits == 8;
  for (int s = 1; s <= m.num_states; ++s) {
    if (q8) {
      k.push_back("codes" + std::to_string(s));
      k.push_back("absmax" + std::to_string(s));
    } else {
      k.push_back("state" + std::to_string(s));
    }
  }
  return k;
}

// Sections of all shards: each (group, kind) must tile its global range exactly once.
void manifest_check_sections(const Manifest& m, const std::string& src) {
  int model_files = 0;
  std::vector<int> shard_of_rank(size_t(m.world), -1);
  std::map<std::string, int> names;
  for (size_t fi = 0; fi < m.files.size(); ++fi) {
    const FileInfo& f = m.files[fi];
    if (!names.emplace(f.name, int(fi)).second) CKPT_FAIL(src, "file '" + f.name + "' is listed twice");
    if (f.bytes < 0) CKPT_FAIL(src, f.name + ": negative size");
    if (f.role == "model") {
      ++model_files;
      if (f.name != kModelName) CKPT_FAIL(src, "the model file is named '" + f.name + "', expected " + kModelName);
      continue;
    }
    if (f.role == "extra") {
      if (!extra_name_ok(f.name)) CKPT_FAIL(src, "extra file '" + f.name + "': not a plain file name of its own");
      continue;
    }
    if (f.rank < 0 || f.rank >= m.world)
      CKPT_FAIL(src, f.name + ": rank " + std::to_string(f.rank) + " outside the world size " + std::to_string(m.world));
    if (shard_of_rank[size_t(f.rank)] >= 0) CKPT_FAIL(src, "two shard files for rank " + std::to_string(f.rank));
    shard_of_rank[size_t(f.rank)] = int(fi);
    if (f.name != shard_file_name(f.rank))
      CKPT_FAIL(src, "the shard of rank " + std::to_string(f.rank) + " is named '" + f.name + "', expected " +
                       shard_file_name(f.rank));
    // Sections lie inside the file, after the header, without overlapping.
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const SectionInfo& s : f.sections) {
      const std::string what = f.name + " section " + s.group + " " + s.kind;
      const int g = group_index(s.group);
      if (g < 0) CKPT_FAIL(src, what + ": unknown group");
      const std::vector<std::string> kinds = group_kinds(m, g);
      if (s.kind != "residual" && std::find(kinds.begin(), kinds.end(), s.kind) == kinds.end())
        CKPT_FAIL(src, what + ": this optimizer's " + s.group + " group has no such state");
      if (s.kind == "residual" && !m.error_feedback) CKPT_FAIL(src, what + ": error_feedback is false");
      if (s.begin < 0 || s.end <= s.begin)
        CKPT_FAIL(src, what + ": bad range [" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")");
      if (s.bytes != (s.end - s.begin) * section_esize(s.kind))
        CKPT_FAIL(src, what + ": " + std::to_string(s.bytes) + " bytes for " + std::to_string(s.end - s.begin) +
                         (section_in_blocks(s.kind) ? " blocks" : " elements"));
      if (s.offset < int64_t(sizeof(ShardHeader)) || s.offset + s.bytes > f.bytes)
        CKPT_FAIL(src, what + ": bytes [" + std::to_string(s.offset) + ", " + std::to_string(s.offset + s.bytes) +
                         ") outside the file's data (" + std::to_string(f.bytes) + " bytes)");
      spans.emplace_back(s.offset, s.offset + s.bytes);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second)
        CKPT_FAIL(src, f.name + ": sections overlap at byte " + std::to_string(spans[i].first));
  }
  if (model_files != 1) CKPT_FAIL(src, std::to_string(model_files) + " model files listed, expected 1");
  for (int r = 0; r < m.world; ++r)
    if (shard_of_rank[size_t(r)] < 0) CKPT_FAIL(src, "no shard file listed for rank " + std::to_string(r));

  struct Piece {
    int64_t begin, end;
    const std::string* file;
  };
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupInfo& gi = m.groups[g];
    std::vector<std::string> kinds = group_kinds(m, g);
    if (m.error_feedback && gi.padded > 0) kinds.push_back("residual");
    for (const std::string& kind : kinds) {
      if (kind == "residual") {
        // Rank-local: each shard holds its own residual over the whole padded group.
        for (const FileInfo& f : m.files) {
          if (f.role != "shard") continue;
          int n = 0;
          for (const SectionInfo& s : f.sections)
            if (s.group == gi.name && s.kind == kind) {
              ++n;
              if (s.begin != 0 || s.end != gi.padded)
                CKPT_FAIL(src, f.name + ": " + gi.name + " residual covers [" + std::to_string(s.begin) + ", " +
                                 std::to_string(s.end) + "), expected [0, " + std::to_string(gi.padded) + ")");
            }
          if (n != 1) CKPT_FAIL(src, f.name + ": " + std::to_string(n) + " " + gi.name + " residual sections, expected 1");
        }
        continue;
      }
      const bool blocks = section_in_blocks(kind);
      const int64_t total = blocks ? gi.num_blocks : gi.numel;
      const char* unit = blocks ? "blocks" : "elements";
      std::vector<Piece> pieces;
      for (const FileInfo& f : m.files)
        for (const SectionInfo& s : f.sections)
          if (s.group == gi.name && s.kind == kind) pieces.push_back(Piece{s.begin, s.end, &f.name});
      std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
      int64_t pos = 0;
      const std::string* prev = nullptr;
      for (const Piece& p : pieces) {
        if (p.begin > pos)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(pos) + ", " + std::to_string(p.begin) +
                           ") are in no shard");
        if (p.begin < pos)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(p.begin) + ", " +
                           std::to_string(std::min(pos, p.end)) + ") are covered twice (" + *prev + " and " + *p.file + ")");
        if (p.end > total)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + *p.file + " covers " + unit + " up to " + std::to_string(p.end) +
                           ", the group has " + std::to_string(total));
        pos = p.end;
        prev = p.file;
      }
      if (pos < total)
        CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(pos) + ", " + std::to_string(total) +
                         ") are in no shard");
    }
  }
}

// The manifest's state_dict: unique keys, each resolving to a parameter or to a tensor of the model_rest
// file (listed), the aliases of one tensor agreeing on its dtype and shape.
void state_dict_parse(Manifest& m, const json& arr, const Fields& F) {
  const std::string& src = F.src;
  std::set<std::string> params, keys;
  for (const ParamInfo& p : m.params) params.insert(p.name);
  std::map<std::string, const StateDictEntry*> rest;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string w = "state_dict[" + std::to_string(i) + "]";
    StateDictEntry e;
    e.name = F.str(arr[i], "name", w);
    e.source = F.str(arr[i], "source", w);
    e.tensor = F.str(arr[i], "tensor", w);
    if (e.name.empty() || e.name == "__metadata__") CKPT_FAIL(src, w + ": key '" + e.name + "' cannot be a safetensors name");
    if (!keys.insert(e.name).second) CKPT_FAIL(src, w + ": key '" + e.name + "' is listed twice");
    if (e.source == "param") {
      if (!params.count(e.tensor)) CKPT_FAIL(src, w + " '" + e.name + "': no parameter '" + e.tensor + "'");
    } else if (e.source == "model_rest") {
      e.dtype = F.str(arr[i], "dtype", w);
      if (st_dtype_size(e.dtype) == 0) CKPT_FAIL(src, w + " '" + e.name + "': unknown dtype '" + e.dtype + "'");
      for (const json& d : F.arr(arr[i], "shape", w)) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) CKPT_FAIL(src, w + " '" + e.name + "': bad shape");
        e.shape.push_back(d.get<int64_t>());
      }
    } else {
      CKPT_FAIL(src, w + " '" + e.name + "': unknown source '" + e.source + "'");
    }
    m.state_dict.push_back(std::move(e));
  }
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source != "model_rest") continue;
    auto [it, fresh] = rest.emplace(e.tensor, &e);
    if (!fresh && (it->second->dtype != e.dtype || it->second->shape != e.shape))
      CKPT_FAIL(src, "state_dict: '" + e.name + "' and '" + it->second->name + "' name the same tensor with another dtype or shape");
  }
  if (!rest.empty() && std::none_of(m.files.begin(), m.files.end(), [](const FileInfo& f) { return f.name == kModelRestName; }))
    CKPT_FAIL(src, std::string("state_dict names tensors of ") + kModelRestName + ", which is not listed in 'files'");
}

}  // namespace

json file_to_json(const FileInfo& f) {
  json j{{"name", f.name}, {"role", f.role}};
  if (f.role == "shard") j["rank"] = f.rank;
  j["bytes"] = f.bytes;
  j["xxh3_64"] = hex64(f.xxh3);
  if (f.role == "shard") {
    json secs = json::array();
    for (const SectionInfo& s : f.sections)
      secs.push_back(json{{"group", s.group},
                          {"kind", s.kind},
                          {"unit", section_in_blocks(s.kind) ? "block" : "element"},
                          {"dtype", section_esize(s.kind) == 1 ? "uint8" : "float32"},
                          {"begin", s.begin},
                          {"end", s.end},
                          {"offset", s.offset},
                          {"bytes", s.bytes}});
    j["sections"] = std::move(secs);
  }
  return j;
}

FileInfo file_from_json(const json& j, const std::string& src, const std::string& where) {
  const Fields F{src};
  FileInfo f;
  f.name = F.str(j, "name", where);
  f.role = F.str(j, "role", where);
  if (f.role != "shard" && f.role != "model" && f.role != "extra")
    CKPT_FAIL(F.src, where + ": unknown file role '" + f.role + "'");
  f.bytes = F.i64(j, "bytes", where);
  f.xxh3 = F.hash(j, "xxh3_64", where);
  if (f.role == "shard") {
    f.rank = int(F.i64(j, "rank", where));
    const json& secs = F.arr(j, "sections", where);
    for (size_t i = 0; i < secs.size(); ++i) {
      const std::string w = where + ".sections[" + std::to_string(i) + "]";
      SectionInfo s;
      s.group = F.str(secs[i], "group", w);
      s.kind = F.str(secs[i], "kind", w);
      s.begin = F.i64(secs[i], "begin", w);
      s.end = F.i64(secs[i], "end", w);
      s.offset = F.i64(secs[i], "offset", w);
      s.bytes = F.i64(secs[i], "bytes", w);
      f.sections.push_back(s);
    }
  }
  return f;
}

json manifest_to_json(const Manifest& m) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] = m.format_version;
  j["zero8_version"] = m.zero8_version;
  j["tag"] = m.tag;
  j["nonce"] = hex64(m.nonce);
  j["saved_unix_s"] = m.saved_unix_s;
  j["step"] = m.step;
  j["world_size"] = m.world;
  json hyper = hyper_to_json(m.hyper);
  j["optimizer"] = json{{"algo", optim::algo_name(m.algo)},
                        {"state_bits", m.state_bits},
                        {"num_states", m.num_states},
                        {"initial_accumulator", m.initial_accumulator},
                        {"hyper", hyper}};
  j["blocks"] = json{{"state_block", m.state_block}, {"wire_block", m.wire_block}, {"min_8bit_size", m.min_8bit_size}};
  json maps = json::array();
  for (const MapInfo& mi : m.maps) maps.push_back(json{{"state", mi.state}, {"kind", mi.kind}, {"xxh3_64", hex64(mi.xxh3)}});
  j["maps"] = std::move(maps);
  j["working_dtype"] = dtype_name(m.working_dtype);
  j["error_feedback"] = m.error_feedback;
  j["loss_scaler"] = json{{"fp16", m.fp16},
                          {"scale", m.loss_scaler.scale},
                          {"cur_iter", m.loss_scaler.cur_iter},
                          {"last_overflow_iter", m.loss_scaler.last_overflow_iter},
                          {"cur_hysteresis", m.loss_scaler.cur_hysteresis}};
  json groups = json::array();
  for (const GroupInfo& g : m.groups)
    groups.push_back(json{{"name", g.name},
                          {"numel", g.numel},
                          {"align", g.align},
                          {"chunk", g.chunk},
                          {"padded", g.padded},
                          {"state_bits", g.state_bits},
                          {"num_blocks", g.num_blocks}});
  j["groups"] = std::move(groups);
  json params = json::array();
  for (const ParamInfo& p : m.params)
    params.push_back(json{{"name", p.name},
                          {"shape", p.shape},
                          {"dtype", dtype_name(m.working_dtype)},
                          {"group", p.group},
                          {"offset", p.offset},
                          {"numel", p.numel},
                          {"fp32_state", p.fp32_state},
                          {"hyper_group", p.hyper_group}});
  j["params"] = std::move(params);
  json files = json::array();
  for (const FileInfo& f : m.files) files.push_back(file_to_json(f));
  j["files"] = std::move(files);
  if (!m.state_dict.empty()) {
    json sd = json::array();
    for (const StateDictEntry& e : m.state_dict) {
      json x{{"name", e.name}, {"source", e.source}, {"tensor", e.tensor}};
      if (e.source == "model_rest") {
        x["dtype"] = e.dtype;
        x["shape"] = e.shape;
      }
      sd.push_back(std::move(x));
    }
    j["state_dict"] = std::move(sd);
  }
  j["config"] = json::parse(m.config_json);
  j["client_state"] = json::parse(m.client_state);
  j[kManifestHashKey] = hex64(manifest_hash(j));
  return j;
}

}  // namespace zero8::ckpt::detail

namespace zero8::ckpt {

using namespace detail;

Manifest manifest_parse(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    CKPT_FAIL(src, std::string("not valid JSON (truncated or corrupt?): ") + e.what());
  }
  const Fields F{src};
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormatName)
    CKPT_FAIL(src, std::string("not a zero8 checkpoint manifest (no \"format\": \"") + kFormatName + "\")");
  // Manifests written before the checksum existed have none: they are read as before.
  if (j.contains(kManifestHashKey)) {
    const uint64_t saved = F.hash(j, kManifestHashKey), now = manifest_hash(j);
    if (saved != now)
      CKPT_FAIL(src, "checksum mismatch: xxh3 " + hex64(now) + " of its fields, '" + kManifestHashKey + "' says " + hex64(saved) +
                       " (the manifest is corrupt or was edited; an edited manifest loads once its '" + kManifestHashKey +
                       "' field is removed)");
  }
  Manifest m;
  m.format_version = int(F.i64(j, "format_version"));
  if (m.format_version != kFormatVersion)
    CKPT_FAIL(src, "unknown format version " + std::to_string(m.format_version) + " (this zero8 reads version " +
                     std::to_string(kFormatVersion) + ")");
  m.zero8_version = F.str(j, "zero8_version");
  m.tag = F.str(j, "tag");
  m.nonce = F.hash(j, "nonce");
  m.saved_unix_s = F.num(j, "saved_unix_s");
  m.step = F.i64(j, "step");
  m.world = int(F.i64(j, "world_size"));
  if (m.world < 1) CKPT_FAIL(src, "world_size " + std::to_string(m.world));
  const json& o = F.at(j, "optimizer", "");
  if (!algo_parse(F.str(o, "algo", "optimizer"), &m.algo)) CKPT_FAIL(src, "unknown optimizer '" + F.str(o, "algo", "optimizer") + "'");
  m.state_bits = int(F.i64(o, "state_bits", "optimizer"));
  if (m.state_bits != 8 && m.state_bits != 32) CKPT_FAIL(src, "optimizer.state_bits " + std::to_string(m.state_bits));
  m.num_states = int(F.i64(o, "num_states", "optimizer"));
  if (m.num_states != optim::algo_num_states(m.algo))
    CKPT_FAIL(src, "optimizer.num_states " + std::to_string(m.num_states) + " for " + optim::algo_name(m.algo));
  m.initial_accumulator = float(F.num(o, "initial_accumulator", "optimizer"));
  const json& h = F.at(o, "hyper", "optimizer");
  const std::string hw = "optimizer.hyper";
  m.hyper.lr = float(F.num(h, "lr", hw));
  m.hyper.beta1 = float(F.num(h, "beta1", hw));
  m.hyper.beta2 = float(F.num(h, "beta2", hw));
  m.hyper.eps = float(F.num(h, "eps", hw));
  m.hyper.weight_decay = float(F.num(h, "weight_decay", hw));
  m.hyper.dampening = float(F.num(h, "dampening", hw));
  m.hyper.nesterov = F.boolean(h, "nesterov", hw);
  m.hyper.bias_correction = F.boolean(h, "bias_correction", hw);
  m.hyper.lr_decay = float(F.num(h, "lr_decay", hw));
  m.hyper.initial_accumulator = float(F.num(h, "initial_accumulator", hw));
  m.hyper.trust_coefficient = float(F.num(h, "trust_coefficient", hw));
  m.hyper.max_trust_ratio = float(F.num(h, "max_trust_ratio", hw));
  // Absent from checkpoints written before the field existed: those steps clipped from above only.
  m.hyper.min_trust_ratio = h.contains("min_trust_ratio") ? float(F.num(h, "min_trust_ratio", hw)) : 0.0f;
  const json& b = F.at(j, "blocks", "");
  m.state_block = int32_t(F.i64(b, "state_block", "blocks"));
  m.wire_block = int32_t(F.i64(b, "wire_block", "blocks"));
  m.min_8bit_size = F.i64(b, "min_8bit_size", "blocks");
  const json& maps = F.arr(j, "maps");
  for (size_t i = 0; i < maps.size(); ++i) {
    const std::string w = "maps[" + std::to_string(i) + "]";
    m.maps.push_back(MapInfo{int(F.i64(maps[i], "state", w)), F.str(maps[i], "kind", w), F.hash(maps[i], "xxh3_64", w)});
  }
  if (!dtype_parse(F.str(j, "working_dtype"), &m.working_dtype)) CKPT_FAIL(src, "unknown working_dtype '" + F.str(j, "working_dtype") + "'");
  m.error_feedback = F.boolean(j, "error_feedback");
  const json& ls = F.at(j, "loss_scaler", "");
  m.fp16 = F.boolean(ls, "fp16", "loss_scaler");
  m.loss_scaler.scale = F.num(ls, "scale", "loss_scaler");
  m.loss_scaler.cur_iter = F.i64(ls, "cur_iter", "loss_scaler");
  m.loss_scaler.last_overflow_iter = F.i64(ls, "last_overflow_iter", "loss_scaler");
  m.loss_scaler.cur_hysteresis = int(F.i64(ls, "cur_hysteresis", "loss_scaler"));
  const json& groups = F.arr(j, "groups");
  if (groups.size() != size_t(kNumGroups)) CKPT_FAIL(src, std::to_string(groups.size()) + " groups, expected 2");
  for (int g = 0; g < kNumGroups; ++g) {
    const std::string w = "groups[" + std::to_string(g) + "]";
    GroupInfo& gi = m.groups[g];
    gi.name = F.str(groups[g], "name", w);
    if (gi.name != shard::group_name(Group(g))) CKPT_FAIL(src, w + " is '" + gi.name + "', expected '" + shard::group_name(Group(g)) + "'");
    gi.numel = F.i64(groups[g], "numel", w);
    gi.align = F.i64(groups[g], "align", w);
    gi.chunk = F.i64(groups[g], "chunk", w);
    gi.padded = F.i64(groups[g], "padded", w);
    gi.state_bits = int(F.i64(groups[g], "state_bits", w));
    gi.num_blocks = F.i64(groups[g], "num_blocks", w);
  }
  const json& params = F.arr(j, "params");
  std::vector<shard::ParamSpec> specs;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string w = "params[" + std::to_string(i) + "]";
    ParamInfo p;
    p.name = F.str(params[i], "name", w);
    for (const json& d : F.arr(params[i], "shape", w)) {
      if (!d.is_number_integer()) CKPT_FAIL(src, w + ".shape holds a non-integer");
      p.shape.push_back(d.get<int64_t>());
    }
    p.group = F.str(params[i], "group", w);
    p.offset = F.i64(params[i], "offset", w);
    p.numel = F.i64(params[i], "numel", w);
    p.fp32_state = F.boolean(params[i], "fp32_state", w);
    p.hyper_group = params[i].contains("hyper_group") ? int(F.i64(params[i], "hyper_group", w)) : 0;
    specs.push_back(shard::ParamSpec{p.name, p.shape, p.fp32_state, p.hyper_group});
    m.params.push_back(std::move(p));
  }
  // The layout is a pure function of the parameters and the block sizes: recompute it and hold the
  // manifest to it.
  shard::Layout lay;
  try {
    shard::LayoutConfig lc;
    lc.world = m.world;
    lc.state_block = m.state_block;
    lc.wire_block = m.wire_block;
    lc.min_8bit_size = m.min_8bit_size;
    lay = shard::Layout::build(specs, lc);
  } catch (const Error& e) {
    CKPT_FAIL(src, "the parameters and block sizes do not form a layout: " + strip_where(e.what()));
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ParamInfo& p = m.params[i];
    const shard::ParamSlot& s = lay.slots[i];
    if (p.group != shard::group_name(s.group) || p.offset != s.offset || p.numel != s.numel)
      CKPT_FAIL(src, "parameter '" + p.name + "': group/offset/numel " + p.group + "/" + std::to_string(p.offset) + "/" +
                       std::to_string(p.numel) + " disagree with the layout (" + shard::group_name(s.group) + "/" +
                       std::to_string(s.offset) + "/" + std::to_string(s.numel) + ")");
  }
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    const GroupInfo& gi = m.groups[g];
    const int bits = g == int(Group::q8) ? m.state_bits : 32;
    const int64_t nb = bits == 8 ? (gl.numel + m.state_block - 1) / m.state_block : 0;
    if (gi.numel != gl.numel || gi.align != gl.align || gi.chunk != gl.chunk || gi.padded != gl.padded() ||
        gi.state_bits != bits || gi.num_blocks != nb)
      CKPT_FAIL(src, "group " + gi.name + " disagrees with the layout of its parameters");
  }
  if (m.state_bits == 8 && int(m.maps.size()) != m.num_states)
    CKPT_FAIL(src, std::to_string(m.maps.size()) + " maps for " + std::to_string(m.num_states) + " 8-bit states");
  const json& files = F.arr(j, "files");
  for (size_t i = 0; i < files.size(); ++i) m.files.push_back(file_from_json(files[i], src, "files[" + std::to_string(i) + "]"));
  manifest_check_sections(m, src);
  if (j.contains("state_dict")) state_dict_parse(m, F.arr(j, "state_dict"), F);
  m.config_json = F.at(j, "config", "").dump();
  m.client_state = F.at(j, "client_state", "").dump();
  return m;
}

Manifest manifest_read(const std::string& tag_dir) {
  const std::string src = join(tag_dir, kManifestName);
  return manifest_parse(file_read_text(src), src);
}

}  // namespace zero8::ckpt
