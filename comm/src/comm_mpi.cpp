// MPI backend (host buffers; OpenMPI in practice). Why it never hangs:
//  * Every call that waits on other ranks is a nonblocking MPI op (MPI_Ialltoallv, MPI_Iallgatherv,
//    MPI_Ibcast, MPI_Ibarrier, MPI_Isend/Irecv, MPI_Comm_idup) polled with MPI_Test* against a
//    deadline (timeout()), so a stuck or late peer becomes a timeout error, never a hang.
//  * A dead peer is seen through the liveness mesh (liveness.h): the kernel closes a killed
//    process's sockets, so survivors see EOF within milliseconds, while MPI's shared-memory
//    transport would just never complete the request. OpenMPI's mpirun (4.1, default
//    orte_abort_on_non_zero_status=1) kills the remaining ranks about a second after one dies or
//    exits non-zero; the mesh lets every survivor raise and report zero8::Error before that.
//  * The first rank to fail tells every peer why (GIVEUP), so ranks waiting in other calls, or in
//    other sub-communicators, fail at once with that reason instead of timing out one by one.
//  * On a timeout, the rank asks its peers (over the mesh; their watcher threads answer even while
//    their main thread computes or sleeps) what they are doing, and names the ranks not in the call.
//  * A member that shut down normally (destroyed its last communicator: "bye" on the mesh, then it
//    sits in MPI_Finalize) fails a call still waiting on it 1 s later, not at the timeout: the grace
//    lets MPI complete a call whose part the peer finished just before it left.
//  * Mismatched collectives (at the same collective number of a communicator, ranks call different
//    ops): each op has its own duplicate of the communicator (MpiComm::op_comms_, made with
//    MPI_Comm_idup when the communicator is created), because MPI matches collectives by
//    communicator and order alone: on one communicator OpenMPI 4.1.4 matched one rank's
//    MPI_Iallgatherv with another's MPI_Ialltoallv, completing them with wrong data or crashing in
//    libnbc on the truncation. So mismatched calls wait; each rank keeps its last few calls, and on a
//    wait longer than 2 s (then every 5 s), or an MPI error (MPI_ERR_TRUNCATE: the same op with
//    sizes that do not fit), compares them with the members' and names the mismatch. The same op
//    with sizes that fit completes unnoticed (communicator.h says which). Each zero8 communicator
//    thus holds 8 MPI communicators; OpenMPI 4.1 allows 65532 per process.
//  * Errors are returned, not fatal (MPI_ERRORS_RETURN on every communicator, and on MPI_COMM_WORLD
//    when zero8 initialized MPI: OpenMPI reports failed nonblocking collectives there).
// MPI_Init and MPI_Comm_split remain blocking: MPI_Init is bounded by the launcher, and split first
// runs a polled all-gather, so every member is known to have arrived before the blocking call.
#include "comm_mpi.h"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <exception>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "backends.h"
#include "comm_env.h"
#include "zero8/error.h"
#include "zero8/kernels/hd.h"

