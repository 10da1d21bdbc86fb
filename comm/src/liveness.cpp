// Liveness mesh (see liveness.h). Wire protocol on each pair's TCP connection, all little-endian
// framed messages {u32 type, u32 length, payload}: HELLO once from the connecting (higher) rank,
// then BYE (clean exit), GIVEUP (reason text), QUERY (id) and STATE (answer to a query: id, in_op,
// comm_id, seq, op and call as u16-length strings, u8 count of recent calls each {comm_id, seq, op,
// call}, then the text).
//
// A partitioned link or a dead host closes nothing, so no EOF arrives: every mesh socket has TCP
// keepalive and TCP_USER_TIMEOUT set (socket_set_link_options, sockets.cpp) so that the kernel ends a
// connection whose peer host has not answered for ZERO8_COMM_LINK_TIMEOUT seconds; the watcher's
// recv() then fails with ETIMEDOUT (or EHOSTUNREACH...; or sees an EOF after a silence no working link
// has, see run()) and the peer is reported lost, which fails every waiting collective at once, on both
// sides of the partition. No heartbeat of our own: the kernel answers keepalive probes for a process
// that is stopped (SIGSTOP, a debugger) or busy for hours, so only a dead link or host counts, never a
// slow rank (ZERO8_COMM_TIMEOUT bounds those).
#include "liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iomanip>
#include <sstream>

#include "comm_env.h"
#include "sockets.h"
#include "zero8/error.h"

namespace zero8::comm::detail {

namespace {

constexpr uint32_t kMagic = 0x7a38636du;  // "zc8m"
constexpr uint32_t kHello = 1, kBye = 2, kGiveUp = 3, kQuery = 4, kState = 5;
constexpr uint32_t kMaxFrame = 1u << 20;
// The longest a frame's send may block (a peer that stopped reading: see FrameSender).
constexpr double kSendSeconds = 2.0;

double now_s() { return socket_now(); }

std::string errno_text() { return std::strerror(errno); }

// Exchanged with the backend's all-gather at setup.
struct AddressRecord {
  uint32_t magic;
  uint32_t ipv4;   // network byte order
  uint16_t port;   // network byte order; 0: this rank cannot join (see bad_env)
  uint16_t bad_env;  // 1: port 0 because of an invalid ZERO8_COMM_LINK_TIMEOUT here
  int32_t rank;
  uint64_t token;  // rank 0's value is the job's: a stray connection cannot join the mesh
  char host[64];   // host name, NUL-terminated (truncated), for messages
};
static_assert(sizeof(AddressRecord) == 88, "AddressRecord is exchanged between processes");

struct HelloFrame {
  uint32_t type, len;
  uint64_t token;
  int32_t rank;
  uint32_t pad;
};
static_assert(sizeof(HelloFrame) == 24, "HelloFrame crosses the wire");

template <class T> void put(std::string& s, const T& v) { s.append(reinterpret_cast<const char*>(&v), sizeof(T)); }
template <class T> T get(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
// A u16 length, then the bytes.
void put_string(std::string& s, const std::string& v) {
  const std::string t = v.substr(0, 0xffff);
  put(s, uint16_t(t.size()));
  s += t;
}
bool get_string(const char* p, uint32_t len, uint32_t* off, std::string* v) {
  if (len - *off < 2) return false;
  const uint16_t n = get<uint16_t>(p + *off);
  if (len - *off - 2 < n) return false;
  v->assign(p + *off + 2, n);
  *off += 2 + n;
  return true;
}

std::string seconds_text(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << s << " s";
  return os.str();
}

// The process's meshes (one per MPI world and one per tcp world), for the fork handler: lock-free, as a
// fork()ed child may not take a lock that another thread of the parent held at fork().
constexpr int kMaxMeshes = 256;
std::atomic<Liveness*> g_meshes[kMaxMeshes];
void atfork_child() {
  for (std::atomic<Liveness*>& slot : g_meshes)
    if (Liveness* l = slot.load()) l->forget_after_fork();
}

}  // namespace

bool FrameSender::send(int fd, const std::string& frame, double timeout_s) {
  const double deadline = now_s() + timeout_s;
  if (!unsent_.empty()) {
    const ssize_t k = socket_write_until(fd, unsent_.data(), unsent_.size(), deadline);
    if (k < 0) {
      unsent_.clear();  // the connection is gone: the watcher sees it end
      return false;
    }
    unsent_.erase(0, size_t(k));
    if (!unsent_.empty()) return false;  // still stuck: drop this frame whole
  }
  const ssize_t k = socket_write_until(fd, frame.data(), frame.size(), deadline);
  if (k < 0) return false;
  unsent_.assign(frame, size_t(k), std::string::npos);
  return true;
}

Liveness::Liveness(int rank, int size, const std::string& ifaddr, double timeout_s, const AllGather& all_gather)
    : rank_(rank), size_(size), peers_(size_t(size)), owner_pid_(int(getpid())) {
  if (pipe2(wake_, O_CLOEXEC) != 0) ZERO8_THROW(comm, "liveness: pipe() failed: " << errno_text());
  try {
    setup(ifaddr, timeout_s, all_gather);
    // Registered before the thread starts, so that a failure leaves nothing running.
    for (int i = 0; i < kMaxMeshes && slot_ < 0; ++i) {
      Liveness* none = nullptr;
      if (g_meshes[i].compare_exchange_strong(none, this)) slot_ = i;
    }
    if (slot_ < 0)
      ZERO8_THROW(unsupported, "liveness: more than " << kMaxMeshes << " communicator worlds alive in one process");
  } catch (...) {
    for (Peer& p : peers_)
      if (p.fd >= 0) close(p.fd);
    close(wake_[0]);
    close(wake_[1]);
    throw;
  }
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &atfork_child); });
  thread_ = std::make_unique<std::thread>([this] { run(); });
}

