// The tcp backend: one TCP connection between every pair of ranks, for processes that no MPI launcher
// started (torchrun, DeepSpeed's launcher); the caller supplies the rendezvous (tcp_create). Host
// memory; the reductions are the base class's rank-order folds, so results equal the MPI backend's.
//
// Wire: every message is a FrameHeader, then its payload. A data frame names its communicator (an id
// equal on all members), its channel (a send/recv tag, or kCollective) and, for collectives, the call
// (op and collective number), so a message is only ever taken by the call it was sent for. Each step
// of a call is one Exchange (its sends and receives) driven by one poll() loop over every connection
// of the world: sends and receives progress together, so two ranks sending each other hundreds of MB
// never deadlock, and a frame whose receive is posted is read straight into its destination. Any other
// frame (for another communicator, a tag not asked for yet, a later call of a peer that is ahead) is
// buffered per peer and taken, in arrival order, by the call that asks for it. Every call reads every
// connection, which is how a death anywhere in the world fails calls on every communicator: the kernel
// closes a killed process's sockets, so its peers see EOF at once.
//
// A lost host (a network partition, a host that went down) closes nothing. Keepalive ends an idle
// connection after ZERO8_COMM_LINK_TIMEOUT; one with this rank's data in flight (or waiting on a shut
// receive window) is watched by the calls themselves: check_links() reads each connection's TCP_INFO a
// few times a second and takes a peer whose host has answered nothing for that long as lost.
//
// What a silent peer is doing: each world also has a liveness mesh (liveness.h, as the MPI backend's),
// whose watcher thread answers status queries while its rank computes or waits. Every call records
// itself there (op_begin/op_end), and a call that times out asks the peers it waits on, so the error
// says which rank never reached the call and what it does instead. The mesh's own death and partition
// events are not used: the data connections show those first.
//
// Ending: the last communicator of a world destroyed normally sends BYE on every connection, so peers
// tell a rank that shut down from one that died (EOF without BYE). A rank whose call fails sends
// GIVEUP (its reason) where its stream is at a frame boundary and shuts its sockets down: peers blocked
// on it fail at once, and the failure names the first cause.
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>

#include "backends.h"
#include "comm_env.h"
#include "liveness.h"
#include "sockets.h"
#include "zero8/comm/communicator.h"
#include "zero8/error.h"
#include "zero8/kernels/hd.h"

namespace zero8::comm {
namespace {

using detail::socket_now;

constexpr uint32_t kFrameMagic = 0x7a387466u;  // a stream out of step fails at its next header
constexpr uint8_t kData = 1, kBye = 2, kGiveUp = 3;
// The channel of collective frames; send/recv tags are 0..32767.
constexpr uint16_t kCollective = 0xffff;
// The longest GIVEUP reason (an error message) sent or taken.
constexpr int64_t kMaxReasonBytes = 1 << 16;

struct FrameHeader {
  uint32_t magic;
  uint8_t type;      // kData, kBye, kGiveUp
  uint8_t kind;      // OpKind of the sender's call
  uint16_t tag;      // send/recv tag, or kCollective
  uint64_t comm_id;  // equal on every member of the communicator
  uint64_t seq;      // collectives: the sender's collective_seq(), equal on all members at one call
  uint64_t call;     // the sender's seq(), to name its call in messages
  int64_t bytes;     // payload that follows
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader crosses the wire");

// The handshake on a new connection: the connecting (higher) rank sends its Hello, the accepting rank
// answers with its own (status kHelloOk, or why it refuses, then closes).
constexpr uint32_t kHelloMagic = 0x7a38746cu, kHelloVersion = 1;
constexpr int32_t kHelloOk = 0, kHelloWrongJob = 1, kHelloBadRank = 2;
struct Hello {
  uint32_t magic, version;
  uint64_t token;  // rank 0's nonce: the job's
  int32_t rank, size, status, pad;
};
static_assert(sizeof(Hello) == 32, "Hello crosses the wire");

// A connection that sends no hello is not one of ours: how long one may hold up the setup.
constexpr double kHelloSeconds = 5.0;
// How much of one peer's socket is read or written before the loop turns to the others.
constexpr int64_t kSliceBytes = int64_t(1) << 22;
// How long a device call waits for a member that has shut down (said BYE): its side of the call may be
// done, since NCCL completes each rank's part on its own.
constexpr double kByeGraceSeconds = 1.0;
// After a peer gave up or a frame did not fit, how long the connections are watched for a death to name
// instead (the root cause: a survivor's GIVEUP can arrive before the dead rank's EOF).
constexpr double kCauseGraceSeconds = 0.02;
// How often a waiting call looks for connections whose outgoing data went unanswered (check_links), and
// how long a connection must stay so before its peer counts as lost: longer than any round trip of a
// working link, so that a window probe caught between its send and its answer does not count.
constexpr double kLinkCheckSeconds = 0.25, kUnansweredHoldSeconds = 1.0;
// How long a call polls without sleeping before it waits in poll().
constexpr double kSpinSeconds = 50e-6;
// The first word of a contact string (what each rank hands to the exchange).
constexpr const char* kContactMagic = "zero8-tcp/1";
// The world communicator's id; a child's is mixed from its parent's (do_split). The liveness mesh's
// address exchange runs on a communicator of its own, so the world's calls are numbered from 1.
constexpr uint64_t kWorldId = 1, kMeshSetupId = 2;

std::string errno_text(int err) { return std::strerror(err); }

std::string fixed1(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << s;
  return os.str();
}

// all_gather_v and all_gather (all_to_all_v and all_to_all) are one collective that ranks may mix.
OpKind op_family(OpKind k) {
  if (k == OpKind::all_gather_v) return OpKind::all_gather;
  if (k == OpKind::all_to_all_v) return OpKind::all_to_all;
  return k;
}

// The operation a frame's header names, in messages ("all_reduce"; "op 200" for a kind this build lacks).
std::string frame_op_name(const FrameHeader& h) {
  return h.kind < kOpKinds ? op_kind_name(OpKind(h.kind)) : "op " + std::to_string(h.kind);
}

// A data frame that arrived before a call asked for it (not zero-filled first: it can be hundreds of MB).
struct Message {
  FrameHeader header{};
  std::unique_ptr<char[]> payload;
};

// One send or receive of an Exchange; peer is a world rank.
struct Transfer {
  int peer = -1;
  char* data = nullptr;  // send: the source (only read); receive: the destination
  int64_t bytes = 0;
  FrameHeader header{};  // sends: the frame's header
  int64_t done = 0;      // sends: header and payload bytes written
  bool started = false;  // receives: a frame was matched to it
  bool finished = false;
};

// The sends and receives of one step of a call (an all-to-all, the all-gather of an all-reduce, ...).
struct Exchange {
  OpKind kind = OpKind::barrier;
  uint16_t tag = kCollective;
  uint64_t comm_id = 0, seq = 0, call = 0;
  std::vector<Transfer> sends, recvs;
  int pending = 0;  // transfers not finished
  // Why a frame matched to a receive does not fit it (its size, the call it was sent for), "" if it does.
  std::function<std::string(const Transfer& t, const FrameHeader& h)> fit;
  // The first frame that did not fit: the call fails, unless a death is the cause to name (peer_failure).
  std::string unfit;

