// Peer liveness for multi-process backends (MPI; tcp for its status queries): one TCP connection
// between every pair of ranks, watched by a background thread. A process that dies (even by SIGKILL)
// has its sockets closed by the kernel, so its peers see EOF at once; a rank that gives up tells the
// others why; and on a timeout a rank can ask every peer what it is doing, to name the ranks it is
// waiting for. A peer whose host stops answering at the TCP level (a network partition, a host that
// went down) closes nothing: TCP keepalive and TCP_USER_TIMEOUT end such a connection after
// ZERO8_COMM_LINK_TIMEOUT seconds, and the peer is then reported lost. A stopped or busy process is
// not lost: its kernel answers.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zero8::comm::detail {

// Writes the mesh's frames to one peer's socket, never blocking a call longer than its timeout and
// never leaving a part of a frame in the stream followed by another frame. A peer that stops
// reading (SIGSTOP, a debugger) fills its receive buffer; send() may then take only part of a frame
// before the timeout. The unsent tail is kept here and goes out first on the next call, so the peer
// reads whole frames in order; a frame that arrives while a tail is still pending is dropped whole
// (the mesh's frames are notices and queries, each useful alone). Not thread-safe: the caller holds
// the peer's send mutex.
class FrameSender {
 public:
  // Sends `frame` (one whole frame) to fd within timeout_s. Returns false if the frame was dropped
  // (an earlier tail still pending) or the connection failed; a frame sent in part returns true,
  // its tail pending.
  bool send(int fd, const std::string& frame, double timeout_s);
  size_t pending() const { return unsent_.size(); }

 private:
  std::string unsent_;  // the tail of the last frame the socket did not take in time
};

class Liveness {
 public:
  // all_gather(mine, all, bytes): the backend's own all-gather of a fixed-size record (used once,
  // to exchange listening addresses). ifaddr: IPv4 address to listen on ("" = default, see .cpp).
  using AllGather = std::function<void(const void* mine, void* all, size_t bytes)>;
  Liveness(int rank, int size, const std::string& ifaddr, double timeout_s, const AllGather& all_gather);
  ~Liveness();  // tells peers "bye" (a clean exit, not a death) unless this rank has failed
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& address() const { return address_; }  // "ip:port" this rank listens on

  // What the main thread is doing, for peers' queries. comm_id/seq identify a collective call
  // across ranks; op is its operation ("all_reduce"; "" for calls that peers must not compare, as
  // send/recv), call its name without this rank's place ("all_reduce #3 on 'world'"), label the
  // full name for messages ("all_reduce #3 on 'world' (rank 1 of 4)").
  void op_begin(uint64_t comm_id, uint64_t seq, const std::string& op, const std::string& call,
                const std::string& label);
  void op_end(bool failed);
  // op_begin for a caller whose calls take microseconds (the tcp backend): the call by its parts, its
  // names ("all_reduce #3 on 'world'", and with " (rank 1 of 4)") made only when a peer asks. op must be
  // a static string (op_kind_name's). Not kept in recent_calls() (the tcp backend compares calls itself).
  void op_begin_parts(uint64_t comm_id, uint64_t seq, const char* op, uint64_t call_no, const std::string& comm_name,
                      int rank, int size);

  // This rank's latest calls with an op (oldest first, at most kRecentCalls): comparing them with a
  // peer's shows mismatched collectives even after one side's call has completed (MPI matched the
  // two calls' messages) and it has moved on.
  struct CallRecord {
    uint64_t comm_id = 0, seq = 0;
    std::string op, call;
  };
  static constexpr size_t kRecentCalls = 8;
  std::vector<CallRecord> recent_calls() const;

  // True once a peer died or gave up (cheap: an atomic load, polled by wait loops).
  bool alarm() const { return alarm_.load(std::memory_order_acquire); }
  // Sleep up to `seconds`, waking at once when the alarm rings (wait loops' idle phase).
  void wait_alarm(double seconds);

  struct Event {
    int rank = -1;
    bool died = false;       // connection closed without "bye" (else: the peer gave up)
    bool lost = false;       // died because its host stopped answering (died is true too)
    std::string host;        // the peer's host name (for lost)
    std::string reason;      // the peer's own error message when it gave up; for lost: "no TCP
                             // answer for 60 s (network partition, or its host is down)"
  };
  // "lost contact with rank R (host H): no TCP answer for N s (network partition, or its host is
  // down)" for a lost event, with `name` for the peer ("rank 2"; "" = its world rank).
  static std::string lost_text(const Event& e, const std::string& name = std::string());
  std::vector<Event> events() const;
  bool peer_finished(int rank) const;  // said "bye": destroyed its communicator normally
  // How many peers said "bye" (cheap: an atomic load, so wait loops can skip peer_finished()).
  int peers_finished() const { return peers_finished_.load(std::memory_order_acquire); }