void Liveness::setup(const std::string& ifaddr, double timeout_s, const AllGather& all_gather) {
  // A bad value fails this rank after the address exchange (below), so its peers fail at once too.
  std::exception_ptr env_error;
  try {
    link_timeout_s_ = env_comm_link_timeout();
  } catch (...) {
    env_error = std::current_exception();
  }
  // A rank that cannot listen still joins the address exchange (with port 0), so every rank
  // fails at once with the reason instead of waiting for its connection until the timeout.
  std::string listen_error;
  sockaddr_in sa{};
  // A listening socket and a connection per peer.
  listen_error = socket_reserve_descriptors(int64_t(size_), "the liveness mesh of " + std::to_string(size_) + " ranks");
  const int lfd = listen_error.empty() ? socket_listen(ifaddr, size_ + 16, &address_, &sa, &listen_error) : -1;
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
  } closer{lfd};

  AddressRecord mine{};
  mine.magic = kMagic;
  mine.ipv4 = sa.sin_addr.s_addr;
  // Port 0: this rank cannot join, and its peers fail at once too (bad_env says why).
  mine.port = listen_error.empty() && !env_error ? sa.sin_port : 0;
  mine.bad_env = env_error ? 1 : 0;
  mine.rank = rank_;
  std::snprintf(mine.host, sizeof(mine.host), "%s", host_name().c_str());
  mine.token = socket_random_token();
  std::vector<AddressRecord> all(static_cast<size_t>(size_));
  all_gather(&mine, all.data(), sizeof(AddressRecord));
  if (env_error) std::rethrow_exception(env_error);
  if (!listen_error.empty()) ZERO8_THROW(comm, "liveness (rank " << rank_ << "): " << listen_error);
  const uint64_t token = all[0].token;
  for (int r = 0; r < size_; ++r) {
    if (all[size_t(r)].magic != kMagic || all[size_t(r)].rank != r)
      ZERO8_THROW(comm, "liveness: bad address record from rank " << r);
    if (all[size_t(r)].port == 0 && all[size_t(r)].bad_env)
      ZERO8_THROW(comm, "liveness: rank " << r << " has an invalid ZERO8_COMM_LINK_TIMEOUT (its own error names "
                                                  "the value; every rank needs the same valid setting)");
    if (all[size_t(r)].port == 0)
      ZERO8_THROW(comm, "liveness: rank " << r << " could not open its liveness socket (its own error says why)");
    all[size_t(r)].host[sizeof(all[size_t(r)].host) - 1] = '\0';
    peers_[size_t(r)].host = all[size_t(r)].host;
  }

  const double deadline = now_s() + timeout_s;
  // Connect to every lower rank: completes against its listen backlog even before it accepts,
  // so the order cannot deadlock.
  for (int r = 0; r < rank_; ++r) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = all[size_t(r)].ipv4;
    to.sin_port = all[size_t(r)].port;
    const int fd = socket_connect(to, deadline);
    if (fd < 0 && errno == ETIMEDOUT)
      ZERO8_THROW(comm, "liveness: connecting to rank " << r << " timed out after " << timeout_s << " s");
    if (fd < 0 && socket_out_of_descriptors(errno))
      ZERO8_THROW(comm, "liveness: cannot open a connection to rank " << r << ": " << errno_text() << " ("
                                                                      << socket_descriptor_text() << ")");
    if (fd < 0) {
      char b[INET_ADDRSTRLEN] = {0};
      inet_ntop(AF_INET, &to.sin_addr, b, sizeof(b));
      ZERO8_THROW(comm, "liveness: cannot connect to rank " << r << " at " << b << ":" << ntohs(to.sin_port) << ": "
                                                            << errno_text() << " (set ZERO8_COMM_IFADDR?)");
    }
    peers_[size_t(r)].fd = fd;
    socket_set_link_options(fd, link_timeout_s_, true, "liveness");
    HelloFrame h{kHello, 16, token, rank_, 0};
    const ssize_t sent = socket_write_until(fd, reinterpret_cast<const char*>(&h), sizeof(h), now_s() + kSendSeconds);
    if (sent != ssize_t(sizeof(h)))
      ZERO8_THROW(comm, "liveness: hello to rank " << r << " failed: "
                                                   << (sent < 0 ? errno_text() : "not sent within " + seconds_text(kSendSeconds)));
  }
  // Accept every higher rank.
  int expected = size_ - 1 - rank_;
  while (expected > 0) {
    if (!socket_poll(lfd, POLLIN, deadline)) {
      std::ostringstream missing;
      for (int r = rank_ + 1; r < size_; ++r)
        if (peers_[size_t(r)].fd < 0) missing << " " << r;
      ZERO8_THROW(comm, "liveness: ranks" << missing.str() << " did not connect to rank " << rank_ << " at " << address_
                                          << " within " << timeout_s << " s");
    }
    const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && socket_out_of_descriptors(errno))  // the connection stays queued: fail, not spin
      ZERO8_THROW(comm, "liveness (rank " << rank_ << "): cannot accept the connections of higher ranks: "
                                          << errno_text() << " (" << socket_descriptor_text() << ")");
    if (fd < 0) continue;
    HelloFrame h{};
    if (!socket_read_exact(fd, &h, sizeof(h), deadline) || h.type != kHello || h.len != 16 || h.token != token ||
        h.rank <= rank_ || h.rank >= size_ || peers_[size_t(h.rank)].fd >= 0) {
      close(fd);  // not one of ours (or a duplicate): ignore it
      continue;
    }
    peers_[size_t(h.rank)].fd = fd;
    socket_set_link_options(fd, link_timeout_s_, true, "liveness");
    --expected;
  }
}

