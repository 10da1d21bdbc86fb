// zero8-checkpoint: look at, verify and export zero8 checkpoints without a training job.
//   inspect <dir> [--tag T]                          tags, latest, step, world size, param groups, bytes per part;
//                                                    exit 1 when a file of the tag is missing, truncated or has
//                                                    a bad header (checksums: verify)
//   verify  <dir> [--tag T]                          every checksum and range; exit 1 on any fault
//   to-fp32 <dir> <out.safetensors> [--tag T] [--no-verify]   the module's state_dict, trained weights in fp32
// <dir> is a checkpoint directory (the tag defaults to the one `latest` names) or a tag directory.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "zero8/checkpoint.h"
#include "zero8/checkpoint_format.h"
#include "zero8/error.h"

namespace {

namespace fs = std::filesystem;
using namespace zero8;

// The usage text: on stderr with exit 2 after a usage error (msg), on stdout with exit 0 when asked for (-h).
int usage(const char* msg, bool asked = false) {
  if (msg) std::fprintf(stderr, "zero8-checkpoint: %s\n", msg);
  std::fprintf(asked ? stdout : stderr,
               "usage: zero8-checkpoint inspect <dir> [--tag T]\n"
               "       zero8-checkpoint verify <dir> [--tag T]\n"
               "       zero8-checkpoint to-fp32 <dir> <out.safetensors> [--tag T] [--no-verify]\n"
               "<dir>: a checkpoint directory (default tag: the one <dir>/latest names) or a tag directory\n");
  return asked ? 0 : 2;
}

struct Args {
  std::string cmd, dir, out, tag;
  bool no_verify = false;
};

// Whether `path` exists; a path that cannot be looked at (permissions) is an error naming it, not "no".
bool path_exists(const fs::path& path) {
  std::error_code ec;
  const bool found = fs::exists(path, ec);
  if (ec) throw Error(ErrorCode::io, path.string() + ": cannot access: " + ec.message());
  return found;
}

bool is_tag_dir(const std::string& dir) { return path_exists(fs::path(dir) / ckpt::kManifestName); }

// The tag directory to work on.
std::string resolve(const Args& a) {
  if (a.tag.empty() && is_tag_dir(a.dir)) return a.dir;
  return ckpt::tag_path(a.dir, a.tag.empty() ? ckpt::latest_read(a.dir) : a.tag);
}

// `s` padded with spaces to `width` characters, counting UTF-8 code points rather than bytes so that a
// tag such as "étape-2" lines up with ASCII ones (printf's %-24s counts bytes).
std::string padded(const std::string& s, size_t width) {
  size_t chars = 0;
  for (unsigned char c : s) chars += (c & 0xC0) != 0x80;  // every byte but a continuation byte starts a character
  return chars >= width ? s : s + std::string(width - chars, ' ');
}

std::string bytes_text(int64_t b) {
  char buf[64];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof(buf), "%lld (%.2f GiB)", (long long)b, double(b) / double(1 << 30));
  else if (b >= (int64_t(1) << 20)) std::snprintf(buf, sizeof(buf), "%lld (%.2f MiB)", (long long)b, double(b) / double(1 << 20));
  else std::snprintf(buf, sizeof(buf), "%lld", (long long)b);
  return buf;
}