  void send(int peer, const void* data, int64_t bytes) {
    Transfer t;
    t.peer = peer;
    t.data = static_cast<char*>(const_cast<void*>(data));
    t.bytes = bytes;
    t.header = FrameHeader{kFrameMagic, kData, uint8_t(kind), tag, comm_id, seq, call, bytes};
    sends.push_back(t);
    ++pending;
  }
  void recv(int peer, void* data, int64_t bytes) {
    Transfer t;
    t.peer = peer;
    t.data = static_cast<char*>(data);
    t.bytes = bytes;
    recvs.push_back(t);
    ++pending;
  }
  bool on_channel(const FrameHeader& h) const { return h.comm_id == comm_id && h.tag == tag; }
  bool sending_to(int peer) const {
    for (const Transfer& t : sends)
      if (t.peer == peer && !t.finished) return true;
    return false;
  }
  // A send to or a receive from `peer` is not finished.
  bool waiting_on(int peer) const {
    if (sending_to(peer)) return true;
    for (const Transfer& t : recvs)
      if (t.peer == peer && !t.finished) return true;
    return false;
  }
};

// Where the payload being read from a peer goes.
enum class Sink : uint8_t { none, transfer, message, reason };

struct Peer {
  int fd = -1;
  sockaddr_in listen_address{};
  std::string host, address;  // its host name and the "ip:port" it listened on
  // Reading: a header, then its payload into the sink.
  FrameHeader in{};
  size_t in_header_got = 0;
  Sink sink = Sink::none;
  Transfer* sink_transfer = nullptr;
  Message sink_message;
  std::string sink_reason;
  char* in_dst = nullptr;
  int64_t in_left = 0;
  std::deque<Message> queue;  // data frames no call has asked for yet, in arrival order
  // Writing: a frame is partly written (by a call that failed); nothing may follow it.
  bool out_mid_frame = false;
  // What became of it.
  bool finished = false;  // said BYE: destroyed its last communicator normally
  bool gave_up = false;   // sent GIVEUP with `reason`
  std::string reason;
  bool closed = false;     // its connection ended (EOF, a reset, a failed send)
  bool died = false;       // closed without BYE or GIVEUP
  bool lost = false;       // died because its host stopped answering (keepalive, check_links)
  bool malformed = false;  // sent something that is not a frame
  double unanswered_since = -1.0;  // check_links saw the connection's data unanswered since then
  // The last data frame's header and when it arrived (-1: none yet): what a timeout says of a peer that
  // does not answer the liveness mesh's status query (a stopped process).
  FrameHeader last{};
  double last_at = -1.0;
};

class TcpWorld;

// The process's live worlds, for the fork handler: lock-free, since a fork()ed child may not take a
// lock that another thread of the parent held at fork().
constexpr int kMaxWorlds = 256;
std::atomic<TcpWorld*> g_worlds[kMaxWorlds];

// What every communicator of one tcp_create shares: the connections, their buffered frames and the
// first failure.
class TcpWorld {
 public:
  TcpWorld(int rank, int size) : rank_(rank), size_(size), peers_(size_t(size)), owner_pid_(int(getpid())) {}
  ~TcpWorld();
  TcpWorld(const TcpWorld&) = delete;
  TcpWorld& operator=(const TcpWorld&) = delete;

  void setup(const AddressExchange& exchange);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& address() const { return address_; }
  int owner_pid() const { return owner_pid_; }
  // The names of this world's communicators by id (the ids are equal on all members), for messages.
  void name_comm(uint64_t id, const std::string& name) {
    std::lock_guard<std::mutex> lk(state_mu_);
    comm_names_[id] = name;
  }
  // What peer r last sent: "its last frame came 3.2 s ago, from all_reduce #40 on 'world'".
  std::string last_frame_text(int r) const;
  double timeout() const { return timeout_s_; }
  int link_timeout() const { return link_timeout_s_; }
  bool forked() const { return forked_.load(std::memory_order_acquire); }
  Peer& peer(int world_rank) { return peers_[size_t(world_rank)]; }

  bool failed() const {
    std::lock_guard<std::mutex> lk(state_mu_);
    return !failure_.empty();
  }
  std::string failure() const {
    std::lock_guard<std::mutex> lk(state_mu_);
    return failure_;
  }
  // Records the first failure, tells every peer (GIVEUP where its stream is at a frame boundary) and
  // shuts the connections down, so peers blocked on this rank fail at once. The caller holds io_mu.
  void fail(const std::string& reason);

  // Reads what peer r has sent, as far as it goes without blocking (about a slice): frames the running
  // call x asked for into their destinations (if they fit), others into r's queue.
  void read_peer(int r, Exchange& x);
  // Writes x's frames for peer r, in order, as far as the socket takes them (about a slice).
  void write_peer(int r, Exchange& x);
  // Gives receive t the first queued frame of x's channel from its peer, if one has arrived.
  void take_queued(Exchange& x, Transfer& t);
  // The open connections to poll, for input (and for output where x still sends to the peer), and the
  // world rank of each.
  void poll_set(const Exchange* x, std::vector<pollfd>* fds, std::vector<int>* who) const;
  // At most every kLinkCheckSeconds: closes, as lost, the connections whose peer host has not answered
  // this rank's data or window probes for the link timeout (detail::socket_unanswered), seen so for
  // kUnansweredHoldSeconds. The caller holds io_mu.
  void check_links();

  void forget_after_fork();
  void shut_down_for_abort();

  std::mutex io_mu;  // the connections and everything in peers_: held by the call using them
  // The status side channel (set up by tcp_create once the connections are made; null before).
  std::unique_ptr<detail::Liveness> live;

 private:
  void check_loopback_reachable(const std::string& label) const;
  void connect_peer(int r, uint64_t token, double deadline);
  void accept_peers(int lfd, uint64_t token, double deadline);
  void header_done(int r, Exchange& x);
  void frame_done(int r, Exchange& x);
  void close_peer(int r, int err);