Liveness::~Liveness() {
  if (forked_) return;
  Liveness* self = this;
  g_meshes[slot_].compare_exchange_strong(self, nullptr);
  if (!gave_up_)
    for (int r = 0; r < size_; ++r)
      if (r != rank_) send_frame(r, kBye, std::string());
  stopping_.store(true);
  const char c = 1;
  (void)!write(wake_[1], &c, 1);
  if (thread_ && thread_->joinable()) thread_->join();
  for (Peer& p : peers_)
    if (p.fd >= 0) close(p.fd);
  close(wake_[0]);
  close(wake_[1]);
}

void Liveness::send_frame(int peer, uint32_t type, const std::string& payload) {
  Peer& p = peers_[size_t(peer)];
  if (p.fd < 0) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (p.closed) return;
  }
  std::string frame;
  put(frame, type);
  put(frame, uint32_t(payload.size()));
  frame += payload;
  std::lock_guard<std::mutex> lk(p.send_mu);
  // A dead peer: its EOF reaches the watcher (which tells a lost link from a death: see run()).
  // A stopped one: the frame (or the tail of an earlier one) waits in p.sender (see FrameSender).
  (void)p.sender.send(p.fd, frame, kSendSeconds);
}

void Liveness::run() {
  pthread_setname_np(pthread_self(), "zero8-liveness");  // for top -H, gdb, and the partition tests
  std::vector<pollfd> fds(size_t(size_) + 1);
  fds[0] = {wake_[0], POLLIN, 0};
  for (int r = 0; r < size_; ++r) fds[size_t(r) + 1] = {r == rank_ ? -1 : peers_[size_t(r)].fd, POLLIN, 0};
  std::vector<char> buf(1 << 16);
  while (!stopping_.load()) {
    const int n = poll(fds.data(), nfds_t(fds.size()), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) {
      char drain[64];
      (void)!read(wake_[0], drain, sizeof(drain));
      if (stopping_.load()) break;
    }
    for (int r = 0; r < size_; ++r) {
      pollfd& f = fds[size_t(r) + 1];
      if (f.fd < 0 || f.revents == 0) continue;
      Peer& p = peers_[size_t(r)];
      const ssize_t k = recv(f.fd, buf.data(), buf.size(), 0);
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      const bool link_error =
          k <= 0 && ((k < 0 && socket_link_error(errno)) || socket_silent_for_too_long(f.fd, link_timeout_s_));
      bool ok = k > 0;
      if (ok) {
        p.inbuf.insert(p.inbuf.end(), buf.data(), buf.data() + k);
        size_t off = 0;
        while (ok && p.inbuf.size() - off >= 8) {
          const uint32_t type = get<uint32_t>(p.inbuf.data() + off);
          const uint32_t len = get<uint32_t>(p.inbuf.data() + off + 4);
          if (len > kMaxFrame) {
            ok = false;
            break;
          }
          if (p.inbuf.size() - off < 8 + size_t(len)) break;
          ok = handle_frame(r, type, p.inbuf.data() + off + 8, len);
          off += 8 + size_t(len);
        }
        p.inbuf.erase(p.inbuf.begin(), p.inbuf.begin() + std::ptrdiff_t(off));
      }
      if (!ok) {
        // EOF, a reset, or garbage: the peer is gone. Without a "bye" first, it died. The kernel
        // ending the connection (link_error) means its host stopped answering: lost, whatever its
        // process is doing, which is what a partition looks like from either side.
        f.fd = -1;
        std::lock_guard<std::mutex> lk(mu_);
        p.closed = true;
        p.lost = link_error;
        if (!p.finished && !p.gave_up) {
          Event e;
          e.rank = r;
          e.died = true;
          if (link_error) {
            e.lost = true;
            e.host = p.host;
            e.reason = "no TCP answer for " + std::to_string(link_timeout_s_) +
                       " s (network partition, or its host is down)";
          }
          events_.push_back(e);
          alarm_.store(true, std::memory_order_release);
        }
        cv_.notify_all();
      }
    }
  }
}

