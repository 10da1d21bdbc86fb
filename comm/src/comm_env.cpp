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
// 30 minutes, DeepSpeed's default process-group timeout (deepspeed/constants.py, default_pg_timeout): a
// rank may spend minutes alone (rank 0's evaluation or checkpoint conversion) while the others wait. A
// rank that dies or leaves is detected at once whatever the timeout (its connection closes).
constexpr double kDefaultTimeoutSeconds = 1800.0;
}

double env_comm_timeout() {
  const char* s = std::getenv("ZERO8_COMM_TIMEOUT");
  if (s == nullptr || *s == '\0') return kDefaultTimeoutSeconds;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0' || !(v > 0.0) || !std::isfinite(v))
    ZERO8_THROW(invalid_argument, "environment variable ZERO8_COMM_TIMEOUT='" << s
                                      << "' is not a positive number of seconds");
  return v;
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