  int rank_, size_;
  std::vector<Peer> peers_;
  std::string address_;  // "ip:port" this rank listened on
  int owner_pid_;
  double timeout_s_ = 600.0;
  int link_timeout_s_ = 60;
  int slot_ = -1;  // in g_worlds
  double next_link_check_ = 0.0;  // guarded by io_mu
  std::atomic<bool> forked_{false};
  mutable std::mutex state_mu_;  // failure_: read by every call, of any thread, before it starts
  std::string failure_;
  std::map<uint64_t, std::string> comm_names_;  // guarded by state_mu_
};

void atfork_child() {
  for (std::atomic<TcpWorld*>& slot : g_worlds)
    if (TcpWorld* w = slot.load()) w->forget_after_fork();
}

// ---- setup ----

// A rank's contact string: "zero8-tcp/1 <ip>:<port> <nonce> <host>", or, for a rank that cannot take
// part, "zero8-tcp/1 - <nonce> <host> <why>".
std::string contact_text(const std::string& address, uint64_t nonce, const std::string& error) {
  std::ostringstream os;
  os << kContactMagic << " " << (error.empty() ? address : "-") << " " << std::hex << std::setw(16) << std::setfill('0')
     << nonce << std::dec << " " << detail::host_name();
  if (!error.empty()) os << " " << error;
  return os.str();
}

struct Contact {
  bool ok = false;  // else `error` says why that rank cannot join
  sockaddr_in address{};
  std::string address_text, host, error;
  uint64_t nonce = 0;
};

bool parse_contact(const std::string& s, Contact* c) {
  std::istringstream is(s);
  std::string magic, address, nonce;
  if (!(is >> magic >> address >> nonce >> c->host) || magic != kContactMagic) return false;
  char* end = nullptr;
  c->nonce = std::strtoull(nonce.c_str(), &end, 16);
  if (end == nonce.c_str() || *end != '\0') return false;
  if (address == "-") {
    std::getline(is >> std::ws, c->error);
    return true;
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  const std::string ip = address.substr(0, colon), port = address.substr(colon + 1);
  const long port_value = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || port_value <= 0 || port_value > 65535) return false;
  c->address.sin_family = AF_INET;
  c->address.sin_port = htons(uint16_t(port_value));
  if (inet_pton(AF_INET, ip.c_str(), &c->address.sin_addr) != 1) return false;
  c->address_text = address;
  c->ok = true;
  return true;
}

std::string setup_label(int rank, int size) {
  return "tcp_create (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
}

void TcpWorld::setup(const AddressExchange& exchange) {
  const std::string label = setup_label(rank_, size_);
  // A rank that cannot take part still joins the exchange, saying why, so its peers fail at once with
  // the reason instead of waiting for its connections until the timeout.
  std::exception_ptr local_error;
  std::string why;
  int lfd = -1;
  try {
    timeout_s_ = detail::env_comm_timeout();
    link_timeout_s_ = detail::env_comm_link_timeout();
    // Its connections and the liveness mesh's: a listening socket and one per peer each, and the mesh's pipe.
    why = detail::socket_reserve_descriptors(
        2 * int64_t(size_) + 2, "a world of " + std::to_string(size_) + " ranks (two connections to each peer)");
    if (!why.empty()) ZERO8_THROW(comm, label << ": " << why);
    sockaddr_in bound{};
    lfd = detail::socket_listen(detail::env_comm_ifaddr(), size_ + 16, &address_, &bound, &why);
    if (lfd < 0) ZERO8_THROW(comm, label << ": " << why);
  } catch (const std::exception& e) {
    local_error = std::current_exception();
    if (why.empty()) why = e.what();
  }
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
  } closer{lfd};
  const std::string mine = contact_text(address_, detail::socket_random_token(), local_error ? why : "");
  const std::vector<std::string> all = exchange(mine);
  if (local_error) std::rethrow_exception(local_error);
  if (int(all.size()) != size_)
    ZERO8_THROW(comm, label << ": the address exchange returned " << all.size() << " contact strings for " << size_
                            << " ranks");
  if (all[size_t(rank_)] != mine)
    ZERO8_THROW(comm, label << ": the address exchange returned '" << all[size_t(rank_)].substr(0, 200)
                            << "' as this rank's contact string, not the '" << mine
                            << "' it published (the strings must come back in rank order)");
  uint64_t token = 0;
  for (int r = 0; r < size_; ++r) {
    Contact c;
    if (!parse_contact(all[size_t(r)], &c))
      ZERO8_THROW(comm, label << ": rank " << r << "'s contact string '" << all[size_t(r)].substr(0, 200)
                              << "' is not a zero8 tcp address (every rank must run zero8's tcp backend)");
    if (!c.ok) ZERO8_THROW(comm, label << ": rank " << r << " cannot join: " << c.error);
    if (r == 0) token = c.nonce;
    Peer& p = peers_[size_t(r)];
    p.listen_address = c.address;
    p.host = c.host;
    p.address = c.address_text;
  }
  check_loopback_reachable(label);
  const double deadline = socket_now() + timeout_s_;
  try {
    // Connect to every lower rank, then accept every higher one. A rank answers hellos once it has
    // connected to all below it, so by induction from rank 0 (which only accepts) nobody waits in a cycle.
    for (int r = 0; r < rank_; ++r) connect_peer(r, token, deadline);
    accept_peers(lfd, token, deadline);
    for (int r = 0; r < size_; ++r) {
      const int fd = peers_[size_t(r)].fd;
      if (r == rank_) continue;
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
      // Keepalive only, not TCP_USER_TIMEOUT: a busy rank that leaves its receive buffer full would be
      // taken for a lost host (sockets.h).
      detail::socket_set_link_options(fd, link_timeout_s_, false, label);
    }
  } catch (...) {
    for (Peer& p : peers_) {
      if (p.fd >= 0) close(p.fd);
      p.fd = -1;
    }
    throw;
  }
  // Registered last: a fork()ed child closes the connections of every world in this table.
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &atfork_child); });
  for (int i = 0; i < kMaxWorlds && slot_ < 0; ++i) {
    TcpWorld* none = nullptr;
    if (g_worlds[i].compare_exchange_strong(none, this)) slot_ = i;
  }
  if (slot_ < 0)
    ZERO8_THROW(unsupported, label << ": more than " << kMaxWorlds
                                   << " tcp communicator worlds alive in one process (destroy unused ones)");
}

// A rank listening on loopback (its host name, or MASTER_ADDR, resolves to 127.x there: Debian's
// "127.0.1.1 hostname" line, --master_addr localhost) cannot be reached from another host, whose ranks
// would retry it until the timeout. Every rank sees the same contact strings, so every rank fails here at
// once; ranks of one machine share a host name, so single-host jobs are left alone.
void TcpWorld::check_loopback_reachable(const std::string& label) const {
  for (int r = 0; r < size_; ++r) {
    const Peer& p = peers_[size_t(r)];
    if ((ntohl(p.listen_address.sin_addr.s_addr) >> 24) != 127) continue;
    int other = p.host != peers_[size_t(rank_)].host ? rank_ : -1;  // this rank, where it is one
    for (int s = 0; s < size_ && other < 0; ++s)
      if (peers_[size_t(s)].host != p.host) other = s;
    if (other < 0) continue;
    ZERO8_THROW(comm, label << ": rank " << r << " on host " << p.host << " listens on the loopback address "
                            << p.address << ", which rank " << other << " on host " << peers_[size_t(other)].host
                            << " cannot reach: set ZERO8_COMM_IFADDR on " << p.host
                            << " to its address on the network the hosts share (its host name or MASTER_ADDR "
                               "resolves to loopback there)");
  }
}

void TcpWorld::connect_peer(int r, uint64_t token, double deadline) {
  const std::string label = setup_label(rank_, size_);
  Peer& p = peers_[size_t(r)];
  // The peer listens before it publishes its address, but a rendezvous may hand out the list before
  // every rank has run this far, or a listen backlog may overflow: refused connects are retried.
  double pause = 0.001;
  for (;;) {
    p.fd = detail::socket_connect(p.listen_address, deadline);
    if (p.fd >= 0) break;
    const int err = errno;
    if (detail::socket_out_of_descriptors(err))
      ZERO8_THROW(comm, label << ": cannot open a connection to rank " << r << ": " << errno_text(err) << " ("
                              << detail::socket_descriptor_text() << ")");
    if (err != ECONNREFUSED && err != ETIMEDOUT && err != EAGAIN && err != ECONNRESET)
      ZERO8_THROW(comm, label << ": cannot connect to rank " << r << " at " << p.address << ": " << errno_text(err)
                              << " (set ZERO8_COMM_IFADDR to an address the other hosts reach?)");
    if (socket_now() + pause >= deadline)
      ZERO8_THROW(comm, label << ": cannot connect to rank " << r << " at " << p.address << " within " << timeout_s_
                              << " s: " << errno_text(err));
    timespec ts{0, long(pause * 1e9)};
    nanosleep(&ts, nullptr);
    pause = std::min(pause * 2, 0.1);
  }
  const Hello mine{kHelloMagic, kHelloVersion, token, rank_, size_, kHelloOk, 0};
  if (detail::socket_write_until(p.fd, reinterpret_cast<const char*>(&mine), sizeof(mine), deadline) !=
      ssize_t(sizeof(mine)))
    ZERO8_THROW(comm,
                label << ": the handshake with rank " << r << " at " << p.address << " failed: " << errno_text(errno));
  Hello reply{};
  if (!detail::socket_read_exact(p.fd, &reply, sizeof(reply), deadline))
    ZERO8_THROW(comm, label << ": rank " << r << " at " << p.address << " did not answer the handshake within "
                            << timeout_s_ << " s (the process there closed the connection or is not rank " << r
                            << " of this job)");
  if (reply.magic != kHelloMagic || reply.version != kHelloVersion)
    ZERO8_THROW(comm, label << ": the process at " << p.address << " is not a zero8 tcp peer (wrong handshake)");
  if (reply.status == kHelloWrongJob || reply.token != token)
    ZERO8_THROW(comm, label << ": the process at " << p.address << " belongs to another job (its job token differs):"
                            << " the address exchange handed out a stale address for rank " << r);
  if (reply.status != kHelloOk || reply.rank != r || reply.size != size_)
    ZERO8_THROW(comm, label << ": the process at " << p.address << " is rank " << reply.rank << " of " << reply.size
                            << ", not rank " << r << " of " << size_);
}

