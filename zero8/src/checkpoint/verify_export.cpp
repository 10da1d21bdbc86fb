// Reading a tag without a communicator, for the zero8-checkpoint tool and the engine: bytes per part
// (summarize), every check of every file (verify), and the consolidated fp32 weights (export_fp32).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tag_files.h"
#include "zero8/checkpoint.h"

namespace zero8::ckpt {

using namespace detail;

namespace fs = std::filesystem;

Summary summarize(const Manifest& m, int64_t manifest_bytes) {
  Summary s;
  for (const FileInfo& f : m.files) {
    s.total += f.bytes;
    if (f.role == "model") s.model += f.bytes;
    for (const SectionInfo& x : f.sections) {
      if (x.kind == "master") s.master += x.bytes;
      else if (x.kind.rfind("codes", 0) == 0) s.codes += x.bytes;
      else if (x.kind.rfind("absmax", 0) == 0) s.absmax += x.bytes;
      else if (x.kind.rfind("state", 0) == 0) s.fp32 += x.bytes;
      else if (x.kind == "residual") s.residual += x.bytes;
    }
  }
  s.total += manifest_bytes;
  s.other = s.total - (s.master + s.codes + s.absmax + s.fp32 + s.residual + s.model);
  for (const ParamInfo& p : m.params) s.numel += p.numel;
  return s;
}

VerifyResult verify(const std::string& tag_dir, bool checksums) {
  VerifyResult v;
  Manifest m;
  try {
    m = manifest_read(tag_dir);
  } catch (const Error& e) {
    v.problems.push_back(strip_where(e.what()));
    return v;
  }
  FileSet files(tag_dir, m, checksums);
  for (const FileInfo& fi : m.files) {
    ++v.files;
    try {
      const FileReader& f = files.get(fi.name);
      if (fi.role == "model") model_check(safetensors_parse(f), m, f.path());
      if (fi.name == kModelRestName && !m.state_dict.empty()) model_rest_check(safetensors_parse(f), m, f.path());
    } catch (const Error& e) {
      v.problems.push_back(strip_where(e.what()));
    }
  }
  v.bytes = files.hashed();
  return v;
}

namespace {

// Where export_fp32 writes out_path, checked before anything is read: out_path, or the file a symbolic
// link there leads to (written through: the link stays a link). Refused, naming out_path: an empty path,
// a missing parent directory, an existing directory, device, fifo or socket, any path inside a tag
// directory of the checkpoint directory (any tag's, not only the one read), and an existing file of the
// checkpoint directory (a file of a tag, found by inode so that hard links and links count, or its
// latest): the rename would put the export in its place.
struct ExportTarget {
  std::string path;   // the file to replace or create
  std::string shown;  // out_path in errors (and where it leads, for a link)
  int mode = -1;      // the permission bits of the file replaced (-1: a new file)
};

ExportTarget export_target(const std::string& tag_dir, const std::string& out_path) {
  ZERO8_CHECK_ARG(!out_path.empty(), "out_path", "is empty (the safetensors file to write)");
  ExportTarget t{out_path, out_path};
  struct stat st;
  bool found = false;
  for (int hops = 0;; ++hops) {
    if (::lstat(t.path.c_str(), &st) != 0) {
      if (errno != ENOENT) CKPT_FAIL(t.shown, "cannot write it: " + errno_text(errno));
      break;
    }
    if (!S_ISLNK(st.st_mode)) {
      found = true;
      break;
    }
    if (hops == 40) CKPT_FAIL(out_path, "too many levels of symbolic links");
    std::error_code ec;
    const fs::path to = fs::read_symlink(t.path, ec);
    if (ec) CKPT_FAIL(out_path, "cannot read the symbolic link " + t.path + ": " + ec.message());
    t.path = (to.is_absolute() ? to : fs::path(t.path).parent_path() / to).string();
    t.shown = out_path + " (a symbolic link to " + t.path + ")";
  }
  const fs::path parent = fs::path(t.path).has_parent_path() ? fs::path(t.path).parent_path() : fs::path(".");
  struct stat pst;
  if (::stat(parent.c_str(), &pst) != 0)
    CKPT_FAIL(t.shown, errno == ENOENT ? "the directory " + parent.string() + " does not exist"
                                       : "cannot write into " + parent.string() + ": " + errno_text(errno));
  if (!S_ISDIR(pst.st_mode)) CKPT_FAIL(t.shown, parent.string() + " is not a directory");
  // Nothing goes into a tag directory of the checkpoint directory (the tag read, another tag, a copy held
  // aside by a replace, a save in progress): a new file there is in no manifest, an existing one is data.
  const std::string root = fs::path(join(tag_dir, "..")).lexically_normal().string();
  std::vector<std::string> own = {join(root, kLatestName), join(root, kLatestTmpName)};
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root, ec)) {
    std::error_code dec;
    const bool staging = d.path().filename().string().rfind(kTmpPrefix, 0) == 0;
    if (!d.is_directory(dec) || !(staging || fs::exists(d.path() / kManifestName, dec))) continue;
    struct stat dst;
    if (::stat(d.path().c_str(), &dst) == 0 && dst.st_dev == pst.st_dev && dst.st_ino == pst.st_ino)
      CKPT_FAIL(t.shown, "is inside " + d.path().string() +
                             ", a tag directory of the checkpoint being exported: write the export elsewhere");
    for (const fs::directory_entry& e : fs::directory_iterator(d.path(), dec)) own.push_back(e.path().string());
  }
  if (!found) return t;
  if (S_ISDIR(st.st_mode)) CKPT_FAIL(t.shown, "is a directory (the output is one safetensors file: give its path)");
  if (!S_ISREG(st.st_mode)) CKPT_FAIL(t.shown, "is not a regular file (a device, fifo or socket): it is not replaced");
  for (const std::string& f : own) {
    struct stat fst;
    if (::stat(f.c_str(), &fst) == 0 && fst.st_dev == st.st_dev && fst.st_ino == st.st_ino)
      CKPT_FAIL(t.shown, "is a file of the checkpoint being exported (" + f + "): it is not replaced");
  }
  t.mode = int(st.st_mode & 07777);
  return t;
}

}  // namespace

