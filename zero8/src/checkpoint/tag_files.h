// The files of one tag, read against its manifest: each opened once and checked before use (size,
// shard header, XXH3 checksum), global element or block ranges gathered from the shards' sections,
// and the model files' tensors held to the manifest's parameters and state_dict.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"
#include "zero8/checkpoint.h"

namespace zero8::ckpt::detail {

class FileSet {
 public:
  // m must outlive the FileSet. verify: check each file's checksum (the whole file) when first opened.
  FileSet(const std::string& tag_dir, const Manifest& m, bool verify) : dir_(tag_dir), m_(m), verify_(verify) {}

  // The manifest's entry of a file; Error(io) naming the manifest when it lists none of that name.
  const FileInfo& info(const std::string& name) const;
  // The file, opened and checked on first use: its size is the manifest's, a shard's header names its
  // rank, world size, format version and the save's nonce, and (verify) its checksum is the manifest's.
  const FileReader& get(const std::string& name);
  int64_t hashed() const { return hashed_; }  // bytes checksummed so far

  // Global range [lo, hi) (elements, or blocks for absmax) of one kind of group g into dst.
  void read_range(int g, const std::string& kind, int64_t lo, int64_t hi, void* dst);
  // Rank-local section (the residual) of the shard of `rank`.
  void read_local(int g, const std::string& kind, int rank, void* dst, int64_t bytes);

 private:
  void header_check(const FileReader& r, const FileInfo& fi);

  std::string dir_;
  const Manifest& m_;
  bool verify_;
  int64_t hashed_ = 0;
  std::map<std::string, std::unique_ptr<FileReader>> open_;
};

// The size and (with verify) checksum of the extra files (SaveOptions::extra_files), which zero8 does not
// read itself: its caller does, on every rank (the engine's model-states file). model_rest: also
// kModelRestName, which no load reads; one rank checking it is enough to fail a load that agrees.
void extras_check(FileSet& files, const Manifest& m, bool model_rest);
// The model file's tensors against the manifest's parameters (name, dtype, shape, count).
void model_check(const Safetensors& st, const Manifest& m, const std::string& path);
// The model_rest file's tensors against the manifest's state_dict: exactly its model_rest tensors.
void model_rest_check(const Safetensors& st, const Manifest& m, const std::string& path);

}  // namespace zero8::ckpt::detail