bool Liveness::handle_frame(int peer, uint32_t type, const char* payload, uint32_t len) {
  switch (type) {
    case kBye: {
      std::lock_guard<std::mutex> lk(mu_);
      if (!peers_[size_t(peer)].finished) peers_finished_.fetch_add(1, std::memory_order_release);
      peers_[size_t(peer)].finished = true;
      cv_.notify_all();
      return true;
    }
    case kGiveUp: {
      std::lock_guard<std::mutex> lk(mu_);
      peers_[size_t(peer)].gave_up = true;
      Event e;
      e.rank = peer;
      e.reason.assign(payload, len);
      events_.push_back(e);
      alarm_.store(true, std::memory_order_release);
      cv_.notify_all();
      return true;
    }
    case kQuery: {
      if (len != 8) return false;
      const uint64_t id = get<uint64_t>(payload);
      std::string reply;
      {
        std::lock_guard<std::mutex> lk(mu_);
        name_parts_locked();
        put(reply, id);
        put(reply, uint8_t(in_op_ ? 1 : 0));
        put(reply, op_comm_);
        put(reply, op_seq_);
        put_string(reply, op_name_);
        put_string(reply, op_call_);
        put(reply, uint8_t(recent_.size()));
        for (const CallRecord& c : recent_) {
          put(reply, c.comm_id);
          put(reply, c.seq);
          put_string(reply, c.op);
          put_string(reply, c.call);
        }
        reply += state_text_locked(now_s());
      }
      send_frame(peer, kState, reply);
      return true;
    }
    case kState: {
      if (len < 25) return false;
      PeerState s;
      s.rank = peer;
      s.answered = true;
      const uint64_t id = get<uint64_t>(payload);
      s.in_op = payload[8] != 0;
      s.comm_id = get<uint64_t>(payload + 9);
      s.seq = get<uint64_t>(payload + 17);
      uint32_t off = 25;
      if (!get_string(payload, len, &off, &s.op) || !get_string(payload, len, &off, &s.call) || off >= len)
        return false;
      s.recent.resize(uint8_t(payload[off++]));
      for (CallRecord& c : s.recent) {
        if (len - off < 16) return false;
        c.comm_id = get<uint64_t>(payload + off);
        c.seq = get<uint64_t>(payload + off + 8);
        off += 16;
        if (!get_string(payload, len, &off, &c.op) || !get_string(payload, len, &off, &c.call)) return false;
      }
      s.text.assign(payload + off, len - off);
      std::lock_guard<std::mutex> lk(mu_);
      auto it = answers_.find(id);
      if (it != answers_.end()) it->second[peer] = s;
      cv_.notify_all();
      return true;
    }
    default:
      return false;
  }
}