namespace zero8::comm::detail {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Poll schedule: spin a little (small messages complete in microseconds), then yield (ranks may
// outnumber cores, as in 4-rank tests on a 2-core CI machine), then sleep so a long wait costs no CPU; the
// sleep ends at once when the liveness alarm rings, so a death is reported within microseconds
// (mpirun starts terminating the survivors about a millisecond after a rank dies).
void backoff(Liveness* live, int iter, double waited) {
  if (iter < 16) return;
  if (waited < 2e-3) {
    sched_yield();
    return;
  }
  const double s = waited < 0.1 ? 5e-5 : 1e-3;
  if (live != nullptr) {
    live->wait_alarm(s);
  } else {
    timespec ts{0, long(s * 1e9)};
    nanosleep(&ts, nullptr);
  }
}

std::string fixed1(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << s;
  return os.str();
}

// The world ranks a call waits on: every other member of a collective, or the send/recv peer.
std::vector<int> call_members(const WaitSpec& s) {
  std::vector<int> out;
  if (s.collective) {
    for (size_t r = 0; r < s.world_ranks->size(); ++r)
      if (int(r) != s.comm_rank) out.push_back((*s.world_ranks)[r]);
  } else {
    out.push_back((*s.world_ranks)[size_t(s.p2p_peer)]);
  }
  return out;
}

std::string peer_name(const WaitSpec& s, int world_rank) {
  const std::vector<int>& wr = *s.world_ranks;
  const auto it = std::find(wr.begin(), wr.end(), world_rank);
  if (it == wr.end()) return "world rank " + std::to_string(world_rank) + " (not in this communicator)";
  const int r = int(it - wr.begin());
  std::string name = "rank " + std::to_string(r);
  if (r != world_rank) name += " (world rank " + std::to_string(world_rank) + ")";
  return name;
}

bool alarm_has_death(MpiWorld& w) {
  for (const Liveness::Event& e : w.live->events())
    if (e.died) return true;
  return false;
}

// Why the liveness alarm rang: dead peers first (the root cause), else the first peer that gave up.
std::string alarm_cause(MpiWorld& w, const WaitSpec& s) {
  // A death reaches every survivor within milliseconds; a short grace lets this rank name the dead
  // peer itself even if another survivor's "giving up" message arrived first.
  for (int i = 0; i < 20 && !alarm_has_death(w); ++i) {
    timespec ts{0, 2000000L};
    nanosleep(&ts, nullptr);
  }
  const std::vector<Liveness::Event> ev = w.live->events();
  std::ostringstream os;
  int deaths = 0;
  for (const Liveness::Event& e : ev) {
    if (!e.died) continue;
    os << (deaths++ ? "; " : "");
    if (e.lost)
      os << Liveness::lost_text(e, peer_name(s, e.rank));
    else
      os << peer_name(s, e.rank)
         << " died (its connection closed without a clean shutdown: the process was killed or crashed)";
  }
  if (deaths > 0) return os.str();
  for (const Liveness::Event& e : ev) return peer_name(s, e.rank) + " gave up: " + e.reason;
  return "liveness alarm without an event";
}

// all_gather and all_gather_v (all_to_all and all_to_all_v) are one MPI collective, which ranks may
// mix with matching sizes: not a mismatch.
std::string op_family(const std::string& op) {
  if (op.size() > 2 && op.compare(op.size() - 2, 2, "_v") == 0) return op.substr(0, op.size() - 2);
  return op;
}

// "mismatched collectives: this rank called X, rank 1 called Y" when a member made another operation
// than this rank at the same place (communicator and collective number) among their recent calls
// (one rank alone in engine.save_checkpoint, a collective under a rank-dependent `if`); else "".
// The earlier call may have completed on both sides (MPI matched their messages): the mismatch then
// shows in a later call, which is why whole histories are compared, not just the current calls.
std::string mismatch_cause(MpiWorld& w, const WaitSpec& s, double wait_s) {
  if (!w.live || !s.collective || s.op.empty()) return "";
  const std::vector<Liveness::CallRecord> mine = w.live->recent_calls();
  std::vector<std::pair<size_t, std::string>> found;  // (index in mine, "rank 1 called Y")
  for (const Liveness::PeerState& st : w.live->query(call_members(s), wait_s)) {
    if (!st.answered) continue;
    // The earliest divergence is the cause; later ones follow from it.
    [&] {
      for (size_t i = 0; i < mine.size(); ++i)
        for (const Liveness::CallRecord& c : st.recent)
          if (c.comm_id == mine[i].comm_id && c.seq == mine[i].seq && op_family(c.op) != op_family(mine[i].op)) {
            found.emplace_back(i, peer_name(s, st.rank) + " called " + c.call);
            return;
          }
    }();
  }
  if (found.empty()) return "";
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string out = "mismatched collectives";
  for (size_t k = 0; k < found.size(); ++k) {
    if (k == 0 || found[k].first != found[k - 1].first)
      out += (k == 0 ? ": this rank called " : "; this rank called ") + mine[found[k].first].call;
    out += ", " + found[k].second;
  }
  return out;
}

std::string timeout_cause(MpiWorld& w, const WaitSpec& s, double waited) {
  std::ostringstream os;
  os << "timed out after " << fixed1(waited) << " s (timeout " << s.timeout_s << " s)";
  if (!w.live) return os.str();
  const std::vector<int> ask = call_members(s);
  const double wait_s = Liveness::query_wait(s.timeout_s);
  std::ostringstream missing, with_us;
  int n_missing = 0, n_with = 0;
  for (const Liveness::PeerState& st : w.live->query(ask, wait_s)) {
    const std::string who = peer_name(s, st.rank);
    if (st.dead) {
      missing << (n_missing++ ? "; " : "") << who << (st.lost ? " (lost: its host stopped answering)" : " (died)");
    } else if (st.finished) {
      missing << (n_missing++ ? "; " : "") << who << " (has already shut down its communicators)";
    } else if (!st.answered) {
      missing << (n_missing++ ? "; " : "") << who << " (no answer to a status query within " << fixed1(wait_s) << " s)";
    } else if (s.collective && st.comm_id == s.comm_id && st.seq == s.seq && op_family(st.op) == op_family(s.op)) {
      // In this call, or already out of it (failed like us, or done with its part): not the culprit.
      with_us << (n_with++ ? ", " : "") << who;
    } else {
      missing << (n_missing++ ? "; " : "") << who << " (" << st.text << ")";
    }
  }
  if (!s.collective) {
    os << "; peer " << missing.str() << with_us.str();
  } else {
    if (n_missing > 0) os << "; not heard from: " << missing.str();
    if (n_with > 0) os << "; reached this call too: " << with_us.str();
    if (n_missing == 0) os << "; every peer is in this call (transport stalled?)";
  }
  return os.str();
}

std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  return std::string(buf, size_t(len));
}

// How long a query for what the members do may take (their watcher threads answer in microseconds;
// only a stopped or overloaded process is slower).
constexpr double kQuerySeconds = 0.5;

// A failed MPI call of a collective: MPI's text ("MPI_ERR_TRUNCATE: message truncated") says little;
// ranks that called different collectives at this place are the usual cause, so ask.
std::string mpi_error_cause(MpiWorld& w, const WaitSpec& s, const std::string& what) {
  std::string mismatch = mismatch_cause(w, s, kQuerySeconds);
  if (mismatch.empty() && s.collective && !s.op.empty()) {
    // The peer whose message failed ours has started its call, but may not have recorded it yet
    // (it starts the MPI op, then waits): ask once more.
    timespec ts{0, 100000000L};
    nanosleep(&ts, nullptr);
    mismatch = mismatch_cause(w, s, kQuerySeconds);
  }
  std::string cause = mismatch.empty() ? what : mismatch + " (" + what + ")";
  if (w.live && w.live->alarm()) cause += "; " + alarm_cause(w, s);
  return cause;
}

// MPI counts are int: move data in units of the largest power of two (<= 1 MiB) that divides every
// count and displacement, so chunks beyond 2 GiB still work when they are aligned.
struct ByteUnit {
  int64_t bytes = 1;
  MPI_Datatype type = MPI_BYTE;
  ByteUnit(const std::vector<const int64_t*>& arrays, int n, const char* what) {
    int64_t all_bits = 0, max_v = 0;
    for (const int64_t* a : arrays)
      for (int i = 0; i < n; ++i) {
        all_bits |= a[i];
        max_v = std::max(max_v, a[i]);
      }
    if (max_v <= INT_MAX) return;
    bytes = all_bits == 0 ? 1 : std::min<int64_t>(all_bits & -all_bits, int64_t(1) << 20);
    if (max_v / bytes > INT_MAX)
      ZERO8_THROW(unsupported, what << ": chunks of " << max_v << " bytes are not aligned enough for MPI's int "
                                    << "counts; use chunks of at most 2 GiB or multiples of 1 MiB");
    MPI_Type_contiguous(int(bytes), MPI_BYTE, &type);
    MPI_Type_commit(&type);
  }
  ~ByteUnit() {
    if (type != MPI_BYTE) MPI_Type_free(&type);  // deferred by MPI until pending ops finish
  }
  std::vector<int> ints(const int64_t* a, int n) const {
    std::vector<int> out(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) out[size_t(i)] = int(a[i] / bytes);
    return out;
  }
};

// After a failure, how long the last communicator's destruction waits for the other ranks to give
// up too (bounded: a stalled peer never will), and the extra time it leaves them to print. Long
// enough for a rank that stalled just past the timeout (a slow file write, a loaded host) to come
// back, find our reason and print its own side before mpirun ends the job.
constexpr double kLingerSeconds = 5.0;
constexpr double kLingerGraceSeconds = 0.2;

// A wait looks this often for members that said "bye" (an atomic load unless one has).
constexpr double kPeerCheckSeconds = 0.02;
// A member that shut down normally may have completed its part of this call just before: MPI still
// completes ours (the data is on its way; MPI_Finalize keeps progressing). After this long, and this
// many polls (a rank that got no CPU meanwhile has not polled), it never will.
constexpr double kByeGraceSeconds = 1.0;
constexpr int kByeGracePolls = 100;
// A wait this long asks the members whether one is in another collective at this call's place,
// then again at this interval (they may arrive there later).
constexpr double kMismatchFirstSeconds = 2.0;
constexpr double kMismatchEverySeconds = 5.0;

// Point-to-point and broadcast move big buffers in pieces MPI's int count can describe.
constexpr int64_t kPieceBytes = int64_t(1) << 30;

int comm_rank_of(MPI_Comm c) {
  int r = 0;
  MPI_Comm_rank(c, &r);
  return r;
}
int comm_size_of(MPI_Comm c) {
  int n = 0;
  MPI_Comm_size(c, &n);
  return n;
}

}  // namespace