std::string time_text(double unix_s) {
  const std::time_t t = std::time_t(unix_s);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// What zero8.engine's state in the manifest's client_state says about the hyper groups: how many are
// param groups (the engine numbers its per-parameter override groups after them) and, for each override
// group, "override of param group G, {overrides}". param_groups -1: not an engine's checkpoint.
struct EngineGroups {
  int64_t param_groups = -1;
  std::vector<std::string> overrides;
};

EngineGroups engine_groups(const ckpt::Manifest& m) {
  EngineGroups g;
  const nlohmann::json cs = nlohmann::json::parse(m.client_state, nullptr, /*allow_exceptions=*/false);
  if (!cs.is_object()) return g;
  const auto format = cs.find("format"), groups = cs.find("optimizer");
  if (format == cs.end() || *format != "zero8-engine" || groups == cs.end() || !groups->is_array()) return g;
  g.param_groups = int64_t(groups->size());
  const auto og = cs.find("override_groups");
  if (og != cs.end() && og->is_array())
    for (const nlohmann::json& o : *og) {
      const auto pg = o.is_object() ? o.find("param_group") : o.end(), ov = o.is_object() ? o.find("overrides") : o.end();
      g.overrides.push_back(pg != o.end() && ov != o.end() ? "override of param group " + pg->dump() + ", " + ov->dump()
                                                           : o.dump());
    }
  return g;
}

// The param groups (hyper groups: each with its own hyperparameters) with their tensors and elements,
// and the padding their runs add to the state groups (each run starts on a state block). An engine's
// override groups are told apart from its param groups.
std::string param_groups_text(const ckpt::Manifest& m) {
  std::map<int, std::pair<int64_t, int64_t>> per;  // group -> tensors, elements
  int64_t used[2] = {0, 0};
  for (const ckpt::ParamInfo& p : m.params) {
    auto& e = per[p.hyper_group];
    ++e.first;
    e.second += p.numel;
    used[p.group == m.groups[0].name ? 0 : 1] += p.numel;
  }
  const EngineGroups eg = engine_groups(m);
  int64_t overridden = 0;
  for (const auto& [g, e] : per) overridden += eg.param_groups >= 0 && g >= eg.param_groups;
  std::string t = "param groups: " + std::to_string(int64_t(per.size()) - overridden);
  if (overridden) t += ", override groups: " + std::to_string(overridden);
  if (per.size() > 1) {
    const char* sep = " (";
    for (const auto& [g, e] : per) {
      t += sep + std::to_string(g);
      const int64_t k = eg.param_groups >= 0 ? g - eg.param_groups : -1;
      if (k >= 0) t += " [" + (k < int64_t(eg.overrides.size()) ? eg.overrides[size_t(k)] : std::string("override group")) + "]";
      t += ": " + std::to_string(e.first) + " tensors, " + std::to_string(e.second) + " elements";
      sep = "; ";
    }
    t += ")";
    const int64_t pad0 = m.groups[0].numel - used[0], pad1 = m.groups[1].numel - used[1];
    if (pad0 || pad1)
      t += ", padding between their runs: " + m.groups[0].name + " " + std::to_string(pad0) + ", " + m.groups[1].name + " " +
           std::to_string(pad1) + " elements";
  }
  return t;
}

// One line of inspect's tag list.
struct TagRow {
  std::string tag, path;  // path: <dir>/<tag>, or the .replaced- directory holding it
  double saved = 0.0;
  std::string text;       // "step S, world size W" or "unreadable: <error>"
  bool readable = false;
};

// The tags of a checkpoint directory as save and load see them: the complete tags (tags_list), each tag
// an interrupted two-rename replace left only under .replaced-<tag>-<nonce> (tag_path reads it there and
// the next save renames it back), and tag directories whose manifest cannot be read or validated, or that
// cannot be looked into at all (listed with the error, never used). Then the leftovers the next save removes.
int inspect_list(const Args& a, const std::string& latest) {
  std::vector<TagRow> rows;
  std::vector<std::string> leftovers;
  auto row = [&](const std::string& tag, const std::string& path) {
    TagRow r;
    r.tag = tag;
    r.path = path;
    try {
      const ckpt::Manifest m = ckpt::manifest_read(path);
      r.saved = m.saved_unix_s;
      r.text = "step " + std::to_string(m.step) + ", world size " + std::to_string(m.world);
      r.readable = true;
    } catch (const Error& e) {
      r.text = std::string("unreadable: ") + e.what();
    }
    rows.push_back(r);
  };
  const std::vector<std::string> tags = ckpt::tags_list(a.dir);
  for (const std::string& t : tags) row(t, (fs::path(a.dir) / t).string());
  for (const fs::directory_entry& e : fs::directory_iterator(a.dir)) {
    const std::string n = e.path().filename().string();
    std::error_code ec;
    if (n.rfind(ckpt::kTmpPrefix, 0) == 0 || n == ckpt::kLatestTmpName) {
      leftovers.push_back(n + " (removed by the next save)");
    } else if (n.rfind(ckpt::kReplacedPrefix, 0) == 0) {
      std::string tag;
      try {
        tag = ckpt::manifest_read(e.path().string()).tag;
      } catch (const Error&) {
      }
      std::string holder;
      try {
        if (!tag.empty()) holder = ckpt::tag_path(a.dir, tag);
      } catch (const Error&) {
      }
      if (tag.empty())
        leftovers.push_back(n + " (no readable manifest; removed by the next save)");
      else if (!fs::equivalent(holder, e.path(), ec))
        leftovers.push_back(n + " (an older copy of tag " + tag + ", which is in place; removed by the next save)");
      else
        row(tag, e.path().string());  // the only copy of its tag
    } else if (n[0] != '.' && e.is_directory(ec) && std::find(tags.begin(), tags.end(), n) == tags.end()) {
      // A manifest tags_list could not read (a damaged tag), or a directory whose manifest cannot even be
      // looked for (no permission): listed with manifest_read's error, which names the path and the cause.
      const bool manifest = fs::exists(e.path() / ckpt::kManifestName, ec);
      if (manifest || ec) row(n, e.path().string());
    }
  }
  // Oldest save first, as tags_list orders them; unreadable ones (no save time) last, by name.
  std::stable_sort(rows.begin(), rows.end(), [](const TagRow& x, const TagRow& y) {
    if (x.readable != y.readable) return x.readable;
    return x.readable ? x.saved < y.saved : x.tag < y.tag;
  });
  const size_t complete = size_t(std::count_if(rows.begin(), rows.end(), [](const TagRow& r) { return r.readable; }));
  std::printf("tags (%zu, oldest first%s):\n", rows.size(),
              complete == rows.size() ? "" : ("; " + std::to_string(rows.size() - complete) + " unreadable").c_str());
  for (const TagRow& r : rows) {
    std::printf("  %s %s%s\n", padded(r.tag, 24).c_str(), r.text.c_str(), r.tag == latest ? "  <- latest" : "");
    const std::string n = fs::path(r.path).filename().string();
    if (n != r.tag)
      std::printf("  %s held in %s after an interrupted replace: read from there, renamed back by the next save\n",
                  padded("", 24).c_str(), n.c_str());
  }
  for (const std::string& l : leftovers) std::printf("  leftover of an interrupted save: %s\n", l.c_str());
  return int(complete);
}

int inspect(const Args& a) {
  if (!is_tag_dir(a.dir)) {
    std::string latest;
    try {
      latest = ckpt::latest_read(a.dir);
    } catch (const Error& e) {
      std::printf("latest: none (%s)\n", e.what());
    }
    if (!latest.empty()) std::printf("latest: %s\n", latest.c_str());
    const int complete = inspect_list(a, latest);
    if (latest.empty() && a.tag.empty()) return complete == 0 ? 1 : 0;
  }
  const std::string tag_dir = resolve(a);
  const ckpt::Manifest m = ckpt::manifest_read(tag_dir);
  const int64_t mbytes = int64_t(fs::file_size(fs::path(tag_dir) / ckpt::kManifestName));
  const ckpt::Summary s = ckpt::summarize(m, mbytes);
  std::printf("tag %s (%s)\n", m.tag.c_str(), tag_dir.c_str());
  std::printf("  format version %d, written by zero8 %s at %s\n", m.format_version, m.zero8_version.c_str(),
              time_text(m.saved_unix_s).c_str());
  std::printf("  step %lld, world size %d\n", (long long)m.step, m.world);
  std::printf("  optimizer %s, %d state(s) per parameter, %d-bit; state block %d, wire block %d, min_8bit_size %lld\n",
              optim::algo_name(m.algo), m.num_states, m.state_bits, m.state_block, m.wire_block, (long long)m.min_8bit_size);
  for (const ckpt::MapInfo& mi : m.maps) std::printf("  state %d map: %s\n", mi.state, mi.kind.c_str());
  std::printf("  parameters: %zu tensors, %lld elements (%s group %lld, %s group %lld), working dtype %s\n", m.params.size(),
              (long long)s.numel, m.groups[0].name.c_str(), (long long)m.groups[0].numel, m.groups[1].name.c_str(),
              (long long)m.groups[1].numel, dtype_name(m.working_dtype));
  std::printf("  %s\n", param_groups_text(m).c_str());
  std::printf("  loss scale %g (%s), error feedback %s\n", m.loss_scaler.scale, m.fp16 ? "fp16 dynamic" : "static",
              m.error_feedback ? "on" : "off");
  std::printf("  bytes: master %s, codes %s, absmax %s, fp32 state %s, residual %s, model %s, other %s, total %s\n",
              bytes_text(s.master).c_str(), bytes_text(s.codes).c_str(), bytes_text(s.absmax).c_str(),
              bytes_text(s.fp32).c_str(), bytes_text(s.residual).c_str(), bytes_text(s.model).c_str(),
              bytes_text(s.other).c_str(), bytes_text(s.total).c_str());
  for (const ckpt::FileInfo& f : m.files) std::printf("  file %s: %s bytes\n", f.name.c_str(), bytes_text(f.bytes).c_str());
  // What a few bytes per file tell: every file there, at its size, with a good header. The checksums,
  // which read everything, are verify's.
  const ckpt::VerifyResult v = ckpt::verify(tag_dir, /*checksums=*/false);
  if (m.state_dict.empty()) {
    std::printf("  state_dict: not listed (to-fp32 gives the trained parameters only)\n");
  } else {
    int64_t trained = 0, rest = 0, aliases = 0;
    for (const ckpt::StateDictEntry& e : m.state_dict) {
      if (e.name != e.tensor) ++aliases;
      else if (e.source == "param") ++trained;
      else ++rest;
    }
    std::printf("  state_dict: %zu keys: %lld trained, %lld frozen parameters and buffers, %lld tied aliases\n",
                m.state_dict.size(), (long long)trained, (long long)rest, (long long)aliases);
  }
  const std::string cs = m.client_state.size() > 200 ? m.client_state.substr(0, 200) + "..." : m.client_state;
  std::printf("  client state: %s\n  config: %s\n", cs.c_str(), m.config_json == "null" ? "none" : "stored");
  if (!v.ok()) {
    for (const std::string& p : v.problems) std::fprintf(stderr, "error: %s\n", p.c_str());
    std::fprintf(stderr, "FAILED %s: %zu problem(s) in its files (inspect reads each file's size and header; verify "
                         "also checks every checksum)\n", tag_dir.c_str(), v.problems.size());
    return 1;
  }
  std::printf("  files: all %d present, sizes and headers as the manifest lists them (checksums: zero8-checkpoint "
              "verify)\n", v.files);
  return 0;
}

int verify(const Args& a) {
  const std::string tag_dir = resolve(a);
  const ckpt::VerifyResult v = ckpt::verify(tag_dir);
  for (const std::string& p : v.problems) std::fprintf(stderr, "error: %s\n", p.c_str());
  if (!v.ok()) {
    std::fprintf(stderr, "FAILED %s: %zu problem(s)\n", tag_dir.c_str(), v.problems.size());
    return 1;
  }
  std::printf("OK %s: %d files, %lld bytes, every checksum and range verified\n", tag_dir.c_str(), v.files, (long long)v.bytes);
  return 0;
}

int to_fp32(const Args& a) {
  const std::string tag_dir = resolve(a);
  const ckpt::ExportResult r = ckpt::export_fp32(tag_dir, a.out, !a.no_verify);
  const ckpt::Manifest m = ckpt::manifest_read(tag_dir);
  if (r.complete) {
    std::printf("wrote %s: the module's state_dict of %s (step %lld), %lld tensors: %lld trained (fp32 masters), %lld "
                "frozen parameters and buffers (%s)\n",
                a.out.c_str(), tag_dir.c_str(), (long long)m.step, (long long)r.tensors, (long long)r.trained,
                (long long)r.rest, ckpt::kModelRestName);
  } else {
    std::printf("wrote %s: %lld fp32 tensors from the masters of %s (step %lld)\n", a.out.c_str(), (long long)r.tensors,
                tag_dir.c_str(), (long long)m.step);
    // The engine saves the module's whole state in mp_rank_00_model_states.pt (an extra file); a C++
    // ckpt::save without SaveOptions::state_dict has nothing beyond the trained parameters.
    bool engine_file = false;
    for (const ckpt::FileInfo& f : m.files) engine_file |= f.name == "mp_rank_00_model_states.pt";
    std::printf("note: this checkpoint lists no state_dict (saved before zero8 recorded one, or without the engine): "
                "the output holds the trained parameters only%s\n",
                engine_file ? "; frozen parameters and buffers, if any, are in its mp_rank_00_model_states.pt"
                            : "; it holds nothing else (no frozen parameters or buffers were saved)");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage(nullptr);
  Args a;
  a.cmd = argv[1];
  if (a.cmd == "-h" || a.cmd == "--help") return usage(nullptr, true);
  std::vector<std::string> pos;
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--tag") {
      if (i + 1 >= argc) return usage("--tag needs a value");
      a.tag = argv[++i];
    } else if (s == "--no-verify") {
      a.no_verify = true;
    } else if (s == "-h" || s == "--help") {
      return usage(nullptr, true);
    } else if (!s.empty() && s[0] == '-') {
      return usage(("unknown option " + s).c_str());
    } else {
      pos.push_back(s);
    }
  }
  const size_t want = a.cmd == "to-fp32" ? 2 : 1;
  if (a.cmd != "inspect" && a.cmd != "verify" && a.cmd != "to-fp32") return usage(("unknown command " + a.cmd).c_str());
  if (pos.size() != want) return usage("wrong number of arguments");
  if (a.no_verify && a.cmd != "to-fp32") return usage("--no-verify applies to to-fp32 only");
  a.dir = pos[0];
  if (want == 2) a.out = pos[1];
  try {
    if (a.cmd == "inspect") return inspect(a);
    if (a.cmd == "verify") return verify(a);
    return to_fp32(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