void TcpWorld::accept_peers(int lfd, uint64_t token, double deadline) {
  const std::string label = setup_label(rank_, size_);
  int expected = size_ - 1 - rank_;
  std::vector<std::string> refused;
  while (expected > 0) {
    if (!detail::socket_poll(lfd, POLLIN, deadline)) {
      std::ostringstream missing, os;
      int n = 0;
      for (int r = rank_ + 1; r < size_; ++r)
        if (peers_[size_t(r)].fd < 0) missing << (n++ ? ", " : "") << r;
      os << label << ": rank" << (n > 1 ? "s " : " ") << missing.str() << " did not connect to this rank at "
         << address_ << " within " << timeout_s_ << " s";
      for (const std::string& s : refused) os << "; " << s;
      ZERO8_THROW(comm, os.str());
    }
    sockaddr_in from{};
    socklen_t len = sizeof(from);
    const int fd = accept4(lfd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC);
    if (fd < 0 && detail::socket_out_of_descriptors(errno))  // the connection stays queued: fail, not spin
      ZERO8_THROW(comm, label << ": cannot accept the connections of higher ranks: " << errno_text(errno) << " ("
                              << detail::socket_descriptor_text() << ")");
    if (fd < 0) continue;
    char ip[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &from.sin_addr, ip, sizeof(ip));
    Hello h{};
    Hello reply{kHelloMagic, kHelloVersion, token, rank_, size_, kHelloOk, 0};
    std::string why;
    if (!detail::socket_read_exact(fd, &h, sizeof(h), std::min(deadline, socket_now() + kHelloSeconds)) ||
        h.magic != kHelloMagic || h.version != kHelloVersion) {
      why = "not a zero8 tcp handshake";
      reply.status = kHelloBadRank;
    } else if (h.token != token) {
      why = "its job token differs (another job's rank, given a stale address)";
      reply.status = kHelloWrongJob;
    } else if (h.size != size_ || h.rank <= rank_ || h.rank >= size_ || peers_[size_t(h.rank)].fd >= 0) {
      why = "it says it is rank " + std::to_string(h.rank) + " of " + std::to_string(h.size);
      reply.status = kHelloBadRank;
    }
    (void)detail::socket_write_until(fd, reinterpret_cast<const char*>(&reply), sizeof(reply),
                                     socket_now() + kHelloSeconds);
    if (!why.empty()) {
      if (refused.size() < 4)
        refused.push_back("refused a connection from " + std::string(ip) + ":" + std::to_string(ntohs(from.sin_port)) +
                          ": " + why);
      close(fd);
      continue;
    }
    peers_[size_t(h.rank)].fd = fd;
    --expected;
  }
}

TcpWorld::~TcpWorld() {
  if (slot_ >= 0) {
    TcpWorld* self = this;
    g_worlds[slot_].compare_exchange_strong(self, nullptr);
  }
  if (forked()) return;  // the connections are the parent's (the fork handler closed this copy's fds)
  std::lock_guard<std::mutex> io(io_mu);
  const bool healthy = !failed();
  for (Peer& p : peers_) {
    if (p.fd < 0) continue;
    if (healthy && !p.closed && !p.out_mid_frame) {
      // BYE: a normal end, not a death. Bounded: a peer that stopped reading must not hold us here.
      const FrameHeader bye{kFrameMagic, kBye, 0, 0, 0, 0, 0, 0};
      (void)detail::socket_write_until(p.fd, reinterpret_cast<const char*>(&bye), sizeof(bye), socket_now() + 1.0);
      // close() with unread data resets the connection, dropping a BYE still queued: drain, then end.
      char drain[4096];
      while (recv(p.fd, drain, sizeof(drain), MSG_DONTWAIT) > 0) {
      }
      shutdown(p.fd, SHUT_WR);
    }
    close(p.fd);
    p.fd = -1;
  }
}

void TcpWorld::forget_after_fork() {
  // Only async-signal-safe work: the parent's other threads do not exist here, and their locks may be
  // held. The numbers are forgotten (-1): files the child opens next reuse them. Never shutdown(): it
  // would act on the connection the parent still uses.
  forked_.store(true, std::memory_order_release);
  for (Peer& p : peers_) {
    if (p.fd >= 0) close(p.fd);
    p.fd = -1;
  }
}

void TcpWorld::shut_down_for_abort() {
  for (Peer& p : peers_)
    if (p.fd >= 0) shutdown(p.fd, SHUT_RDWR);
}

void TcpWorld::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(state_mu_);
    if (!failure_.empty()) return;
    failure_ = reason;
  }
  const std::string text = reason.substr(0, size_t(kMaxReasonBytes));
  FrameHeader h{kFrameMagic, kGiveUp, 0, 0, 0, 0, 0, int64_t(text.size())};
  for (int r = 0; r < size_; ++r) {
    Peer& p = peers_[size_t(r)];
    if (p.fd < 0) continue;
    if (!p.closed && !p.out_mid_frame) {
      // One nonblocking attempt: a peer that stopped reading learns of the failure from the shutdown.
      iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(text.data()), text.size()}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      (void)sendmsg(p.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    shutdown(p.fd, SHUT_RDWR);
  }
}

// ---- reading and writing ----

void TcpWorld::close_peer(int r, int err) {
  Peer& p = peers_[size_t(r)];
  if (p.closed) return;
  p.closed = true;
  const bool mid_frame = p.in_header_got > 0 || p.sink != Sink::none;
  if ((p.finished || p.gave_up) && !mid_frame && !p.malformed) return;
  p.died = true;
  p.lost = (err != 0 && detail::socket_link_error(err)) || detail::socket_silent_for_too_long(p.fd, link_timeout_s_);
}

std::string TcpWorld::last_frame_text(int r) const {
  const Peer& p = peers_[size_t(r)];
  if (p.last_at < 0) return "nothing received from it yet";
  const FrameHeader& h = p.last;
  std::ostringstream os;
  os << "its last frame came " << fixed1(socket_now() - p.last_at) << " s ago, from ";
  os << frame_op_name(h) << " #" << h.call;
  if (h.tag != kCollective) os << " (tag " << h.tag << ")";
  std::lock_guard<std::mutex> lk(state_mu_);
  const auto it = comm_names_.find(h.comm_id);
  os << " on "
     << (it == comm_names_.end() ? std::string("a communicator this rank no longer has") : "'" + it->second + "'");
  return os.str();
}