[[noreturn]] void mpi_fail(MpiWorld& w, const WaitSpec& spec, const std::string& cause) {
  const std::string msg = spec.label + ": " + cause;
  if (w.failure.empty()) w.failure = msg;
  if (w.live) w.live->give_up(msg);
  ZERO8_THROW(comm, msg);
}

void mpi_wait(MpiWorld& w, const WaitSpec& spec, const std::function<bool()>& done) {
  const double t0 = now_s(), deadline = t0 + spec.timeout_s;
  if (w.live) w.live->op_begin(spec.comm_id, spec.seq, spec.op, spec.call, spec.label);
  struct End {
    Liveness* live;
    int exceptions;
    ~End() {
      if (live) live->op_end(std::uncaught_exceptions() > exceptions);
    }
  } end{w.live.get(), std::uncaught_exceptions()};
  double next_check = t0 + kPeerCheckSeconds, next_query = t0 + kMismatchFirstSeconds;
  double bye_since = 0.0;
  int bye_rank = -1, bye_iter = 0;
  for (int iter = 0;; ++iter) {
    // Checked before done(): once a peer has died or given up, every later call fails, even one
    // that could complete locally (an eager send), so no rank carries on alone.
    if (w.live && w.live->alarm()) {
      std::string cause = alarm_cause(w, spec);
      // Peers only gave up (one found a mismatch, say, while this rank waits in the other
      // collective): a mismatch this rank is part of is named from its side ("this rank called").
      if (!alarm_has_death(w)) {
        const std::string mismatch = mismatch_cause(w, spec, kQuerySeconds);
        if (!mismatch.empty()) cause = mismatch;
      }
      mpi_fail(w, spec, cause);
    }
    if (done()) return;
    const double t = now_s();
    if (t > deadline) mpi_fail(w, spec, timeout_cause(w, spec, t - t0));
    if (w.live && t >= next_check) {
      next_check = t + kPeerCheckSeconds;
      if (bye_rank < 0 && w.live->peers_finished() > 0)
        for (int r : call_members(spec))
          if (w.live->peer_finished(r)) {
            bye_rank = r;
            bye_since = t;
            bye_iter = iter;
            break;
          }
      if (bye_rank >= 0 && t - bye_since >= kByeGraceSeconds && iter - bye_iter >= kByeGracePolls)
        mpi_fail(w, spec, peer_name(spec, bye_rank) + " has shut down its communicators (it ended without joining this call)");
      if (t >= next_query) {
        next_query = t + kMismatchEverySeconds;
        const std::string mismatch = mismatch_cause(w, spec, kQuerySeconds);
        if (!mismatch.empty()) mpi_fail(w, spec, mismatch);
      }
    }
    backoff(w.live.get(), iter, t - t0);
  }
}

