// TCP plumbing of the liveness mesh and the tcp backend (see sockets.h). A partitioned link or a dead
// host closes nothing, so no EOF arrives: connections between ranks get TCP keepalive (and, for the
// mesh's small frames, TCP_USER_TIMEOUT) so that the kernel ends a connection whose peer host has not
// answered for ZERO8_COMM_LINK_TIMEOUT seconds. No heartbeat of our own: the kernel answers keepalive
// probes for a process that is stopped (SIGSTOP, a debugger) or busy for hours, so only a dead link
// or host counts, never a slow rank (ZERO8_COMM_TIMEOUT bounds those).
#include "sockets.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

#include "comm_env.h"
#include "zero8/error.h"

namespace zero8::comm::detail {

namespace {

std::string errno_text() { return std::strerror(errno); }

// The address to listen on: ZERO8_COMM_IFADDR, else what the hostname resolves to, else loopback.
uint32_t resolve_listen_address(const std::string& ifaddr, std::string* text) {
  in_addr a{};
  if (!ifaddr.empty()) {
    if (inet_pton(AF_INET, ifaddr.c_str(), &a) != 1)
      ZERO8_THROW(invalid_argument, "invalid argument 'ZERO8_COMM_IFADDR': '" << ifaddr << "' is not an IPv4 address");
  } else {
    a.s_addr = htonl(INADDR_LOOPBACK);
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host_name().c_str(), nullptr, &hints, &res) == 0 && res != nullptr) {
      a = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
      freeaddrinfo(res);
    }
  }
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  *text = buf;
  return a.s_addr;
}

// Keepalive of a connection between ranks (see socket_set_link_options): probes from `idle` s of
// silence on, `count` of them `interval` apart, idle + count * interval = the link timeout.
struct Keepalive {
  int count, interval, idle;
};
Keepalive keepalive_for(int link_timeout_s) {
  const int count = link_timeout_s >= 4 ? 3 : 1;
  const int interval = std::max(1, link_timeout_s / 6);
  return {count, interval, link_timeout_s - count * interval};
}

// The descriptors open in this process (/proc/self/fd, less the one listing it); 0 where there is no /proc.
int64_t open_descriptors() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  int64_t n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return std::max<int64_t>(0, n - 1);
}

std::string limit_text(rlim_t v) { return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v); }

}  // namespace

std::string socket_descriptor_text() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return "RLIMIT_NOFILE unknown";
  return "RLIMIT_NOFILE soft " + limit_text(lim.rlim_cur) + ", hard " + limit_text(lim.rlim_max) + "; " +
         std::to_string(open_descriptors()) + " descriptors open";
}

bool socket_out_of_descriptors(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

std::string socket_reserve_descriptors(int64_t more, const std::string& what) {
  // needed: what this call's world opens now, and a few for the calls around it. wanted: room besides for
  // what a job opens later (NCCL's and CUDA's descriptors, data loaders, checkpoint files).
  constexpr int64_t kFew = 32, kLater = 1024;
  rlimit lim{};
  if (more <= 0 || getrlimit(RLIMIT_NOFILE, &lim) != 0) return "";
  const int64_t open_now = open_descriptors();
  const rlim_t needed = rlim_t(open_now + more + kFew), wanted = needed + rlim_t(kLater);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < wanted) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? wanted : std::min(lim.rlim_max, wanted);
    if (raised.rlim_cur > lim.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= needed) return "";
  std::ostringstream os;
  os << what << " needs " << more << " more file descriptors (" << open_now << " are open), more than this "
     << "process may open: RLIMIT_NOFILE soft " << limit_text(lim.rlim_cur) << ", hard " << limit_text(lim.rlim_max)
     << " (zero8 raises the soft limit as far as the hard one allows); raise the hard limit to at least "
     << needed + rlim_t(kLater) << " where the job starts (ulimit -n, the container's or scheduler's nofile setting)";
  return os.str();
}

double socket_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int socket_listen(const std::string& ifaddr, int backlog, std::string* address, sockaddr_in* bound,
                  std::string* error) {
  std::string ip_text;
  const uint32_t ip = resolve_listen_address(ifaddr, &ip_text);
  const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0) {
    *error = "socket() failed: " + errno_text();
    return -1;
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = ip;
  sa.sin_port = 0;
  if (bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const std::string why = errno_text();
    // The hostname may resolve to an address this host (container) does not have: loopback still
    // serves every single-node job; a multi-node job then reports the address it cannot reach.
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (!ifaddr.empty() || bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      *error = "cannot listen on " + ip_text +
               (ifaddr.empty() ? " (the hostname's address; set ZERO8_COMM_IFADDR to this host's address): "
                               : " (ZERO8_COMM_IFADDR: is it an address of this host?): ") +
               why;
      close(lfd);
      return -1;
    }
    ip_text = "127.0.0.1";
  }
  if (listen(lfd, backlog) != 0) {
    *error = "listen() failed: " + errno_text();
    close(lfd);
    return -1;
  }
  socklen_t len = sizeof(sa);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  *address = ip_text + ":" + std::to_string(ntohs(sa.sin_port));
  *bound = sa;
  return lfd;
}