void TcpWorld::check_links() {
  const double now = socket_now();
  if (now < next_link_check_) return;
  next_link_check_ = now + kLinkCheckSeconds;
  for (int r = 0; r < size_; ++r) {
    Peer& p = peers_[size_t(r)];
    if (r == rank_ || p.closed) continue;
    if (!detail::socket_unanswered(p.fd, link_timeout_s_)) {
      p.unanswered_since = -1.0;
    } else if (p.unanswered_since < 0) {
      p.unanswered_since = now;
    } else if (now - p.unanswered_since >= kUnansweredHoldSeconds) {
      close_peer(r, ETIMEDOUT);
    }
  }
}

void TcpWorld::read_peer(int r, Exchange& x) {
  Peer& p = peers_[size_t(r)];
  int64_t budget = kSliceBytes;
  while (!p.closed && budget > 0) {
    ssize_t k;
    if (p.sink == Sink::none)
      k = recv(p.fd, reinterpret_cast<char*>(&p.in) + p.in_header_got, sizeof(FrameHeader) - p.in_header_got, 0);
    else
      k = recv(p.fd, p.in_dst, size_t(std::min(p.in_left, budget)), 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      close_peer(r, k < 0 ? errno : 0);
      return;
    }
    budget -= k;
    if (p.sink == Sink::none) {
      p.in_header_got += size_t(k);
      if (p.in_header_got < sizeof(FrameHeader)) continue;
      p.in_header_got = 0;
      header_done(r, x);
    } else {
      p.in_dst += k;
      p.in_left -= k;
      if (p.in_left == 0) frame_done(r, x);
    }
  }
}

// A whole header from peer r has arrived: where its payload goes.
void TcpWorld::header_done(int r, Exchange& x) {
  Peer& p = peers_[size_t(r)];
  const FrameHeader& h = p.in;
  const bool known = h.type == kData || h.type == kBye || (h.type == kGiveUp && h.bytes <= kMaxReasonBytes);
  if (h.magic != kFrameMagic || h.bytes < 0 || !known) {
    p.malformed = true;
    close_peer(r, 0);
    return;
  }
  if (h.type == kBye) {
    p.finished = true;
    return;
  }
  if (h.type == kData) {
    p.last = h;
    p.last_at = socket_now();
  }
  if (h.type == kGiveUp) {
    p.sink = Sink::reason;
    p.sink_reason.assign(size_t(h.bytes), '\0');
    p.in_dst = p.sink_reason.data();
  } else {
    Transfer* t = nullptr;
    if (x.on_channel(h))
      for (Transfer& cand : x.recvs)
        if (cand.peer == r && !cand.started) {
          t = &cand;  // one receive per peer and step
          break;
        }
    if (t != nullptr) t->started = true;
    const std::string why = t != nullptr ? x.fit(*t, h) : std::string();
    if (!why.empty() && x.unfit.empty()) x.unfit = why;
    if (t != nullptr && why.empty()) {
      p.sink = Sink::transfer;
      p.sink_transfer = t;
      p.in_dst = t->data;
    } else {
      p.sink = Sink::message;
      p.sink_message.header = h;
      p.sink_message.payload.reset(new char[size_t(std::max<int64_t>(h.bytes, 1))]);
      p.in_dst = p.sink_message.payload.get();
    }
  }
  p.in_left = h.bytes;
  if (p.in_left == 0) frame_done(r, x);
}

void TcpWorld::frame_done(int r, Exchange& x) {
  Peer& p = peers_[size_t(r)];
  const Sink sink = p.sink;
  p.sink = Sink::none;
  switch (sink) {
    case Sink::transfer:
      p.sink_transfer->finished = true;
      p.sink_transfer = nullptr;
      --x.pending;
      break;
    case Sink::message:
      p.queue.push_back(std::move(p.sink_message));
      p.sink_message = Message{};
      // A receive of this call may be waiting for this very frame (it began arriving before the call).
      if (x.on_channel(p.queue.back().header))
        for (Transfer& t : x.recvs)
          if (t.peer == r && !t.started) take_queued(x, t);
      break;
    case Sink::reason:
      p.gave_up = true;
      p.reason = std::move(p.sink_reason);
      break;
    case Sink::none: break;
  }
}

void TcpWorld::take_queued(Exchange& x, Transfer& t) {
  Peer& p = peers_[size_t(t.peer)];
  for (auto it = p.queue.begin(); it != p.queue.end(); ++it) {
    if (!x.on_channel(it->header)) continue;
    t.started = true;
    const std::string why = x.fit(t, it->header);
    if (!why.empty()) {
      if (x.unfit.empty()) x.unfit = why;
      return;
    }
    if (t.bytes > 0) std::memcpy(t.data, it->payload.get(), size_t(t.bytes));
    p.queue.erase(it);
    t.finished = true;
    --x.pending;
    return;
  }
}

void TcpWorld::poll_set(const Exchange* x, std::vector<pollfd>* fds, std::vector<int>* who) const {
  fds->clear();
  who->clear();
  for (int r = 0; r < size_; ++r) {
    const Peer& p = peers_[size_t(r)];
    if (r == rank_ || p.closed) continue;
    fds->push_back({p.fd, short(POLLIN | (x != nullptr && x->sending_to(r) ? POLLOUT : 0)), 0});
    who->push_back(r);
  }
}