std::string Liveness::lost_text(const Event& e, const std::string& name) {
  return "lost contact with " + (name.empty() ? "rank " + std::to_string(e.rank) : name) + " (host " + e.host +
         "): " + e.reason;
}

std::string Liveness::state_text_locked(double now) const {
  if (in_op_) return "in " + op_label_ + " for " + seconds_text(now - op_since_);
  if (op_failed_) return "failed in " + op_label_ + " " + seconds_text(now - op_since_) + " ago";
  if (op_label_.empty()) return "not in a communication call (none made yet)";
  return "not in a communication call for " + seconds_text(now - op_since_) + " (last: " + op_label_ + ")";
}

void Liveness::op_begin(uint64_t comm_id, uint64_t seq, const std::string& op, const std::string& call,
                        const std::string& label) {
  std::lock_guard<std::mutex> lk(mu_);
  begin_locked(comm_id, seq, false);
  op_name_ = op;
  op_call_ = call;
  op_label_ = label;
  // A call made of several waits (all_reduce: an all-to-all, then an all-gather) is one record.
  if (op.empty() || (!recent_.empty() && recent_.back().comm_id == comm_id && recent_.back().seq == seq)) return;
  if (recent_.size() == kRecentCalls) recent_.erase(recent_.begin());
  recent_.push_back(CallRecord{comm_id, seq, op, call});
}

void Liveness::op_begin_parts(uint64_t comm_id, uint64_t seq, const char* op, uint64_t call_no,
                              const std::string& comm_name, int rank, int size) {
  std::lock_guard<std::mutex> lk(mu_);
  begin_locked(comm_id, seq, true);
  parts_.op = op;
  parts_.call_no = call_no;
  parts_.comm_name = comm_name;  // reuses its capacity: no allocation once the names have been seen
  parts_.rank = rank;
  parts_.size = size;
}