int socket_connect(const sockaddr_in& to, double deadline) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to));
  if (rc != 0 && errno == EINPROGRESS) {
    if (!socket_poll(fd, POLLOUT, deadline)) {
      close(fd);
      errno = ETIMEDOUT;
      return -1;
    }
    int err = 0;
    socklen_t el = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    rc = err == 0 ? 0 : -1;
    errno = err;
  }
  if (rc != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  fcntl(fd, F_SETFL, fl);
  return fd;
}

void socket_set_link_options(int fd, int link_timeout_s, bool user_timeout, const std::string& who) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // No send timeout here: every send is bounded by its caller's own deadline, so that a peer that
  // stops reading (SIGSTOP) never blocks us for long.
  // A silent peer host is detected within link_timeout_s: probes from idle seconds on, `count` of them
  // `interval` apart, idle + count * interval = link_timeout_s. TCP_USER_TIMEOUT bounds the same time
  // for data sent but not acknowledged, and makes the kernel end a keepalive-probed connection after it
  // too. The peer's kernel acknowledges for it, so a stopped process is never timed out by keepalive
  // (TCP_USER_TIMEOUT would, if it left its receive buffer full for that long: see sockets.h).
  const Keepalive k = keepalive_for(link_timeout_s);
  const unsigned user_timeout_ms = unsigned(link_timeout_s) * 1000u;
  struct Option {
    int level, name;
    const void* value;
    socklen_t size;
    const char* text;
  };
  const Option options[] = {
      {SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one), "SO_KEEPALIVE"},
      {IPPROTO_TCP, TCP_KEEPIDLE, &k.idle, sizeof(k.idle), "TCP_KEEPIDLE"},
      {IPPROTO_TCP, TCP_KEEPINTVL, &k.interval, sizeof(k.interval), "TCP_KEEPINTVL"},
      {IPPROTO_TCP, TCP_KEEPCNT, &k.count, sizeof(k.count), "TCP_KEEPCNT"},
      {IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms), "TCP_USER_TIMEOUT"},
  };
  for (const Option& o : options) {
    if (o.name == TCP_USER_TIMEOUT && !user_timeout) continue;
    if (setsockopt(fd, o.level, o.name, o.value, o.size) != 0)
      ZERO8_THROW(comm, who << ": setsockopt(" << o.text << ") failed: " << errno_text()
                            << " (needed to detect a lost link within ZERO8_COMM_LINK_TIMEOUT=" << link_timeout_s
                            << " s)");
  }
}

bool socket_link_error(int err) {
  return err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN || err == ENETDOWN;
}

// An idle connection is probed after `idle` s and answered within a round trip, so nothing for
// idle + interval/2 means unanswered probes. A connection that ends (EOF or a reset) after such a
// silence ended with the link, not with a process that died on a working one. Two ways this happens
// without recv() getting the kernel's ETIMEDOUT: the kernel reports it once, to the first call on the
// socket, and a frame sent from another thread a moment earlier takes it; or the partition healed after
// the peer's kernel had given up on the connection but before ours did, and it answered our next
// segment with a reset. Either way the silence has lasted at least until a kernel's timeout: the link
// timeout, more than this bound.
bool socket_silent_for_too_long(int fd, int link_timeout_s) {
  tcp_info info{};
  socklen_t size = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &size) != 0) return false;
  const Keepalive k = keepalive_for(link_timeout_s);
  return info.tcpi_last_ack_recv >= unsigned(k.idle) * 1000u + unsigned(k.interval) * 500u;
}

bool socket_unanswered(int fd, int link_timeout_s) {
  tcp_info info{};
  socklen_t size = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &size) != 0) return false;
  return (info.tcpi_unacked > 0 || info.tcpi_probes >= 2) && info.tcpi_last_ack_recv >= unsigned(link_timeout_s) * 1000u;
}

bool socket_poll(int fd, short events, double deadline) {
  for (;;) {
    const double left = deadline - socket_now();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, int(left * 1000) + 1);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

bool socket_read_exact(int fd, void* buf, size_t n, double deadline) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    if (!socket_poll(fd, POLLIN, deadline)) return false;
    const ssize_t k = recv(fd, p, n, 0);
    if (k == 0) return false;
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += k;
    n -= size_t(k);
  }
  return true;
}

ssize_t socket_write_until(int fd, const char* p, size_t n, double deadline) {
  size_t done = 0;
  while (done < n) {
    const ssize_t k = ::send(fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      done += size_t(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!socket_poll(fd, POLLOUT, deadline)) break;
    } else {
      return -1;
    }
  }
  return ssize_t(done);
}

uint64_t socket_random_token() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ uint64_t(rd()) ^ uint64_t(getpid()) ^ uint64_t(socket_now() * 1e9);
}

}  // namespace zero8::comm::detail