void TcpWorld::write_peer(int r, Exchange& x) {
  Peer& p = peers_[size_t(r)];
  int64_t budget = kSliceBytes;
  for (Transfer& t : x.sends) {
    if (t.peer != r || t.finished) continue;
    const int64_t total = int64_t(sizeof(FrameHeader)) + t.bytes;
    while (t.done < total) {
      if (p.closed || budget <= 0) return;
      iovec iov[2];
      size_t n = 0;
      if (t.done < int64_t(sizeof(FrameHeader)))
        iov[n++] = {reinterpret_cast<char*>(&t.header) + t.done, sizeof(FrameHeader) - size_t(t.done)};
      const int64_t off = std::max<int64_t>(0, t.done - int64_t(sizeof(FrameHeader)));
      const int64_t len = std::min(t.bytes - off, budget);
      if (len > 0) iov[n++] = {t.data + off, size_t(len)};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = n;
      const ssize_t k = sendmsg(p.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (k < 0) {
        // A reset or a broken pipe: what the peer said before it (BYE, GIVEUP) may still be unread.
        const int err = errno;
        read_peer(r, x);
        close_peer(r, err);
        return;
      }
      t.done += k;
      budget -= k;
      p.out_mid_frame = t.done < total;
    }
    t.finished = true;
    --x.pending;
  }
}

// Records a call in the world's liveness mesh, for the peers' status queries, while it lasts (as failed
// when an exception ends it). live is null while the mesh itself is being set up.
class MeshRecord {
 public:
  // A tcp call, by its parts (named only if a peer asks: the call may take microseconds).
  MeshRecord(detail::Liveness* live, uint64_t comm_id, uint64_t seq, OpKind kind, uint64_t call_no,
             const std::string& comm_name, int rank, int size)
      : live_(live), exceptions_(std::uncaught_exceptions()) {
    if (live_) live_->op_begin_parts(comm_id, seq, op_kind_name(kind), call_no, comm_name, rank, size);
  }
  // A device call, named by the device communicator.
  MeshRecord(detail::Liveness* live, const detail::HostComm::DeviceCall& call)
      : live_(live), exceptions_(std::uncaught_exceptions()) {
    if (live_)
      live_->op_begin(call.comm_id, call.seq, call.p2p_peer < 0 ? op_kind_name(call.kind) : "", call.call, call.label);
  }
  ~MeshRecord() {
    if (live_) live_->op_end(std::uncaught_exceptions() > exceptions_);
  }
  MeshRecord(const MeshRecord&) = delete;
  MeshRecord& operator=(const MeshRecord&) = delete;

 private:
  detail::Liveness* live_;
  int exceptions_;
};

// ---- the communicator ----

class TcpComm final : public detail::HostComm {
 public:
  TcpComm(std::shared_ptr<TcpWorld> world, int rank, int size, std::string name, std::vector<int> world_ranks,
          uint64_t id, double timeout_s)
      : HostComm(rank, size, std::move(name), std::move(world_ranks), timeout_s), world_(std::move(world)), id_(id) {
    world_->name_comm(id_, this->name());
  }

  std::string description() const override {
    return "tcp communicator '" + name() + "' (rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
           ", host " + detail::host_name() + ", listening " + world_->address() + ")";
  }
  const char* backend() const override { return "tcp"; }
  MemSpace memory() const override { return MemSpace::host; }
  [[noreturn]] void abort(int exit_code) override {
    if (!world_->forked()) world_->shut_down_for_abort();  // a forked child ends itself only
    std::_Exit(exit_code);
  }

  // HostComm: a device call's wait reads every connection as the tcp calls do.
  uint64_t id() const override { return id_; }
  void watch(const DeviceCall& call, const std::function<bool()>& done) override;
  [[noreturn]] void fail_call(const DeviceCall& call, const std::string& cause) override {
    std::lock_guard<std::mutex> io(world_->io_mu);
    fail_with(call.label + ": " + cause);
  }
  bool forked() const override { return world_->forked(); }
  void check_not_forked(const std::string& label) const override {
    if (!world_->forked()) return;
    ZERO8_THROW(comm, label << ": this communicator belongs to process " << world_->owner_pid()
                            << " and cannot be used after fork() (this is its child, process " << getpid()
                            << "): its connections stay with the parent; communicate from the parent process only");
  }

  void set_failed(const std::string& reason) override {
    std::lock_guard<std::mutex> io(world_->io_mu);
    world_->fail(reason);
  }
  bool failed() const override { return world_->failed(); }
  std::string failure() const override { return world_->failure(); }
  void check_process(OpKind kind) const override { check_not_forked(op_label(kind)); }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                       const int64_t* recv_bytes, const int64_t* recv_displs, OpKind kind) override;
  void do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                       const int64_t* recv_displs, OpKind kind) override;
  void do_broadcast(void* buf, int64_t bytes, int root) override;
  void do_barrier() override;
  void do_send(const void* buf, int64_t bytes, int peer, int tag) override;
  void do_recv(void* buf, int64_t bytes, int peer, int tag) override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;

 private:
  Exchange exchange(OpKind kind, int tag = -1) const;
  // Runs x to completion: every send written, every receive filled. Throws Error(comm) (after failing
  // the world) when a peer dies or gives up, a peer x needs has shut down, a frame does not fit, or
  // timeout() passes.
  void run(Exchange& x);
  std::string check_fit(const Exchange& x, const Transfer& t, const FrameHeader& h) const;
  // Reads every connection that has data (waiting up to wait_s for one; 0: not at all). The caller holds io_mu.
  void read_ready(Exchange& x, double wait_s);
  // Why x must fail, "" if nothing says so: a peer anywhere in the world died, a frame did not fit, a peer
  // gave up, or a peer in `waits_on` has shut down. The caller holds io_mu.
  std::string peer_failure(Exchange& x, const std::function<bool(int world_rank)>& waits_on);
  [[noreturn]] void fail_with(const std::string& msg);  // the caller holds io_mu
  std::string peer_name(int world_rank) const;
  // What each of `world_ranks` is doing, asked over the liveness mesh (the caller holds io_mu): by world
  // rank, its state and the text for a timeout: "in barrier #3 on 'pair' (rank 1 of 2) for 600.1 s",
  // "not in a communication call for ...", or, without an answer, what it last sent.
  std::map<int, std::pair<detail::Liveness::PeerState, std::string>> ask(const std::vector<int>& world_ranks) const;
  // Why a call that still waits on a peer which said BYE fails.
  std::string shut_down_cause(int world_rank) const {
    return peer_name(world_rank) + " has shut down its communicators (it ended without joining this call)";
  }

  std::shared_ptr<TcpWorld> world_;
  uint64_t id_;
};

Exchange TcpComm::exchange(OpKind kind, int tag) const {
  Exchange x;
  x.kind = kind;
  x.tag = tag < 0 ? kCollective : uint16_t(tag);
  x.comm_id = id_;
  x.seq = tag < 0 ? collective_seq() : 0;
  x.call = seq();
  x.sends.reserve(size_t(size()));
  x.recvs.reserve(size_t(size()));  // receives are pointed to while the call runs
  return x;
}

// "rank 1 (10.0.0.2:41234)"; "rank 1 (world rank 3, ...)" in a sub-communicator; "world rank 3 (not in
// this communicator, ...)" for a peer elsewhere in the world.
std::string TcpComm::peer_name(int world_rank) const {
  const std::string& address = world_->peer(world_rank).address;
  const auto it = std::find(world_ranks().begin(), world_ranks().end(), world_rank);
  if (it == world_ranks().end())
    return "world rank " + std::to_string(world_rank) + " (not in this communicator, " + address + ")";
  const int r = int(it - world_ranks().begin());
  if (r == world_rank) return "rank " + std::to_string(r) + " (" + address + ")";
  return "rank " + std::to_string(r) + " (world rank " + std::to_string(world_rank) + ", " + address + ")";
}

std::map<int, std::pair<detail::Liveness::PeerState, std::string>> TcpComm::ask(
    const std::vector<int>& world_ranks) const {
  TcpWorld& w = *world_;
  std::map<int, std::pair<detail::Liveness::PeerState, std::string>> out;
  std::vector<detail::Liveness::PeerState> states;
  const double wait_s = detail::Liveness::query_wait(timeout());
  if (w.live) states = w.live->query(world_ranks, wait_s);
  for (int r : world_ranks) {
    detail::Liveness::PeerState st;
    for (const detail::Liveness::PeerState& s : states)
      if (s.rank == r) st = s;
    std::string text;
    if (st.answered)
      text = st.text;
    else
      text = (w.live ? "no answer to a status query within " + fixed1(wait_s) + " s; " : std::string()) +
             w.last_frame_text(r);
    out[r] = {st, text};
  }
  return out;
}

void TcpComm::fail_with(const std::string& msg) {
  world_->fail(msg);
  ZERO8_THROW(comm, msg);
}

std::string TcpComm::check_fit(const Exchange& x, const Transfer& t, const FrameHeader& h) const {
  if (x.tag == kCollective &&
      (h.seq != x.seq || h.kind >= kOpKinds || op_family(OpKind(h.kind)) != op_family(x.kind))) {
    const std::string op = frame_op_name(h);
    return "mismatched collectives: this rank called " + op_call(x.kind) + ", " + peer_name(t.peer) + " called " + op +
           " #" + std::to_string(h.call) + " on '" + name() + "'";
  }
  if (h.bytes == t.bytes) return "";
  std::ostringstream os;
  os << peer_name(t.peer) << " sent " << h.bytes << " bytes";
  if (x.tag != kCollective) os << " with tag " << x.tag;
  os << ", this rank expected " << t.bytes
     << (x.tag == kCollective ? " (the ranks passed sizes that do not match)" : " (recv must name the exact size)");
  return os.str();
}