// ---- MpiWorld ----

std::shared_ptr<MpiWorld> MpiWorld::acquire() {
  static std::mutex mu;
  static std::weak_ptr<MpiWorld> current;
  std::lock_guard<std::mutex> lk(mu);
  if (std::shared_ptr<MpiWorld> w = current.lock()) return w;
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (finalized)
    ZERO8_THROW(comm, "MPI backend: MPI was already finalized (the last MPI communicator was destroyed); "
                      "keep one alive for the whole program");
  std::shared_ptr<MpiWorld> w(new MpiWorld());
  if (!inited) {
    // One thread at a time calls MPI, not always the same one (a sharded optimizer's thread reduces
    // gradients while the caller runs backward: sharded.h, "Overlap"); the liveness watcher uses plain
    // sockets.
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
      ZERO8_THROW(comm, "MPI backend: MPI_Init_thread failed");
    w->owns_mpi = true;
    // OpenMPI 4.1 reports a failed nonblocking collective (MPI_ERR_TRUNCATE when ranks call
    // mismatched collectives) to MPI_COMM_WORLD's handler, not the request's communicator's: with the
    // default one, MPI_Testall would abort the process instead of returning the error to us.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  MPI_Query_thread(&w->thread_level);  // MPI_Init_thread's grant, or the level of whoever initialized MPI
  MPI_Comm_rank(MPI_COMM_WORLD, &w->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w->size);
  const double timeout = env_comm_timeout();
  std::vector<int> identity(static_cast<size_t>(w->size));
  std::iota(identity.begin(), identity.end(), 0);
  WaitSpec spec;
  spec.label = "MPI backend setup (rank " + std::to_string(w->rank) + " of " + std::to_string(w->size) + ")";
  spec.timeout_s = timeout;
  spec.world_ranks = &identity;
  spec.comm_rank = w->rank;
  {
    MPI_Request req;
    MPI_Comm_idup(MPI_COMM_WORLD, &w->comm, &req);
    mpi_wait(*w, spec, [&] {
      int flag = 0;
      MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      return flag != 0;
    });
    MPI_Comm_set_errhandler(w->comm, MPI_ERRORS_RETURN);
  }
  MpiWorld* raw = w.get();
  w->live = std::make_unique<Liveness>(
      w->rank, w->size, env_comm_ifaddr(), timeout, [&](const void* mine, void* all, size_t bytes) {
        MPI_Request req;
        MPI_Iallgather(mine, int(bytes), MPI_BYTE, all, int(bytes), MPI_BYTE, raw->comm, &req);
        mpi_wait(*raw, spec, [&] {
          int flag = 0;
          MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
          return flag != 0;
        });
      });
  current = w;
  return w;
}

MpiWorld::~MpiWorld() {
  if (forked()) return;  // a fork()ed child exiting normally: MPI and the mesh are the parent's
  const bool healthy = failure.empty();
  // Failed: give the other survivors time to raise and print their own errors before this
  // process exits (its non-zero exit makes mpirun kill every rank still running).
  if (!healthy && live) live->linger(kLingerSeconds, kLingerGraceSeconds);
  live.reset();  // healthy: peers get "bye"; failed: peers already got our reason
  // After a failure MPI may block on the dead peer (MPI_Finalize synchronizes): leave MPI alone;
  // the process is expected to exit non-zero right away.
  if (!healthy) return;
  if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  if (owns_mpi) MPI_Finalize();
}

// ---- MpiComm ----

MpiComm::MpiComm(std::shared_ptr<MpiWorld> world, MPI_Comm comm, std::string name, std::vector<int> world_ranks,
                 uint64_t id, double timeout_s)
    : HostComm(comm_rank_of(comm), comm_size_of(comm), std::move(name), std::move(world_ranks), timeout_s),
      world_(std::move(world)),
      comm_(comm),
      id_(id) {
  op_comms_.fill(MPI_COMM_NULL);
  // Every member creates comm_ in the same call (comm_create, split), then its duplicates here in
  // the same order.
  WaitSpec spec;
  spec.label = "creating MPI communicator '" + this->name() + "' (rank " + std::to_string(rank()) + " of " +
               std::to_string(size()) + ")";
  spec.call = spec.label;
  spec.comm_id = id_;
  spec.timeout_s = timeout();
  spec.world_ranks = &this->world_ranks();
  spec.comm_rank = rank();
  for (MPI_Comm& c : op_comms_) {
    MPI_Request req;
    if (MPI_Comm_idup(comm_, &c, &req) != MPI_SUCCESS) mpi_fail(*world_, spec, "MPI_Comm_idup failed");
    mpi_wait(*world_, spec, [&] {
      int flag = 0;
      MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      return flag != 0;
    });
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  }
}

MpiComm::~MpiComm() {
  if (failed()) return;  // requests of the failed call may still reference them
  if (forked()) return;  // the communicators belong to the parent process
  for (MPI_Comm& c : op_comms_)
    if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

MPI_Comm MpiComm::mpi_comm(OpKind kind) const {
  switch (kind) {
    case OpKind::all_to_all:
    case OpKind::all_to_all_v: return op_comms_[0];
    case OpKind::all_gather:
    case OpKind::all_gather_v: return op_comms_[1];
    case OpKind::reduce_scatter: return op_comms_[2];
    case OpKind::all_reduce: return op_comms_[3];
    case OpKind::broadcast: return op_comms_[4];
    case OpKind::barrier: return op_comms_[5];
    case OpKind::split: return op_comms_[6];
    case OpKind::send:
    case OpKind::recv:
    case OpKind::sync: break;
  }
  return comm_;
}

std::string MpiComm::description() const {
  std::ostringstream os;
  os << "mpi communicator '" << name() << "' (rank " << rank() << " of " << size() << ", world rank "
     << world_rank(rank()) << " of " << world_->size << ", host " << host_name() << ", liveness "
     << (world_->live ? world_->live->address() : std::string("-")) << ", timeout " << timeout() << " s)";
  return os.str();
}

void MpiComm::abort(int exit_code) {
  if (forked()) std::_Exit(exit_code);  // MPI_Abort here would end the parent's whole job
  MPI_Abort(comm_, exit_code);
  std::_Exit(exit_code);
}

void MpiComm::set_failed(const std::string& reason) {
  if (world_->failure.empty()) world_->failure = reason;
}

WaitSpec MpiComm::wait_spec(OpKind kind, int p2p_peer) const {
  WaitSpec s;
  s.label = op_label(kind);
  s.call = op_call(kind);
  s.comm_id = id_;
  s.seq = collective_seq();
  s.collective = kind != OpKind::send && kind != OpKind::recv;
  s.op = s.collective ? op_kind_name(kind) : "";
  s.timeout_s = timeout();
  s.world_ranks = &world_ranks();
  s.comm_rank = rank();
  s.p2p_peer = p2p_peer;
  return s;
}

void MpiComm::check_mpi(int rc, OpKind kind, const char* call) {
  if (rc == MPI_SUCCESS) return;
  const WaitSpec spec = wait_spec(kind);
  mpi_fail(*world_, spec, mpi_error_cause(*world_, spec, std::string(call) + " failed: " + mpi_error_text(rc)));
}

void MpiComm::wait_requests(std::vector<MPI_Request>& reqs, OpKind kind, int p2p_peer) {
  const WaitSpec spec = wait_spec(kind, p2p_peer);
  std::vector<MPI_Status> st(reqs.size());
  mpi_wait(*world_, spec, [&] {
    int flag = 0;
    int rc = MPI_Testall(int(reqs.size()), reqs.data(), &flag, st.data());
    if (rc == MPI_ERR_IN_STATUS)  // the request's own error says more ("MPI_ERR_TRUNCATE")
      for (const MPI_Status& x : st)
        if (x.MPI_ERROR != MPI_SUCCESS && x.MPI_ERROR != MPI_ERR_PENDING) {
          rc = x.MPI_ERROR;
          break;
        }
    if (rc != MPI_SUCCESS)
      mpi_fail(*world_, spec, mpi_error_cause(*world_, spec, "MPI_Testall failed: " + mpi_error_text(rc)));
    return flag != 0;
  });
}

void MpiComm::do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                              const int64_t* recv_bytes, const int64_t* recv_displs, OpKind kind) {
  const int n = size();
  ByteUnit u({send_bytes, send_displs, recv_bytes, recv_displs}, n, op_kind_name(kind));
  const std::vector<int> sc = u.ints(send_bytes, n), sd = u.ints(send_displs, n);
  const std::vector<int> rc = u.ints(recv_bytes, n), rd = u.ints(recv_displs, n);
  std::vector<MPI_Request> reqs(1);
  check_mpi(MPI_Ialltoallv(send, sc.data(), sd.data(), u.type, recv, rc.data(), rd.data(), u.type, mpi_comm(kind),
                          &reqs[0]),
            kind, "MPI_Ialltoallv");
  wait_requests(reqs, kind);
}

void MpiComm::do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                              const int64_t* recv_displs, OpKind kind) {
  const int n = size();
  ByteUnit u({recv_bytes, recv_displs}, n, op_kind_name(kind));
  const std::vector<int> rc = u.ints(recv_bytes, n), rd = u.ints(recv_displs, n);
  const bool in_place = send == static_cast<const char*>(recv) + recv_displs[rank()];
  std::vector<MPI_Request> reqs(1);
  check_mpi(MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, int(send_bytes / u.bytes), u.type, recv, rc.data(),
                            rd.data(), u.type, mpi_comm(kind), &reqs[0]),
            kind, "MPI_Iallgatherv");
  wait_requests(reqs, kind);
}

