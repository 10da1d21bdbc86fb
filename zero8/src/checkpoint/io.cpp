// Checked file I/O of checkpoints (io.h): the hashing writer and reader over POSIX calls, renames and
// directory syncs, and the ZERO8_CKPT_* environment with its crash hooks. The one user of xxHash.
#include "checkpoint/io.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <vector>

#include "zero8/checkpoint.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace zero8::ckpt::detail {

namespace fs = std::filesystem;

std::string errno_text(int e) { return std::strerror(e); }

std::string strip_where(const std::string& s) {
  // Only a " [<file>:<line>]" suffix (internal errors, debug builds), never a message's own "[8]".
  const size_t p = s.rfind(" [");
  if (p == std::string::npos || s.back() != ']') return s;
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon < p + 3 || colon + 2 >= s.size()) return s;
  for (size_t i = colon + 1; i + 1 < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return s;
  return s.substr(0, p);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool hex64_parse(const std::string& s, uint64_t* v) {
  if (s.size() != 16) return false;
  uint64_t x = 0;
  for (char ch : s) {
    int d;
    if (ch >= '0' && ch <= '9') d = ch - '0';
    else if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
    else return false;
    x = x << 4 | uint64_t(d);
  }
  *v = x;
  return true;
}

std::string join(const std::string& a, const std::string& b) { return (fs::path(a) / b).string(); }

uint64_t xxh3_64(const void* data, size_t n) { return XXH3_64bits(data, n); }

struct Hash::State {
  XXH3_state_t* s;
};

Hash::Hash() : s_(new State{XXH3_createState()}) {
  if (!s_->s) throw std::bad_alloc();
  XXH3_64bits_reset(s_->s);
}
Hash::~Hash() { XXH3_freeState(s_->s); }
void Hash::update(const void* p, size_t n) { XXH3_64bits_update(s_->s, p, n); }
uint64_t Hash::digest() const { return XXH3_64bits_digest(s_->s); }

// ---- FileWriter ----

FileWriter::FileWriter(const std::string& path, bool exclusive, const std::string& shown)
    : path_(shown.empty() ? path : shown) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (exclusive ? O_EXCL : O_TRUNC), 0644);
  if (fd_ < 0) CKPT_FAIL(path_, "cannot create: " + errno_text(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, int64_t n) {
  const char* p = static_cast<const char*>(data);
  hash_.update(p, size_t(n));
  while (n > 0) {
    const ssize_t k = ::write(fd_, p, size_t(std::min<int64_t>(n, int64_t(1) << 30)));
    if (k < 0) {
      if (errno == EINTR) continue;
      CKPT_FAIL(path_, "write failed: " + errno_text(errno));
    }
    p += k;
    n -= k;
    off_ += k;
  }
}

void FileWriter::pad_to(int64_t align) {
  static const char zeros[kSectionAlign] = {};
  const int64_t pad = (align - off_ % align) % align;
  write(zeros, pad);
}

void FileWriter::chmod(mode_t mode) {
  if (::fchmod(fd_, mode) != 0) CKPT_FAIL(path_, "cannot set the permissions: " + errno_text(errno));
}

void FileWriter::finish() {
  if (::fsync(fd_) != 0) CKPT_FAIL(path_, "fsync failed: " + errno_text(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) CKPT_FAIL(path_, "close failed: " + errno_text(errno));
}

// ---- FileReader ----

FileReader::FileReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) CKPT_FAIL(path, errno == ENOENT ? std::string("missing") : "cannot open: " + errno_text(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0) CKPT_FAIL(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) CKPT_FAIL(path, "not a regular file");
  size_ = int64_t(st.st_size);
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(int64_t off, void* dst, int64_t n) const {
  char* p = static_cast<char*>(dst);
  const int64_t want = n, at = off;
  while (n > 0) {
    const ssize_t k = ::pread(fd_, p, size_t(std::min<int64_t>(n, int64_t(1) << 30)), off_t(off));
    if (k < 0) {
      if (errno == EINTR) continue;
      CKPT_FAIL(path_, "read failed: " + errno_text(errno));
    }
    if (k == 0)
      CKPT_FAIL(path_, "truncated: " + std::to_string(want) + " bytes wanted at offset " + std::to_string(at) +
                           ", the file has " + std::to_string(size_));
    p += k;
    n -= k;
    off += k;
  }
}

uint64_t FileReader::hash_all() const {
  Hash h;
  std::vector<char> buf(size_t(std::min<int64_t>(std::max<int64_t>(size_, 1), int64_t(8) << 20)));
  for (int64_t off = 0; off < size_;) {
    const int64_t n = std::min<int64_t>(int64_t(buf.size()), size_ - off);
    read_at(off, buf.data(), n);
    h.update(buf.data(), size_t(n));
    off += n;
  }
  return h.digest();
}

// ---- whole files and directories ----

std::string file_read_text(const std::string& path, int64_t limit) {
  FileReader f(path);
  if (f.size() > limit) CKPT_FAIL(path, "too large (" + std::to_string(f.size()) + " bytes)");
  std::string s(size_t(f.size()), '\0');
  f.read_at(0, s.data(), f.size());
  return s;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) CKPT_FAIL(dir, "cannot open the directory to sync it: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL) CKPT_FAIL(dir, "fsync of the directory failed: " + errno_text(e));
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) CKPT_FAIL(from, "cannot rename to " + to + ": " + errno_text(errno));
}

bool exists(const std::string& p) {
  // Only "no such file" is false: a path that cannot be looked at (a directory without search permission
  // on the way, an I/O error) would otherwise read as missing, and a readable tag as an incomplete one.
  std::error_code ec;
  const bool found = fs::exists(p, ec);
  if (ec) CKPT_FAIL(p, "cannot access: " + ec.message());
  return found;
}

void remove_tree(const std::string& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) CKPT_FAIL(p, "cannot remove: " + ec.message());
}

// ---- environment ----

Env env_read() {
  Env e;
  if (const char* v = std::getenv("ZERO8_CKPT_CRASH_AT"); v && *v) {
    const std::string s(v);
    const size_t colon = s.rfind(':');
    ZERO8_CHECK_ARG(colon != std::string::npos && colon + 1 < s.size(), "ZERO8_CKPT_CRASH_AT",
                    "expected <point>:<rank>, got '" << s << "'");
    e.crash_point = s.substr(0, colon);
    bool known = false;
    for (const char* p : kCrashPoints) known = known || e.crash_point == p;
    ZERO8_CHECK_ARG(known, "ZERO8_CKPT_CRASH_AT", "unknown point '" << e.crash_point << "'");
    try {
      e.crash_rank = std::stoi(s.substr(colon + 1));
    } catch (const std::exception&) {
      ZERO8_CHECK_ARG(false, "ZERO8_CKPT_CRASH_AT", "bad rank in '" << s << "'");
    }
  }
  if (const char* v = std::getenv("ZERO8_CKPT_RENAME_EXCHANGE"); v && *v) e.rename_exchange = std::string(v) != "0";
  if (const char* v = std::getenv("ZERO8_CKPT_TIMEOUT"); v && *v) {
    char* end = nullptr;
    e.io_timeout = std::strtod(v, &end);
    ZERO8_CHECK_ARG(end && *end == '\0' && e.io_timeout > 0.0 && e.io_timeout <= 1e9, "ZERO8_CKPT_TIMEOUT",
                    "expected seconds in (0, 1e9], got '" << v << "'");
  }
  return e;
}

void crash_at(const Env& e, const char* point, int rank) {
  if (e.crash_rank == rank && e.crash_point == point) raise(SIGKILL);
}

}  // namespace zero8::ckpt::detail