void TcpComm::read_ready(Exchange& x, double wait_s) {
  TcpWorld& w = *world_;
  std::vector<pollfd> fds;
  std::vector<int> who;
  w.poll_set(nullptr, &fds, &who);
  if (fds.empty()) return;
  const timespec ts{time_t(wait_s), long((wait_s - double(time_t(wait_s))) * 1e9)};
  if (ppoll(fds.data(), nfds_t(fds.size()), &ts, nullptr) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents != 0) w.read_peer(who[i], x);
}

// A death first (the root cause), then what this rank saw itself, then what others saw.
std::string TcpComm::peer_failure(Exchange& x, const std::function<bool(int world_rank)>& waits_on) {
  TcpWorld& w = *world_;
  auto any = [&](bool Peer::*flag) {
    for (int r = 0; r < w.size(); ++r)
      if (r != w.rank() && w.peer(r).*flag) return true;
    return false;
  };
  if (!any(&Peer::died) && (any(&Peer::gave_up) || !x.unfit.empty())) {
    // A survivor's GIVEUP, or a frame of the call a dead rank was in, may arrive before the dead rank's
    // EOF: look for the death, to name it.
    const double until = socket_now() + kCauseGraceSeconds;
    while (!any(&Peer::died) && socket_now() < until) read_ready(x, std::max(until - socket_now(), 0.0));
  }
  std::ostringstream cause;
  int n = 0;
  for (int r = 0; r < w.size(); ++r) {
    const Peer& p = w.peer(r);
    if (r == w.rank() || !p.died) continue;
    cause << (n++ ? "; " : "");
    if (p.malformed)
      cause << peer_name(r) << " sent data that is not a zero8 tcp frame (the connection is out of step)";
    else if (p.lost)
      cause << "lost contact with " << peer_name(r) << ", host " << p.host << ": no TCP answer for " << w.link_timeout()
            << " s (network partition, or its host is down)";
    else
      cause << peer_name(r) << " closed its connection (the process died or gave up)";
  }
  if (n > 0) return cause.str();
  if (!x.unfit.empty()) return x.unfit;
  for (int r = 0; r < w.size(); ++r)
    if (r != w.rank() && w.peer(r).gave_up) return peer_name(r) + " gave up: " + w.peer(r).reason;
  for (int r = 0; r < w.size(); ++r) {
    const Peer& p = w.peer(r);
    if (r != w.rank() && (p.finished || p.closed) && waits_on(r)) return shut_down_cause(r);
  }
  return "";
}

void TcpComm::run(Exchange& x) {
  TcpWorld& w = *world_;
  std::lock_guard<std::mutex> io(w.io_mu);
  const MeshRecord record(w.live.get(), id_, x.seq, x.kind, seq(), name(), rank(), size());
  const double t0 = socket_now(), deadline = t0 + timeout();
  x.fit = [&](const Transfer& t, const FrameHeader& h) { return check_fit(x, t, h); };
  for (Transfer& t : x.recvs)
    if (!t.started) w.take_queued(x, t);
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (;;) {
    for (int r = 0; r < w.size(); ++r)
      if (x.sending_to(r) && !w.peer(r).closed) w.write_peer(r, x);
    // Every connection is polled, at least once per call, even when nothing is left to wait for:
    // a death anywhere fails every later call.
    const bool done = x.pending == 0;
    w.poll_set(&x, &fds, &who);
    const double now = socket_now(), left = deadline - now;
    // A short spin first: a small message's answer takes microseconds, less than a sleeping thread takes
    // to wake up (ranks may outnumber cores, hence the yield).
    const bool spin = !done && now - t0 < kSpinSeconds;
    if (spin) sched_yield();
    // The wait ends at least every kLinkCheckSeconds, for check_links.
    const int wait_ms = done || spin ? 0 : int(std::min(std::max(left, 0.0), kLinkCheckSeconds) * 1000.0 + 1.0);
    const int ready = fds.empty() ? 0 : poll(fds.data(), nfds_t(fds.size()), wait_ms);
    if (ready < 0 && errno != EINTR) fail_with(op_label(x.kind) + ": poll() failed: " + errno_text(errno));
    for (size_t i = 0; ready > 0 && i < fds.size(); ++i)
      if (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) w.read_peer(who[i], x);
    if (!done) w.check_links();
    const std::string failure = peer_failure(x, [&x](int r) { return x.waiting_on(r); });
    if (!failure.empty()) fail_with(op_label(x.kind) + ": " + failure);
    if (x.pending == 0) return;
    if (socket_now() < deadline) continue;
    std::ostringstream cause;
    cause << "timed out after " << fixed1(socket_now() - t0) << " s (timeout " << timeout() << " s)";
    // Each peer named once with what it is doing (a rank stuck before this call: "not in a communication
    // call ...", or in another one).
    std::vector<int> waited_on;
    for (const std::vector<Transfer>* list : {&x.recvs, &x.sends})
      for (const Transfer& t : *list)
        if (!t.finished && std::find(waited_on.begin(), waited_on.end(), t.peer) == waited_on.end())
          waited_on.push_back(t.peer);
    const auto states = ask(waited_on);
    std::vector<int> described;
    auto describe = [&](int r) {
      if (std::find(described.begin(), described.end(), r) != described.end()) return peer_name(r);
      described.push_back(r);
      return peer_name(r) + " [" + states.at(r).second + "]";
    };
    int silent = 0, stalled = 0;
    for (const Transfer& t : x.recvs)
      if (!t.finished) cause << (silent++ ? ", " : "; not heard from: ") << describe(t.peer);
    for (const Transfer& t : x.sends)
      if (!t.finished) cause << (stalled++ ? ", " : "; not taking this rank's data: ") << describe(t.peer);
    fail_with(op_label(x.kind) + ": " + cause.str());
  }
}