  // On a timeout: ask `ranks` what they are doing; waits up to wait_s for their answers.
  struct PeerState {
    int rank = -1;
    bool answered = false;
    bool dead = false;
    bool lost = false;  // dead, because its host stopped answering (see Event::lost)
    bool finished = false;
    bool in_op = false;
    uint64_t comm_id = 0, seq = 0;  // its current or last call
    std::string op, call;           // of that call (see op_begin)
    std::vector<CallRecord> recent; // its recent_calls()
    std::string text;  // "in all_reduce #3 on 'world' (rank 1 of 4) for 2.0 s" / "not in a ..."
  };
  std::vector<PeerState> query(const std::vector<int>& ranks, double wait_s);
  // How long a call that timed out after timeout_s waits for those answers: a tenth of it, within
  // [0.5 s, 2 s]. Watcher threads answer in microseconds, but on a host whose cores are all busy
  // (data-loader workers, a sanitizer build) a few hundred milliseconds can pass before one runs.
  static double query_wait(double timeout_s) { return std::min(2.0, std::max(0.5, timeout_s * 0.1)); }

  // This rank gives up: every live peer gets `reason`; no "bye" will be sent.
  void give_up(const std::string& reason);
  // After giving up: wait (at most max_s) until every peer has given up, exited or finished, then
  // grace_s more. A failing job's first rank to exit makes mpirun kill the rest at once; lingering
  // lets every survivor raise and report its own error first.
  void linger(double max_s, double grace_s);

  // In a fork()ed child (a data-loader worker): close the inherited sockets, so that this
  // process's death is not hidden from its peers by a child holding copies, and do nothing else.
  // Their numbers are forgotten too: files the child opens later reuse them.
  void forget_after_fork();
  // In a fork()ed child: throws Error(comm) saying that the communicator (`label`: the call)
  // belongs to the parent process; its mesh and MPI state cannot be used here. Else nothing.
  void check_not_forked(const std::string& label) const;
  bool forked() const { return forked_; }  // this process is a fork()ed child of the mesh's owner

 private:
  struct Peer {
    int fd = -1;
    std::mutex send_mu;
    FrameSender sender;  // guarded by send_mu
    std::vector<char> inbuf;
    bool finished = false;  // said "bye"
    bool gave_up = false;   // sent its reason: its exit that follows is not a death
    bool closed = false;
    bool lost = false;      // closed because its host stopped answering
    std::string host;       // its host name, from the address exchange
  };
  void setup(const std::string& ifaddr, double timeout_s, const AllGather& all_gather);
  void run();  // the watcher thread
  bool handle_frame(int peer, uint32_t type, const char* payload, uint32_t len);
  void send_frame(int peer, uint32_t type, const std::string& payload);
  std::string state_text_locked(double now) const;

  int rank_, size_;
  int link_timeout_s_ = 0;  // ZERO8_COMM_LINK_TIMEOUT
  std::string address_;
  std::vector<Peer> peers_;
  int wake_[2] = {-1, -1};
  std::unique_ptr<std::thread> thread_;  // released (never joined) in a forked child
  bool forked_ = false;  // set in a fork()ed child (the only thread there)
  int slot_ = -1;        // in the process's table of meshes (for the fork handler)
  int owner_pid_ = 0;    // the process that created the mesh
  std::atomic<bool> alarm_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int> peers_finished_{0};
  bool gave_up_ = false;

  mutable std::mutex mu_;  // guards everything below and Peer::finished/closed
  std::condition_variable cv_;
  std::vector<Event> events_;
  bool in_op_ = false;
  bool op_failed_ = false;
  uint64_t op_comm_ = 0, op_seq_ = 0;
  std::string op_name_, op_call_, op_label_;
  // The parts of an op_begin_parts call, named into op_name_/op_call_/op_label_ when a peer asks.
  struct OpParts {
    bool pending = false;
    const char* op = "";
    uint64_t call_no = 0;
    std::string comm_name;
    int rank = 0, size = 0;
  } parts_;
  void name_parts_locked();
  void begin_locked(uint64_t comm_id, uint64_t seq, bool by_parts);  // what both op_begins record
  std::vector<CallRecord> recent_;
  double op_since_ = 0.0;
  uint64_t next_query_ = 1;
  std::map<uint64_t, std::map<int, PeerState>> answers_;
};

}  // namespace zero8::comm::detail