void MpiComm::do_broadcast(void* buf, int64_t bytes, int root) {
  int64_t off = 0;
  do {
    const int64_t piece = std::min(kPieceBytes, bytes - off);
    std::vector<MPI_Request> reqs(1);
    check_mpi(MPI_Ibcast(static_cast<char*>(buf) + off, int(piece), MPI_BYTE, root, mpi_comm(OpKind::broadcast),
                         &reqs[0]),
              OpKind::broadcast, "MPI_Ibcast");
    wait_requests(reqs, OpKind::broadcast);
    off += piece;
  } while (off < bytes);
}

void MpiComm::do_barrier() {
  std::vector<MPI_Request> reqs(1);
  check_mpi(MPI_Ibarrier(mpi_comm(OpKind::barrier), &reqs[0]), OpKind::barrier, "MPI_Ibarrier");
  wait_requests(reqs, OpKind::barrier);
}

void MpiComm::do_send(const void* buf, int64_t bytes, int peer, int tag) {
  int64_t off = 0;
  do {
    const int64_t piece = std::min(kPieceBytes, bytes - off);
    std::vector<MPI_Request> reqs(1);
    check_mpi(MPI_Isend(static_cast<const char*>(buf) + off, int(piece), MPI_BYTE, peer, tag, comm_, &reqs[0]),
              OpKind::send, "MPI_Isend");
    wait_requests(reqs, OpKind::send, peer);
    off += piece;
  } while (off < bytes);
}