// A device call (NCCL) completes on its own: done() says when. Meanwhile every connection is read as a
// tcp call reads it (frames for other calls are queued for them), so a death or a GIVEUP anywhere in the
// world fails it at once. The sleeps between polls of done() are poll()s on the connections, so they end
// when anything arrives; io_mu is held only to read, so other threads' tcp calls go on meanwhile.
void TcpComm::watch(const DeviceCall& call, const std::function<bool()>& done) {
  TcpWorld& w = *world_;
  Exchange x = exchange(call.kind);  // nothing to send or receive
  std::vector<int> members;          // the world ranks the call waits on
  for (int r = 0; r < size(); ++r)
    if (r != rank() && (call.p2p_peer < 0 || r == call.p2p_peer)) members.push_back(world_rank(r));
  const MeshRecord record(w.live.get(), call);
  const double t0 = socket_now(), deadline = t0 + timeout();
  double bye_since = -1.0;
  int bye_rank = -1;
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (int iter = 0;; ++iter) {
    {
      std::lock_guard<std::mutex> io(w.io_mu);
      read_ready(x, 0.0);
      w.check_links();
      const std::string failure = peer_failure(x, [](int) { return false; });
      if (!failure.empty()) fail_with(call.label + ": " + failure);
      for (int r : members)
        if (bye_rank < 0 && (w.peer(r).finished || w.peer(r).closed)) {
          bye_rank = r;
          bye_since = socket_now();
        }
      w.poll_set(nullptr, &fds, &who);
    }
    if (done()) return;
    const double now = socket_now(), waited = now - t0;
    if (bye_rank >= 0 && now - bye_since >= kByeGraceSeconds) {
      std::lock_guard<std::mutex> io(w.io_mu);
      fail_with(call.label + ": " + shut_down_cause(bye_rank));
    }
    if (now >= deadline) {
      std::lock_guard<std::mutex> io(w.io_mu);
      std::ostringstream cause;
      cause << call.label << ": timed out after " << fixed1(waited) << " s (timeout " << timeout() << " s)";
      // The members asked what they are doing: those in this very call (the device's part is what waits)
      // apart from those elsewhere (the ranks that never reached it).
      std::ostringstream missing, with_us;
      int n_missing = 0, n_with = 0;
      for (const auto& [r, state] : ask(members)) {
        const detail::Liveness::PeerState& st = state.first;
        if (call.p2p_peer < 0 && st.answered && st.comm_id == call.comm_id && st.seq == call.seq)
          with_us << (n_with++ ? ", " : "") << peer_name(r);
        else
          missing << (n_missing++ ? "; " : "") << peer_name(r) << " [" << state.second << "]";
      }
      if (n_missing > 0) cause << "; not heard from: " << missing.str();
      if (n_with > 0) cause << "; reached this call too: " << with_us.str();
      if (n_missing == 0) cause << "; every peer is in this call (a device that stopped, or its transport stalled?)";
      fail_with(cause.str());
    }
    // As the MPI backend's waits: spin, then yield (ranks may outnumber cores), then sleep 50 us, and
    // after 0.1 s 1 ms, so that a long wait costs no CPU.
    if (iter < 16) continue;
    if (waited < 2e-3 || fds.empty()) {
      sched_yield();
      continue;
    }
    const double s = waited < 0.1 ? 5e-5 : 1e-3;
    const timespec ts{0, long(s * 1e9)};
    (void)ppoll(fds.data(), nfds_t(fds.size()), &ts, nullptr);
  }
}

void TcpComm::do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                              const int64_t* recv_bytes, const int64_t* recv_displs, OpKind kind) {
  const int n = size(), me = rank();
  const char* s = static_cast<const char*>(send);
  char* d = static_cast<char*>(recv);
  Exchange x = exchange(kind);
  // Each rank starts with its next neighbour, so that the ranks do not all write to rank 0 first.
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n, from = (me + n - i) % n;
    x.send(world_rank(to), s + send_displs[to], send_bytes[to]);
    x.recv(world_rank(from), d + recv_displs[from], recv_bytes[from]);
  }
  if (send_bytes[me] > 0) std::memcpy(d + recv_displs[me], s + send_displs[me], size_t(send_bytes[me]));
  run(x);
}

void TcpComm::do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                              const int64_t* recv_displs, OpKind kind) {
  const int n = size(), me = rank();
  char* d = static_cast<char*>(recv);
  Exchange x = exchange(kind);
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n, from = (me + n - i) % n;
    x.send(world_rank(to), send, send_bytes);
    x.recv(world_rank(from), d + recv_displs[from], recv_bytes[from]);
  }
  if (send_bytes > 0 && send != d + recv_displs[me]) std::memcpy(d + recv_displs[me], send, size_t(send_bytes));
  run(x);
}

void TcpComm::do_broadcast(void* buf, int64_t bytes, int root) {
  Exchange x = exchange(OpKind::broadcast);
  if (rank() == root) {
    for (int p = 0; p < size(); ++p)
      if (p != root) x.send(world_rank(p), buf, bytes);
  } else {
    x.recv(world_rank(root), buf, bytes);
  }
  run(x);
}

void TcpComm::do_barrier() {
  Exchange x = exchange(OpKind::barrier);
  for (int p = 0; p < size(); ++p)
    if (p != rank()) {
      x.send(world_rank(p), nullptr, 0);
      x.recv(world_rank(p), nullptr, 0);
    }
  run(x);
}

void TcpComm::do_send(const void* buf, int64_t bytes, int peer, int tag) {
  Exchange x = exchange(OpKind::send, tag);
  x.send(world_rank(peer), buf, bytes);
  run(x);
}

void TcpComm::do_recv(void* buf, int64_t bytes, int peer, int tag) {
  Exchange x = exchange(OpKind::recv, tag);
  x.recv(world_rank(peer), buf, bytes);
  run(x);
}

std::unique_ptr<Communicator> TcpComm::do_split(int color, int key, const std::string& name) {
  const int n = size();
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(size_t(2 * n));
  std::vector<int64_t> bytes(size_t(n), 8), displs(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) displs[size_t(p)] = 8 * p;
  do_all_gather_v(mine, 8, all.data(), bytes.data(), displs.data(), OpKind::split);
  if (color < 0) return nullptr;
  const std::vector<int> members = detail::split_members(all, color);
  std::vector<int> world_ranks;
  int child_rank = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    world_ranks.push_back(world_rank(members[i]));
    if (members[i] == rank()) child_rank = int(i);
  }
  // Every member computes the same id: the collective number and the color agree across them.
  const uint64_t id = rng_mix(rng_mix(id_, collective_seq()), uint64_t(uint32_t(color)));
  return std::make_unique<TcpComm>(world_, child_rank, int(members.size()), name, std::move(world_ranks), id,
                                   timeout());
}

}  // namespace

std::unique_ptr<Communicator> tcp_create(Communicator& rendezvous) {
  check_host_memory(rendezvous, "rendezvous", "tcp_create");
  Communicator& c = rendezvous;
  return tcp_create(c.rank(), c.size(), [&c](const std::string& mine) {
    const int n = c.size();
    std::vector<int64_t> bytes(static_cast<size_t>(n)), displs(static_cast<size_t>(n));
    const int64_t own = int64_t(mine.size());
    c.all_gather(&own, bytes.data(), sizeof(own));
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      displs[size_t(r)] = total;
      total += bytes[size_t(r)];
    }
    std::string all(size_t(total), '\0');
    c.all_gather_v(mine.data(), own, all.data(), bytes, displs);
    std::vector<std::string> out;
    for (int r = 0; r < n; ++r) out.push_back(all.substr(size_t(displs[size_t(r)]), size_t(bytes[size_t(r)])));
    return out;
  });
}

std::unique_ptr<Communicator> tcp_create(int rank, int size, const AddressExchange& exchange) {
  ZERO8_CHECK_ARG(size >= 1, "size", "must be >= 1, got " << size);
  ZERO8_CHECK_ARG(rank >= 0 && rank < size, "rank", rank << " is not a rank of a job of size " << size);
  ZERO8_CHECK_ARG(bool(exchange), "exchange", "an empty function (it must return every rank's contact string)");
  auto world = std::make_shared<TcpWorld>(rank, size);
  world->setup(exchange);
  std::vector<int> identity(size_t(size), 0);
  std::iota(identity.begin(), identity.end(), 0);
  {
    TcpComm setup(world, rank, size, "liveness setup", identity, kMeshSetupId, world->timeout());
    world->live = std::make_unique<detail::Liveness>(
        rank, size, detail::env_comm_ifaddr(), world->timeout(),
        [&setup](const void* mine, void* all, size_t bytes) { setup.all_gather(mine, all, int64_t(bytes)); });
  }
  return std::make_unique<TcpComm>(world, rank, size, "world", std::move(identity), kWorldId, world->timeout());
}

}  // namespace zero8::comm
