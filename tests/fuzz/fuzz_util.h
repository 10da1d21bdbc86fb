// What the fuzz targets share: the one outcome a parser may have besides success (a zero8::Error that
// is not ErrorCode::internal, i.e. a message naming the bad input), and a scratch directory for the
// parsers that read files. Anything else (another exception, an internal error, a sanitizer report)
// stops the run as a finding.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <fcntl.h>
#include <unistd.h>

#include "zero8/error.h"

namespace zero8::fuzz {

// Runs f; returns true when it returned, false when it threw a zero8::Error about the input. An
// internal error is a broken invariant, so it aborts like a crash and is kept as one.
template <class F>
bool accepts(F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::internal) {
      std::fprintf(stderr, "fuzz: internal error: %s\n", e.what());
      std::abort();
    }
    return false;
  }
}

// A property of an accepted input that does not hold: print and abort (libFuzzer keeps the input).
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::abort();
}

// A directory of this process under $TMPDIR (or /tmp), made on first use. Its files are overwritten
// for each input; it is left behind, as small as one input, when the run ends.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/zero8-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) {
      std::perror("fuzz: mkdtemp");
      std::abort();
    }
    return tmpl;
  }();
  return dir;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    std::perror(("fuzz: open " + path).c_str());
    std::abort();
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t w = ::write(fd, data + done, size - done);
    if (w <= 0) {
      std::perror(("fuzz: write " + path).c_str());
      std::abort();
    }
    done += size_t(w);
  }
  ::close(fd);
}

}  // namespace zero8::fuzz