ExportResult export_fp32(const std::string& tag_dir, const std::string& out_path, bool verify_files) {
  const ExportTarget target = export_target(tag_dir, out_path);
  const Manifest m = manifest_read(tag_dir);
  const std::string src = join(tag_dir, kManifestName);
  if (verify_files) {
    // Every file of the tag, as `zero8-checkpoint verify` checks it, not only those the export reads: a
    // corrupt model file or model-states file means a damaged checkpoint, which an export must not hide.
    const VerifyResult v = verify(tag_dir);
    if (!v.ok()) {
      std::string all = v.problems[0];
      for (size_t i = 1; i < v.problems.size(); ++i) all += "; " + v.problems[i];
      ZERO8_THROW(io, all);
    }
  }
  FileSet files(tag_dir, m, /*verify=*/false);  // verify() hashed every file; sizes and headers are checked again
  std::map<std::string, const ParamInfo*> params;
  for (const ParamInfo& p : m.params) params.emplace(p.name, &p);
  // What to write, in order: the state_dict's keys, then any trained parameter it does not name (all of
  // them for a manifest without a state_dict).
  struct Out {
    std::string name;
    const ParamInfo* param = nullptr;          // from the masters
    const StateDictEntry* rest = nullptr;      // from the model_rest file
    std::string dtype = "F32";                 // as written
    int64_t bytes = 0;                         // as written
  };
  std::vector<Out> outs;
  std::set<std::string> named;
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source == "param") {
      outs.push_back(Out{e.name, params.at(e.tensor), nullptr});
      named.insert(e.tensor);
    } else {
      outs.push_back(Out{e.name, nullptr, &e});
    }
  }
  std::set<std::string> keys;
  for (const Out& o : outs) keys.insert(o.name);
  for (const ParamInfo& p : m.params) {
    if (named.count(p.name)) continue;
    if (!keys.insert(p.name).second) CKPT_FAIL(src, "parameter '" + p.name + "' is also the name of another state_dict entry");
    outs.push_back(Out{p.name, &p, nullptr});
  }
  Safetensors rest_st;
  const FileReader* rest_f = nullptr;
  if (std::any_of(outs.begin(), outs.end(), [](const Out& o) { return o.rest != nullptr; })) {
    rest_f = &files.get(kModelRestName);
    rest_st = safetensors_parse(*rest_f);
    model_rest_check(rest_st, m, rest_f->path());
  }

  ExportResult res;
  res.complete = !m.state_dict.empty();
  std::vector<SafetensorsTensor> head;
  for (Out& o : outs) {
    if (o.name == "__metadata__") CKPT_FAIL(src, "a parameter named '__metadata__' cannot be exported");
    if (o.param) {
      o.bytes = o.param->numel * 4;
    } else {
      // 16-bit floats are widened to F32 (exactly); every other dtype (F64, integers, BOOL) is kept.
      const SafetensorsEntry& e = rest_st.tensors.at(o.rest->tensor);
      if (e.dtype != "F16" && e.dtype != "BF16") o.dtype = e.dtype;
      o.bytes = (e.end - e.begin) / st_dtype_size(e.dtype) * st_dtype_size(o.dtype);
    }
    head.push_back({o.name, o.dtype, o.param ? o.param->shape : o.rest->shape, nullptr, o.bytes});
  }
  const std::string tmp = target.path + ".tmp-" + std::to_string(::getpid());
  try {
    FileWriter w(tmp, false, target.shown);
    if (target.mode >= 0) w.chmod(mode_t(target.mode));  // a replaced file keeps its permissions
    safetensors_header_write(w, {{"format", "pt"}, {"zero8_tag", m.tag}, {"zero8_step", std::to_string(m.step)},
                                 {"zero8_source", res.complete ? "fp32 masters + model_rest" : "fp32 masters"}},
                             head);
    std::vector<float> buf;
    std::vector<char> raw;
    constexpr int64_t kChunk = int64_t(1) << 20;  // elements per read
    for (const Out& o : outs) {
      if (o.param) {
        const ParamInfo& p = *o.param;
        const int g = group_index(p.group);
        for (int64_t i = 0; i < p.numel; i += kChunk) {
          const int64_t n = std::min(kChunk, p.numel - i);
          buf.resize(size_t(n));
          files.read_range(g, "master", p.offset + i, p.offset + i + n, buf.data());
          w.write(buf.data(), n * 4);
        }
        ++res.trained;
        continue;
      }
      const SafetensorsEntry& e = rest_st.tensors.at(o.rest->tensor);
      const int es = st_dtype_size(e.dtype);
      const bool widen = o.dtype != e.dtype;
      const int64_t numel = (e.end - e.begin) / es;
      for (int64_t i = 0; i < numel; i += kChunk) {
        const int64_t n = std::min(kChunk, numel - i);
        raw.resize(size_t(n * es));
        rest_f->read_at(rest_st.data_start + e.begin + i * es, raw.data(), n * es);
        if (!widen) {
          w.write(raw.data(), n * es);
          continue;
        }
        buf.resize(size_t(n));
        const DType d = e.dtype == "F16" ? DType::f16 : DType::bf16;
        for (int64_t k = 0; k < n; ++k) buf[size_t(k)] = dtype_load(raw.data(), d, k);
        w.write(buf.data(), n * 4);
      }
      ++res.rest;
    }
    w.finish();
    if (::rename(tmp.c_str(), target.path.c_str()) != 0)
      CKPT_FAIL(target.shown, "cannot rename the written file into place: " + errno_text(errno));
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  const fs::path parent = fs::absolute(target.path).parent_path();
  fsync_dir(parent.string());
  res.tensors = int64_t(outs.size());
  return res;
}

}  // namespace zero8::ckpt
