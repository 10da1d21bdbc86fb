// The environment variables of the communication layer, parsed here and nowhere else, so the list
// in communicator.h stays true. Bad values are errors (a typo must not silently mean "default").
#include "comm_env.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "zero8/error.h"

namespace zero8::comm::detail {

namespace {
// 10 minutes, torch's default for NCCL process groups (torch.distributed's default_pg_nccl_timeout), not
// DeepSpeed's 30: this timeout only ever ends a job whose ranks are all alive, as every other failure is
// seen sooner (a death or an exit at once, a lost host after ZERO8_COMM_LINK_TIMEOUT, mismatched
// collectives after 2 s), so it bounds how long a hung rank (a deadlock, a stuck file system, a stopped
// process) holds the whole job. A rank that legitimately works alone for longer (rank 0 converting a large
// checkpoint while the others wait) needs zero8.comm_timeout_s or ZERO8_COMM_TIMEOUT raised.
constexpr double kDefaultTimeoutSeconds = 600.0;
// How long a liveness connection may go without any TCP answer from its peer's host before the peer
// counts as lost (a network partition or a host that went down; see liveness.cpp). A paused or busy
// process does not count: its kernel answers for it. A minute rides out a switch's or NIC's brief
// outage yet ends a partitioned job long before ZERO8_COMM_TIMEOUT.
constexpr int kDefaultLinkTimeoutSeconds = 60;
// TCP keepalive takes whole seconds, at most 32767 for the idle time (the kernel's MAX_TCP_KEEPIDLE).
constexpr int kMinLinkTimeoutSeconds = 2, kMaxLinkTimeoutSeconds = 32767;
}

double env_comm_timeout() {
  const char* s = std::getenv("ZERO8_COMM_TIMEOUT");
  if (s == nullptr || *s == '\0') return kDefaultTimeoutSeconds;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s, &end);
  // (0, 1e9], as Communicator::set_timeout takes (1e9 s is 31 years: "never" in practice).
  if (errno != 0 || end == s || *end != '\0' || !(v > 0.0) || !(v <= 1e9))
    ZERO8_THROW(invalid_argument, "environment variable ZERO8_COMM_TIMEOUT='" << s
                                      << "' is not a number of seconds in (0, 1e9]");
  return v;
}

int env_comm_link_timeout() {
  const char* s = std::getenv("ZERO8_COMM_LINK_TIMEOUT");
  if (s == nullptr || *s == '\0') return kDefaultLinkTimeoutSeconds;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < kMinLinkTimeoutSeconds || v > kMaxLinkTimeoutSeconds)
    ZERO8_THROW(invalid_argument, "environment variable ZERO8_COMM_LINK_TIMEOUT='"
                                      << s << "' is not a whole number of seconds from " << kMinLinkTimeoutSeconds
                                      << " to " << kMaxLinkTimeoutSeconds);
  return int(v);
}

std::string env_comm_ifaddr() {
  const char* s = std::getenv("ZERO8_COMM_IFADDR");
  return s == nullptr ? std::string() : std::string(s);
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string env_comm_node() {
  const char* s = std::getenv("ZERO8_COMM_NODE");
  if (s != nullptr && *s != '\0') return s;
  return host_name();
}

}  // namespace zero8::comm::detail