void Liveness::begin_locked(uint64_t comm_id, uint64_t seq, bool by_parts) {
  in_op_ = true;
  op_failed_ = false;
  op_comm_ = comm_id;
  op_seq_ = seq;
  parts_.pending = by_parts;
  op_since_ = now_s();
}

void Liveness::name_parts_locked() {
  if (!parts_.pending) return;
  parts_.pending = false;
  op_name_ = parts_.op;
  op_call_ = op_name_ + " #" + std::to_string(parts_.call_no) + " on '" + parts_.comm_name + "'";
  op_label_ = op_call_ + " (rank " + std::to_string(parts_.rank) + " of " + std::to_string(parts_.size) + ")";
}

std::vector<Liveness::CallRecord> Liveness::recent_calls() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recent_;
}

void Liveness::op_end(bool failed) {
  std::lock_guard<std::mutex> lk(mu_);
  in_op_ = false;
  op_failed_ = failed;
  op_since_ = now_s();
}

void Liveness::wait_alarm(double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return alarm_.load(std::memory_order_acquire); });
}

std::vector<Liveness::Event> Liveness::events() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_;
}

bool Liveness::peer_finished(int rank) const {
  std::lock_guard<std::mutex> lk(mu_);
  return peers_[size_t(rank)].finished;
}

std::vector<Liveness::PeerState> Liveness::query(const std::vector<int>& ranks, double wait_s) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    id = next_query_++;
    answers_[id];
  }
  std::string q;
  put(q, id);
  for (int r : ranks)
    if (r != rank_) send_frame(r, kQuery, q);
  std::vector<PeerState> out;
  std::unique_lock<std::mutex> lk(mu_);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  auto all_in = [&] {
    for (int r : ranks) {
      if (r == rank_) continue;
      const Peer& p = peers_[size_t(r)];
      if (!p.closed && !answers_[id].count(r)) return false;
    }
    return true;
  };
  cv_.wait_until(lk, until, all_in);
  for (int r : ranks) {
    if (r == rank_) continue;
    const Peer& p = peers_[size_t(r)];
    auto it = answers_[id].find(r);
    PeerState s;
    if (it != answers_[id].end()) s = it->second;
    s.rank = r;
    s.dead = p.closed && !p.finished;
    s.lost = s.dead && p.lost;
    s.finished = p.finished;
    out.push_back(s);
  }
  answers_.erase(id);
  return out;
}

void Liveness::forget_after_fork() {
  // Only async-signal-safe work: the watcher thread does not exist here, its mutexes may be held.
  // The numbers are forgotten (-1): a file the child opens next reuses them, and nothing of the
  // parent's may write there. Every communicator call checks check_not_forked() first.
  forked_ = true;
  for (Peer& p : peers_) {
    if (p.fd >= 0) close(p.fd);
    p.fd = -1;
  }
  close(wake_[0]);
  close(wake_[1]);
  wake_[0] = wake_[1] = -1;
  (void)thread_.release();  // its std::thread must not be destroyed (or joined) in this process
}

void Liveness::check_not_forked(const std::string& label) const {
  if (!forked_) return;
  ZERO8_THROW(comm, label << ": this communicator belongs to process " << owner_pid_
                          << " and cannot be used after fork() (this is its child, process " << getpid()
                          << "): its connections and MPI state stay with the parent; communicate from the parent "
                             "process only");
}

void Liveness::linger(double max_s, double grace_s) {
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(max_s);
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_until(lk, until, [&] {
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && !peers_[size_t(r)].closed && !peers_[size_t(r)].gave_up && !peers_[size_t(r)].finished)
        return false;
    return true;
  });
  lk.unlock();
  const auto grace_end = std::min(until, std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s));
  std::this_thread::sleep_until(grace_end);
}

void Liveness::give_up(const std::string& reason) {
  if (gave_up_) return;
  gave_up_ = true;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) send_frame(r, kGiveUp, reason);
}

}  // namespace zero8::comm::detail
