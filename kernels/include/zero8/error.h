// zero8::Error, the one exception type the library throws, and the check macros that build it.
// An error says what failed and, when known, which file, key, rank or tensor; internal errors (and every
// error of a debug build) also name the file:line of the check.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zero8 {

// Small error vocabulary, as NCCL has: callers branch on the code, people read the message.
enum class ErrorCode {
  invalid_argument,  // a bad value passed to an API entry point
  unsupported,       // a valid request this build or machine cannot do (no CUDA, no AVX-512, ...)
  io,                // file system or format error
  comm,              // a collective failed: a peer died, a timeout passed, a transport error
  internal,          // a broken invariant: a bug in zero8
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
// The messages are what users read (Python shows them as they are): a zero8 source path there says
// nothing to them, so release builds keep it for internal errors, the bugs whose reports need it.
[[noreturn]] inline void throw_error(ErrorCode code, const char* file, int line, const std::string& msg) {
#ifdef NDEBUG
  if (code != ErrorCode::internal) throw Error(code, msg);
#endif
  std::ostringstream os;
  os << msg << " [" << file << ":" << line << "]";
  throw Error(code, os.str());
}
}  // namespace detail

}  // namespace zero8

// ZERO8_THROW(code, "text " << value): build the message with stream syntax and throw.
#define ZERO8_THROW(code, msg_stream)                                                    \
  do {                                                                                   \
    std::ostringstream zero8_os_;                                                        \
    zero8_os_ << msg_stream;                                                             \
    ::zero8::detail::throw_error(::zero8::ErrorCode::code, __FILE__, __LINE__, zero8_os_.str()); \
  } while (0)

// ZERO8_CHECK_ARG(cond, "name", "explanation"): argument validation at an API entry.
#define ZERO8_CHECK_ARG(cond, name, msg_stream)                                          \
  do {                                                                                   \
    if (!(cond)) ZERO8_THROW(invalid_argument, "invalid argument '" << name << "': " << msg_stream); \
  } while (0)

// ZERO8_ASSERT(cond): an internal invariant; failing it is a bug.
#define ZERO8_ASSERT(cond)                                                               \
  do {                                                                                   \
    if (!(cond)) ZERO8_THROW(internal, "internal check failed: " #cond);                  \
  } while (0)