void MpiComm::do_recv(void* buf, int64_t bytes, int peer, int tag) {
  int64_t off = 0;
  do {
    const int64_t piece = std::min(kPieceBytes, bytes - off);
    MPI_Request req;
    check_mpi(MPI_Irecv(static_cast<char*>(buf) + off, int(piece), MPI_BYTE, peer, tag, comm_, &req), OpKind::recv,
              "MPI_Irecv");
    const WaitSpec spec = wait_spec(OpKind::recv, peer);
    MPI_Status st;
    mpi_wait(*world_, spec, [&] {
      int flag = 0;
      const int rc = MPI_Test(&req, &flag, &st);
      if (rc != MPI_SUCCESS)
        mpi_fail(*world_, spec, "receiving " + std::to_string(piece) + " bytes from rank " + std::to_string(peer) +
                                    " failed (the sender sent more?): " + mpi_error_text(rc));
      return flag != 0;
    });
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    if (got != piece)
      mpi_fail(*world_, spec, "expected " + std::to_string(piece) + " bytes from rank " + std::to_string(peer) +
                                  ", the message had " + std::to_string(got));
    off += piece;
  } while (off < bytes);
}

std::unique_ptr<Communicator> MpiComm::do_split(int color, int key, const std::string& name) {
  const int n = size();
  // A polled all-gather first: a dead or absent member fails here, not inside MPI_Comm_split.
  int32_t mine[2] = {color, key};
  std::vector<int32_t> all(static_cast<size_t>(2 * n));
  std::vector<int64_t> rb(size_t(n), 8), rd(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) rd[size_t(p)] = 8 * p;
  do_all_gather_v(mine, 8, all.data(), rb.data(), rd.data(), OpKind::split);
  MPI_Comm child = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(mpi_comm(OpKind::split), color < 0 ? MPI_UNDEFINED : color, key, &child), OpKind::split,
            "MPI_Comm_split");
  if (color < 0) return nullptr;
  // MPI orders a split's ranks by (key, old rank); so do we.
  std::vector<int> wr;
  for (int p : split_members(all, color)) wr.push_back(world_rank(p));
  MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN);
  // Keyed by the collective number, which every member agrees on (seq() also counts send/recv).
  const uint64_t id = rng_mix(rng_mix(id_, collective_seq()), uint64_t(color));
  auto c = std::make_unique<MpiComm>(world_, child, name, wr, id, timeout());
  ZERO8_ASSERT(c->world_rank(c->rank()) == world_rank(rank()));
  return c;
}

