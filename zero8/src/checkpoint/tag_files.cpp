// The files of one tag read against its manifest (tag_files.h), and manifest_read_extras_checked: the
// extra files' sizes and checksums for a caller that reads only those (the engine's module-only load).
#include "checkpoint/tag_files.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace zero8::ckpt::detail {

using shard::Group;

const FileInfo& FileSet::info(const std::string& name) const {
  for (const FileInfo& f : m_.files)
    if (f.name == name) return f;
  CKPT_FAIL(join(dir_, kManifestName), "no file '" + name + "' listed");
}

const FileReader& FileSet::get(const std::string& name) {
  auto it = open_.find(name);
  if (it != open_.end()) return *it->second;
  const FileInfo& fi = info(name);
  auto r = std::make_unique<FileReader>(join(dir_, name));
  if (r->size() < fi.bytes)
    CKPT_FAIL(r->path(), "truncated: " + std::to_string(r->size()) + " bytes, the manifest says " + std::to_string(fi.bytes));
  if (r->size() > fi.bytes)
    CKPT_FAIL(r->path(), std::to_string(r->size()) + " bytes, the manifest says " + std::to_string(fi.bytes));
  if (fi.role == "shard") header_check(*r, fi);
  if (verify_) {
    const uint64_t h = r->hash_all();
    hashed_ += r->size();
    if (h != fi.xxh3)
      CKPT_FAIL(r->path(), "checksum mismatch: xxh3 " + hex64(h) + ", the manifest says " + hex64(fi.xxh3) +
                             " (the file is corrupt)");
  }
  return *open_.emplace(name, std::move(r)).first->second;
}

void FileSet::read_range(int g, const std::string& kind, int64_t lo, int64_t hi, void* dst) {
  if (hi <= lo) return;
  const std::string gname = shard::group_name(Group(g));
  const int es = section_esize(kind);
  int64_t covered = 0;
  for (const FileInfo& f : m_.files)
    for (const SectionInfo& s : f.sections) {
      if (s.group != gname || s.kind != kind) continue;
      const int64_t a = std::max(lo, s.begin), b = std::min(hi, s.end);
      if (a >= b) continue;
      get(f.name).read_at(s.offset + (a - s.begin) * es, static_cast<char*>(dst) + (a - lo) * es, (b - a) * es);
      covered += b - a;
    }
  if (covered != hi - lo)
    CKPT_FAIL(join(dir_, kManifestName), gname + " " + kind + ": [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                           ") is not covered by the shards");
}

void FileSet::read_local(int g, const std::string& kind, int rank, void* dst, int64_t bytes) {
  const FileInfo& f = info(shard_file_name(rank));
  for (const SectionInfo& s : f.sections)
    if (s.group == shard::group_name(Group(g)) && s.kind == kind) {
      if (s.bytes != bytes) CKPT_FAIL(join(dir_, f.name), kind + " of " + s.group + " has " + std::to_string(s.bytes) + " bytes");
      get(f.name).read_at(s.offset, dst, bytes);
      return;
    }
  CKPT_FAIL(join(dir_, f.name), "no " + kind + " section for the " + std::string(shard::group_name(Group(g))) + " group");
}

void FileSet::header_check(const FileReader& r, const FileInfo& fi) {
  ShardHeader h;
  if (r.size() < int64_t(sizeof(h))) CKPT_FAIL(r.path(), "truncated: shorter than the 64-byte header");
  r.read_at(0, &h, sizeof(h));
  if (std::memcmp(h.magic, kShardMagic, sizeof(h.magic)) != 0) CKPT_FAIL(r.path(), "not a zero8 shard file (bad magic)");
  if (h.version != uint32_t(kFormatVersion))
    CKPT_FAIL(r.path(), "unknown shard format version " + std::to_string(h.version) + " (this zero8 reads version " +
                          std::to_string(kFormatVersion) + ")");
  if (h.rank != fi.rank || h.world != m_.world)
    CKPT_FAIL(r.path(), "header says rank " + std::to_string(h.rank) + " of " + std::to_string(h.world) +
                          ", the manifest rank " + std::to_string(fi.rank) + " of " + std::to_string(m_.world));
  if (h.nonce != m_.nonce)
    CKPT_FAIL(r.path(), "belongs to another save (nonce " + hex64(h.nonce) + ", the manifest's " + hex64(m_.nonce) + ")");
}

void extras_check(FileSet& files, const Manifest& m, bool model_rest) {
  for (const FileInfo& fi : m.files)
    if (fi.role == "extra" && (model_rest || fi.name != kModelRestName)) files.get(fi.name);
}

void model_check(const Safetensors& st, const Manifest& m, const std::string& path) {
  for (const ParamInfo& p : m.params) {
    auto it = st.tensors.find(p.name);
    if (it == st.tensors.end()) CKPT_FAIL(path, "parameter '" + p.name + "' is missing");
    if (it->second.dtype != safetensors_dtype(m.working_dtype))
      CKPT_FAIL(path, "parameter '" + p.name + "' is " + it->second.dtype + ", the manifest says " +
                        safetensors_dtype(m.working_dtype));
    if (it->second.shape != p.shape)
      CKPT_FAIL(path, "parameter '" + p.name + "' has shape " + shape_text(it->second.shape) + ", the manifest says " +
                        shape_text(p.shape));
  }
  if (st.tensors.size() != m.params.size())
    CKPT_FAIL(path, std::to_string(st.tensors.size()) + " tensors, the manifest lists " + std::to_string(m.params.size()) +
                      " parameters");
}

void model_rest_check(const Safetensors& st, const Manifest& m, const std::string& path) {
  std::set<std::string> want;
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source != "model_rest" || !want.insert(e.tensor).second) continue;
    auto it = st.tensors.find(e.tensor);
    if (it == st.tensors.end()) CKPT_FAIL(path, "tensor '" + e.tensor + "' (state_dict key '" + e.name + "') is missing");
    if (it->second.dtype != e.dtype || it->second.shape != e.shape)
      CKPT_FAIL(path, "tensor '" + e.tensor + "' is " + it->second.dtype + " " + shape_text(it->second.shape) +
                        ", the manifest says " + e.dtype + " " + shape_text(e.shape));
  }
  if (st.tensors.size() != want.size())
    CKPT_FAIL(path, std::to_string(st.tensors.size()) + " tensors, the manifest's state_dict names " +
                      std::to_string(want.size()));
}

}  // namespace zero8::ckpt::detail

namespace zero8::ckpt {

using namespace detail;

Manifest manifest_read_extras_checked(const std::string& tag_dir, bool model_rest) {
  Manifest m = manifest_read(tag_dir);
  FileSet files(tag_dir, m, true);
  extras_check(files, m, model_rest);
  return m;
}

}  // namespace zero8::ckpt
