// Checked file I/O of checkpoints: a writer and a reader that hash what passes through them (XXH3-64),
// whole-file text reads, renames and directory syncs, and the hooks that let tests kill a rank at any
// point of a save (ZERO8_CKPT_*, declared in checkpoint.h). Every failure names the file.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "zero8/error.h"

namespace zero8::ckpt::detail {

// "<path>: <what>", thrown as Error(io) from the line that found the problem.
#define CKPT_FAIL(path, what) ZERO8_THROW(io, (path) << ": " << (what))

std::string errno_text(int e);
// Error text without the " [file:line]" suffix ZERO8_THROW appends to internal errors and in debug builds
// (for verify's problem list).
std::string strip_where(const std::string& s);
// 16 lowercase hex digits, as the manifest writes checksums and nonces; parse: false unless exactly that.
std::string hex64(uint64_t v);
bool hex64_parse(const std::string& s, uint64_t* v);
std::string join(const std::string& a, const std::string& b);  // a/b

// XXH3 64-bit, seed 0: the checksum of every file, map and manifest.
uint64_t xxh3_64(const void* data, size_t n);

// XXH3-64 of a stream of bytes.
class Hash {
 public:
  Hash();
  ~Hash();
  Hash(const Hash&) = delete;
  Hash& operator=(const Hash&) = delete;
  void update(const void* p, size_t n);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Sequential writer that hashes what it writes; finish() syncs the data to disk. exclusive: the file must
// not exist yet (else it is truncated). Errors name `shown` (default: the path written): export_fp32 names
// the user's output path rather than its temporary file.
class FileWriter {
 public:
  FileWriter(const std::string& path, bool exclusive, const std::string& shown = "");
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, int64_t n);
  void pad_to(int64_t align);  // zero bytes up to the next multiple of align (at most kSectionAlign)
  int64_t offset() const { return off_; }
  uint64_t digest() const { return hash_.digest(); }
  void chmod(mode_t mode);
  void finish();

 private:
  std::string path_;
  int fd_ = -1;
  int64_t off_ = 0;
  Hash hash_;
};

// A regular file read at offsets; a short read is an error naming the file ("truncated").
class FileReader {
 public:
  explicit FileReader(const std::string& path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  void read_at(int64_t off, void* dst, int64_t n) const;
  uint64_t hash_all() const;  // XXH3-64 of the whole file

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

std::string file_read_text(const std::string& path, int64_t limit = int64_t(1) << 30);
void fsync_dir(const std::string& dir);
void rename_or_fail(const std::string& from, const std::string& to);
bool exists(const std::string& p);  // false when absent; Error(io) when it cannot be looked at
void remove_tree(const std::string& p);

// ---- environment (declared in checkpoint.h) and the crash hooks ----

struct Env {
  std::string crash_point;
  int crash_rank = -1;
  bool rename_exchange = true;
  double io_timeout = 3600.0;
};
Env env_read();
// SIGKILLs this process when the environment names this point and rank (tests of crash safety).
void crash_at(const Env& e, const char* point, int rank);

}  // namespace zero8::ckpt::detail