WaitSpec MpiComm::device_spec(const DeviceCall& call) const {
  WaitSpec s = wait_spec(call.kind, call.p2p_peer);
  s.label = call.label;
  s.call = call.call;
  s.seq = call.seq;
  s.comm_id = call.comm_id;
  return s;
}

void MpiComm::watch(const DeviceCall& call, const std::function<bool()>& done) {
  mpi_wait(*world_, device_spec(call), done);
}

void MpiComm::fail_call(const DeviceCall& call, const std::string& cause) {
  mpi_fail(*world_, device_spec(call), cause);
}

std::unique_ptr<Communicator> mpi_create() {
  std::shared_ptr<MpiWorld> w = MpiWorld::acquire();
  // Each world communicator gets its own duplicate, so two of them never mix their messages.
  static uint64_t created = 0;
  const uint64_t id = rng_mix(1, ++created);  // communicator ids: the same mixer as the seeds
  std::vector<int> identity(static_cast<size_t>(w->size));
  std::iota(identity.begin(), identity.end(), 0);
  WaitSpec spec;
  spec.label = "comm_create(\"mpi\") (rank " + std::to_string(w->rank) + " of " + std::to_string(w->size) + ")";
  spec.timeout_s = env_comm_timeout();
  spec.world_ranks = &identity;
  spec.comm_rank = w->rank;
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  MPI_Comm_idup(w->comm, &dup, &req);
  mpi_wait(*w, spec, [&] {
    int flag = 0;
    MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  });
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return std::make_unique<MpiComm>(w, dup, "world", identity, id, spec.timeout_s);
}

}  // namespace zero8::comm::detail
