// zero8::comm::Communicator: the collectives the sharded optimizer and the pipeline engine need
// (all-to-all, all-gather, reduce-scatter, all-reduce, broadcast, barrier, send/recv), byte counters,
// sub-communicators for a pp x dp topology and node groups, and the failure contract (no call hangs).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zero8/kernels/device.h"

namespace zero8::comm {

// ---------------------------------------------------------------------------------------------
// Contract (every backend)
//
// * Blocking: every call returns when this rank's part is complete: send buffers may be reused and
//   receive buffers hold the result. Nothing is left in flight between calls (the NCCL backend
//   enqueues on its stream and waits for it too, see comm_nccl.cpp). The one exception is asked for by
//   name: send_queued/recv_queued on a stream (below), for pipeline stages on GPUs.
// * Collective: every rank of the communicator calls the same collectives in the same order with
//   matching sizes (as in MPI). Sizes are validated locally; a mismatch across ranks is a usage error
//   that the transport may report as a comm error or a timeout. The MPI backend names ranks that
//   called a different collective at the same place ("mismatched collectives: this rank called
//   all_gather #12 on 'world', rank 1 called all_to_all_v #12 on 'world'"), whatever the sizes:
//   each op runs on its own MPI communicator (all_to_all and all_to_all_v share one, as all_gather
//   and all_gather_v do), so MPI never matches one op's messages with another's and the calls wait;
//   after 2 s the ranks compare their last few calls. Not detected: the same op with different sizes
//   (the _v and plain forms count as one op). Sizes that fit each other complete with wrong data and
//   are never named; others fail in MPI (MPI_ERR_TRUNCATE, raised naming the call; OpenMPI 4.1 can
//   crash instead on a large truncated message, see docs/LAUNCH.md). A broadcast root may return
//   before the others call it, so a broadcast swapped with the next collective can complete. (MPI
//   collectives carry no sizes to compare; checking every call would cost an extra exchange.)
// * Memory: buffers belong to the caller and must stay valid for the call. memory() says which memory
//   the backend moves itself: host (single, MPI, tcp) or device (NCCL). Send and receive buffers must
//   not overlap, except where an op says "in place".
//   Device buffers on a host backend: the single backend copies them itself (cudaMemcpyAsync); the MPI
//   and tcp backends stage them through page-locked host memory (cudaMallocHost, one scratch per
//   communicator, reused): the device inputs are copied out, the transport runs on the copies, the
//   results are copied back.
//   Each pointer is looked at (cudaPointerGetAttributes: device and managed memory are staged, host
//   memory, pageable or page-locked, is used as it is), so host buffers keep their direct path and cost
//   (no query at all in a build without CUDA, a process without a device, or one without a CUDA
//   context, where asking would make one; see device::memory_kind). Correct but slow: it is how
//   two processes sharing one GPU run the device code path (NCCL refuses two ranks on one device).
//   NCCL takes device (or managed) buffers only: a host pointer is Error(invalid_argument) naming the
//   argument. Code that passes std::vector or stack values to a communicator that may be NCCL checks
//   check_host_memory() first, or uses all_gather_host / all_reduce_host below.
// * Streams (device buffers): set_stream(s) makes every later call enqueue its device work (NCCL's
//   kernels, the staging and single-backend copies) on the CUDA stream s, after the work already there,
//   and wait for it before returning (the blocking contract above); s is the caller's stream
//   (torch.cuda.current_stream().cuda_stream), so buffers that earlier work on s writes need no
//   synchronization, and the call's results are complete for the host and for every stream. Without a
//   stream (nullptr, the default) the copies run on the legacy default stream (stream 0: torch's default
//   stream, zero8's *_cuda functions with stream nullptr), and the NCCL backend runs on a stream of its
//   own that it makes wait for the legacy default stream before each call (which itself waits for
//   blocking streams), so it never runs its kernels on the legacy stream. Either way, buffers written on
//   another non-blocking stream must be synchronized by the caller first. Children inherit the stream at
//   split; set_stream is not a collective (ranks may use different streams).
// * Threads: one thread at a time per communicator (and per world: sub-communicators share it).
//   A call made while another thread's call on the same communicator is still running throws
//   Error(invalid_argument) naming both ("all_reduce called while broadcast is still running on
//   communicator 'world' ... from another thread") and does nothing; the running call completes.
//   (MPI requires every rank to issue a communicator's collectives in one order: threads racing to
//   issue them cannot.) Calls on different communicators of one world from two threads at once are
//   not detected and are not allowed either. One thread at a time, the calls may come from any thread
//   where calls_from_any_thread() (the MPI backend asks MPI for MPI_THREAD_SERIALIZED and says whether
//   it got it; when someone else initialized MPI with less, only the initializing thread may call), if
//   each thread hands the communicator over to the next one with a synchronization (a mutex, a join).
//   Background work (add_background_work below: a sharded optimizer's deferred all-gather, which its
//   thread runs after the caller's step returned) is the one exception the library arranges itself:
//   every public call of any communicator from another thread first waits for it, so the training
//   loop's own collectives (a loss all-reduce) never run beside it.
// * fork(): a child process cannot use its parent's MPI or tcp communicators: every call there throws
//   Error(comm) ("this communicator belongs to process 1234 and cannot be used after fork()"),
//   and the child writes nothing to the parent's connections (see "MPI backend" below; the tcp
//   backend's child closes its copies of the sockets the same way). Destroying them there (a normal
//   exit) leaves MPI and the connections alone, and abort() ends the child only (_Exit).
// * Determinism: reductions of floating values are identical on every rank. The single and MPI
//   backends compute sums as a left fold in rank order, ((x0 + x1) + x2) + ..., so results are
//   reproducible and equal a serial reference; the tcp backend uses the same folds (bit-identical to
//   MPI's); NCCL sums in its own (fixed) ring order.
// * Failure: no call waits forever. If a peer process dies, a peer reports that it gave up, a member
//   shut down normally (destroyed its last communicator) without joining the call (MPI backend: a
//   second later), or the call exceeds timeout() seconds, EVERY surviving rank gets
//   zero8::Error(ErrorCode::comm) naming the call ("all_reduce #12 on 'dp[stage 0]' (rank 1 of 4)"),
//   and the peer(s) responsible or not heard from. The failure is job-wide: a death anywhere in the world fails calls on every
//   communicator (ZeRO has no recovery, and a rank that carried on alone would only time out later),
//   and once a rank has given up, its peers' next calls fail with its reason, even calls that could
//   complete locally. After an error the process must exit with a non-zero status: the failed call's
//   buffers may still be referenced by the transport, and every later call on this communicator,
//   its parent and its children throws again. Destroying the communicators is allowed; the last one
//   of a failed MPI world waits (at most 2 s) until the other ranks have raised their errors too,
//   because mpirun kills every rank still running as soon as one exits non-zero. So: print the
//   error and return non-zero from main. abort() instead kills the other survivors at once, before
//   they can report their own view of the failure.
//
// MPI backend, how failures are seen (details in comm_mpi.cpp): every call that waits on peers is a
// nonblocking MPI op polled with MPI_Test* against the deadline, so a stalled peer becomes a timeout.
// Alongside MPI, each pair of ranks holds a TCP connection (the liveness mesh, set up at creation
// over addresses exchanged with MPI_Allgather, ZERO8_COMM_IFADDR): the kernel closes a killed
// process's sockets, so survivors see EOF within milliseconds (MPI's shared-memory transport would
// just never complete), well inside the ~1 s before OpenMPI's mpirun (4.1, default settings)
// terminates the job. A background thread watches the connections, relays "gave up: <reason>"
// messages, and answers status queries, which is how a timed-out rank names the ranks that are not
// in the call (and what they are doing) even while their main threads compute or sleep. A fork()ed
// child closes its inherited copies, so a data-loader worker cannot hide its parent's death. Use
// mpirun's defaults: `--enable-recovery` keeps survivors alive but makes mpirun exit 0 after
// failures, and `--mca orte_abort_on_non_zero_status 0` leaves mpirun waiting after a death.
//
// Byte counters ("bytes sent") count the payload this rank sends to each other rank under the direct
// algorithm of each op, independent of how the transport routes it (so they are exact and
// comparable across backends): all_to_all(_v): bytes for peer p; all_gather(_v): own bytes to each
// peer; reduce_scatter: peer p's range; all_reduce: the reduce-scatter + all-gather it is (n split
// into size() near-equal parts, part p = [n*p/size, n*(p+1)/size): peer p gets part p and part
// rank()); broadcast: the root sends the buffer to each peer; send: the buffer to the peer;
// recv, barrier, split: 0. Bytes to self are never counted.
// ---------------------------------------------------------------------------------------------

// Environment (read by comm_env.cpp, the one place these are parsed):
//   ZERO8_COMM_TIMEOUT  seconds before a collective gives up (default 600; per communicator: set_timeout)
//   ZERO8_COMM_IFADDR   IPv4 address of this host for the MPI backend's liveness connections and the
//                       tcp backend's connections (default: the address the hostname resolves to,
//                       else 127.0.0.1)
//   ZERO8_COMM_NODE     node name used to form node groups (default: the hostname)

enum class ReduceOp : uint8_t { sum = 0, max = 1, min = 2 };
const char* reduce_op_name(ReduceOp op);

// Element types of reductions (data movement ops take plain bytes).
enum class ScalarType : uint8_t { u8 = 0, i32 = 1, i64 = 2, f32 = 3, f64 = 4 };
const char* scalar_type_name(ScalarType t);
int scalar_type_size(ScalarType t);
template <class T> constexpr ScalarType scalar_type_of();
template <> constexpr ScalarType scalar_type_of<uint8_t>() { return ScalarType::u8; }
template <> constexpr ScalarType scalar_type_of<int32_t>() { return ScalarType::i32; }
template <> constexpr ScalarType scalar_type_of<int64_t>() { return ScalarType::i64; }
template <> constexpr ScalarType scalar_type_of<float>() { return ScalarType::f32; }
template <> constexpr ScalarType scalar_type_of<double>() { return ScalarType::f64; }

using zero8::MemSpace;  // host or device (zero8/kernels/device.h)

enum class OpKind : uint8_t {
  all_to_all = 0, all_to_all_v, all_gather, all_gather_v, reduce_scatter, all_reduce, broadcast,
  barrier, send, recv, split, sync,
};
constexpr int kOpKinds = 12;
const char* op_kind_name(OpKind k);

struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes = 0;                  // sent to other ranks (see "Byte counters" above)
  double seconds = 0.0;                // wall time inside the calls
  std::vector<uint64_t> bytes_to_peer; // size() entries; [rank()] is always 0
};

// A snapshot of a communicator's counters since creation or the last stats_reset().
struct CommStats {
  std::array<OpStats, kOpKinds> ops;
  const OpStats& op(OpKind k) const { return ops[size_t(k)]; }
  uint64_t bytes() const;                     // all kinds
  std::vector<uint64_t> bytes_to_peer() const;  // all kinds, per peer
};

// Node grouping of a communicator (see node_groups()).
struct NodeGroups;
namespace detail {
struct StagingArea;
}
// The pp x dp grouping of a communicator (see topology_split()).
struct Topology;

// Work that thread `runner` does on communicators after the call that started it returned (a sharded
// optimizer's deferred all-gather, sharded.h): a public call of any communicator in this process from
// any other thread first runs `wait`, which must block until that work is done and may not call a
// communicator itself. One entry per owner; remove it once the work is done, and before the owner goes
// away: remove_background_work returns when no other thread is still running the owner's wait (wait may
// run in several threads at once, and may itself remove the entry; it never starts after the removal).
void add_background_work(const void* owner, std::thread::id runner, std::function<void()> wait);
void remove_background_work(const void* owner);

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }  // "world", "dp[stage 1]", ... (set at split)
  virtual std::string description() const = 0;      // backend, name, rank, size, host
  virtual const char* backend() const = 0;           // "single", "mpi", "nccl", "tcp"
  virtual MemSpace memory() const = 0;
  // Whether calls may come from another thread than the one that made the communicator, one thread at
  // a time (see "Threads" above).
  virtual bool calls_from_any_thread() const { return true; }
  // The CUDA device a device-memory backend works on (NCCL: the rank's GPU, chosen at creation as its
  // index among the ranks of its node, modulo the devices); -1 for host backends.
  virtual int device() const { return -1; }
  int world_rank(int r) const { return world_ranks_.at(size_t(r)); }  // rank r in the world communicator
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // Seconds a call may take before every rank raises a timeout error. Children inherit it at split.
  double timeout() const { return timeout_s_; }
  virtual void set_timeout(double seconds);  // the NCCL backend's waits take it to its host communicator

  // Safe to call while another thread's call runs (a sharded optimizer's thread, sharded.h "Overlap").
  CommStats stats() const;
  void stats_reset();

  // The CUDA stream (a cudaStream_t of the current device, as an untyped handle; nullptr: none) that the
  // device-buffer work of later calls is ordered on; see "Streams" above. A non-null stream needs CUDA:
  // Error(unsupported) in a build without it or a process without a device, Error(invalid_argument) for
  // a handle the runtime does not know.
  void set_stream(void* stream);
  void* stream() const { return stream_; }

  // ---- data movement (byte buffers) ----
  // send holds size() chunks of `bytes` each, chunk p goes to rank p; recv chunk p comes from rank p.
  void all_to_all(const void* send, void* recv, int64_t bytes);
  // Chunk p of send is [send_displs[p], +send_bytes[p]); recv chunk p (from rank p) is
  // [recv_displs[p], +recv_bytes[p]). recv_bytes[p] must equal rank p's send_bytes[rank()].
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes,
                    const std::vector<int64_t>& send_displs, void* recv,
                    const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs);
  // recv = concatenation of every rank's `bytes` bytes, in rank order.
  void all_gather(const void* send, void* recv, int64_t bytes);
  // Rank p's send_bytes land at [recv_displs[p], +recv_bytes[p]); send_bytes == recv_bytes[rank()].
  // In place: send == recv + recv_displs[rank()].
  void all_gather_v(const void* send, int64_t send_bytes, void* recv, const std::vector<int64_t>& recv_bytes,
                    const std::vector<int64_t>& recv_displs);
  void broadcast(void* buf, int64_t bytes, int root);

  // ---- reductions ----
  // send holds sum(counts) elements, rank p's range at prefix offsets; recv (counts[rank()] elements)
  // gets the reduction over ranks of this rank's range.
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, ScalarType type,
                      ReduceOp op = ReduceOp::sum);
  // recv = reduction over ranks of send (count elements). In place when send == recv.
  // max/min propagate NaN (a NaN anywhere gives NaN) in the single and MPI backends, so a NaN norm
  // or flag is never lost. Not promised by the NCCL backend: it uses NCCL's own max/min, which do
  // not promise NaN propagation (fmaxf/fminf-style float max/min return the non-NaN operand), so a
  // NaN on one rank can be dropped; reduce an isnan flag, or use sum (NaN + x is NaN), where a NaN
  // must be seen. (Untested: no GPU here.)
  void all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp op);
  template <class T> void all_reduce(T* data, int64_t count, ReduceOp op) {
    all_reduce(data, data, count, scalar_type_of<T>(), op);
  }
  template <class T> T all_reduce_value(T v, ReduceOp op) {
    all_reduce(&v, &v, 1, scalar_type_of<T>(), op);
    return v;
  }

  // ---- synchronization and point-to-point ----
  void barrier();
  // Blocking point-to-point (pipeline stages). Messages between a pair with the same tag arrive in
  // order; recv must name the exact size. tag in [0, 32767].
  void send(const void* buf, int64_t bytes, int peer, int tag = 0);
  void recv(void* buf, int64_t bytes, int peer, int tag = 0);
  // Stream-ordered point-to-point (pipeline stages on GPUs). Where queues_p2p() (the NCCL backend), the
  // transfer is ordered after the work already on the caller's stream (set_stream; without one the legacy
  // default stream, torch's default stream) and the call returns once NCCL has taken it, without waiting
  // for the peer or the transfer. Work queued on that stream later runs after it, so the buffers must
  // stay valid in stream order only, the rule torch's caching allocator keeps for a block freed on its
  // stream; and the host goes on queueing kernels while the message waits for the peer or travels, as
  // torch.distributed's NCCL send and recv let it. (Without a stream the transfer runs on the backend's
  // own stream, after the legacy stream's work, and the legacy stream waits for it: NCCL's kernels never
  // run on the legacy stream, which would hold every blocking stream behind a message.) Tags, order and
  // exact sizes as send/recv. A dead or stalled peer, or an NCCL error, is seen by the next call that
  // waits: sync(), or any other call of this communicator, or of another whose work is ordered after
  // the queued transfers (named then as that call). What the library cannot watch: a wait of the
  // caller's own for the stream (a host read of a tensor, a blocking copy, a synchronize) waits for the
  // queued transfers too, and hangs if a peer died; call sync() before such waits. The first transfer
  // with a peer may wait for it once, while NCCL connects the pair. Buffers made on another stream than
  // the one the transfer is ordered on are the caller's to keep alive (record_stream).
  // Elsewhere (host backends, MPI staging) these are send and recv.
  bool queues_p2p() const { return can_queue_p2p(); }
  void send_queued(const void* buf, int64_t bytes, int peer, int tag = 0);
  void recv_queued(void* buf, int64_t bytes, int peer, int tag = 0);
  // Returns once the transfers queued so far (and the work before them on the stream) are done, watching
  // the peers as every call does: a transfer that cannot finish raises the call's error, naming the
  // peer. Not a collective; nothing to wait for where no transfer is queued.
  void sync();

  // ---- sub-communicators ----
  // Collective: ranks with the same color form a child, ordered by (key, rank). color < 0 (kNoColor)
  // means "not a member": returns nullptr. The child shares the parent's process group resources
  // (liveness, MPI/NCCL world) and may outlive the parent.
  static constexpr int kNoColor = -1;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name = "");

  // Ends the whole job now (MPI_Abort; the single backend calls std::_Exit). Only for callers that
  // cannot return from main; see "Failure" above.
  [[noreturn]] virtual void abort(int exit_code) = 0;

 protected:
  Communicator(int rank, int size, std::string name, std::vector<int> world_ranks, double timeout_s);

  // Backend primitives. Arguments are already validated and stats are kept by the caller; `kind`
  // names the public op for error messages. Backends may override the reductions (the defaults
  // fold on the host in rank order over do_all_to_all_v / do_all_gather_v).
  virtual void do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs,
                               void* recv, const int64_t* recv_bytes, const int64_t* recv_displs, OpKind kind) = 0;
  virtual void do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                               const int64_t* recv_displs, OpKind kind) = 0;
  virtual void do_broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual void do_barrier() = 0;
  virtual void do_send(const void* buf, int64_t bytes, int peer, int tag) = 0;
  virtual void do_recv(void* buf, int64_t bytes, int peer, int tag) = 0;
  // Stream-ordered point-to-point (send_queued above): a backend that can queue transfers says so and
  // implements the three; the others never get the calls.
  virtual bool can_queue_p2p() const { return false; }
  virtual void do_send_queued(const void* buf, int64_t bytes, int peer, int tag) { do_send(buf, bytes, peer, tag); }
  virtual void do_recv_queued(void* buf, int64_t bytes, int peer, int tag) { do_recv(buf, bytes, peer, tag); }
  virtual void do_sync() {}
  virtual std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, const int64_t* counts, ScalarType type,
                                 ReduceOp op);
  virtual void do_all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp op);
  // Whether the do_* primitives take device buffers themselves (NCCL: device memory is all it moves;
  // single: local copies). Otherwise the public calls stage device buffers through page-locked host
  // memory around them (see "Memory" above), and the default reductions fold on the host.
  virtual bool native_device_buffers() const { return memory() == MemSpace::device; }
  // The first failure: later calls fail fast with the same reason. Backends whose communicators
  // share a process group (MPI, NCCL) override these to share one state across parent and children.
  virtual void set_failed(const std::string& reason);
  virtual bool failed() const { return !failure_.empty(); }
  virtual std::string failure() const { return failure_; }
  // Throws if this process may not use the communicator at all (MPI: a fork()ed child); checked
  // first in every call.
  virtual void check_process(OpKind kind) const { (void)kind; }

  // Number of calls so far, this one included (for "all_reduce #12" in messages; every rank
  // counts the same collective calls), and the label errors start with:
  // "all_reduce #12 on 'world' (rank 0 of 4)".
  uint64_t seq() const { return seq_; }
  std::string op_label(OpKind kind) const;
  std::string op_call(OpKind kind) const;  // the label without this rank's place: "all_reduce #12 on 'world'"
  // Collective calls so far, this one included: unlike seq(), equal on every member at the same
  // collective even when only some of them have made send/recv calls on this communicator.
  uint64_t collective_seq() const { return collective_seq_; }

 private:
  class Call;     // RAII timer + stats + failure check around one public call
  class Staging;  // device buffers of one call on a host backend (see "Memory" above)
  // A device-memory backend's buffers must be device memory: Error naming the argument otherwise.
  void check_device_buffer(const void* p, const char* arg, OpKind kind) const;
  detail::StagingArea& area();
  void count_bytes(OpKind kind, int peer, int64_t bytes);
  void check_p2p_args(const void* buf, int64_t bytes, int peer, int tag, OpKind kind) const;

  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  std::vector<int> world_ranks_;
  double timeout_s_ = 300.0;
  CommStats stats_;
  mutable std::mutex stats_mu_;  // stats_: read by stats() while a call of another thread updates it
  uint64_t seq_ = 0;
  uint64_t collective_seq_ = 0;
  std::string failure_;
  // The running call's op name (nullptr: none), claimed with a compare-exchange by each call, so a
  // second thread's overlapping call is refused instead of racing on the sequence numbers and the
  // backend's state.
  std::atomic<const char*> running_{nullptr};
  void* stream_ = nullptr;
  std::unique_ptr<detail::StagingArea> staging_;  // page-locked scratch, made at the first staged call
};

// Backend factory. "single": one process. "mpi": MPI_COMM_WORLD (initializes MPI if needed and
// finalizes it when the last communicator is destroyed). "nccl": GPU buffers, bootstrapped over MPI
// (under torchrun, nccl_create_over a tcp world instead).
// "auto": "mpi" when this process is an MPI launcher's rank and zero8 was built with MPI, else "single".
// An MPI launcher's rank: its variables are set (OMPI_COMM_WORLD_SIZE, PMI_SIZE, or PMIX_RANK with SLURM's
// task count as the size), TORCHELASTIC_RUN_ID is not, and RANK and WORLD_SIZE, where set, equal the
// launcher's rank and size (zero8-launch's wrapper sets them so). torchrun's workers under mpirun or srun
// (`srun --mpi=pmix torchrun ...`) inherit the launcher's variables but are not its ranks: their world is
// RANK/WORLD_SIZE, made over TCP by the Python layer. A backend this build lacks throws Error(unsupported)
// ("zero8 was not built with MPI").
// "tcp" needs a rendezvous, so it is made by tcp_create below (zero8.initialize does it under torchrun):
// comm_create("tcp") throws Error(unsupported) saying so.
// "auto", "mpi" and "nccl" in a process that is not an MPI launcher's rank but one of several throw
// Error(unsupported) naming what works, since each rank would be alone: WORLD_SIZE above 1 (torchrun,
// DeepSpeed's launcher), or srun's SLURM_PROCID with SLURM_STEP_NUM_TASKS above 1 and neither PMI's
// variables nor WORLD_SIZE (srun without --mpi where MpiDefault is none).
std::unique_ptr<Communicator> comm_create(const std::string& backend = "auto");
bool comm_backend_available(const std::string& backend);  // compiled in (not: usable right now)

// "tcp": every pair of ranks connected by TCP, for processes that no MPI launcher started (torchrun,
// DeepSpeed's launcher). Each rank listens (ZERO8_COMM_IFADDR or the default address, any free port),
// then `exchange` is called once with this rank's contact string and must return every rank's string in
// rank order (the same list on every rank): zero8's Python layer does it through torch.distributed's
// store. Every rank then connects to the ranks below it and accepts the ones above, within
// ZERO8_COMM_TIMEOUT seconds; the handshake carries rank 0's random job token, so a stale address that
// now belongs to another job is refused, naming it. A rank that cannot listen (a bad ZERO8_COMM_IFADDR)
// publishes why, and every rank's tcp_create throws it. A rank listening on a loopback address (127/8)
// while another rank's host name differs from its own fails every rank's tcp_create at once, naming it
// and ZERO8_COMM_IFADDR, instead of leaving the other hosts to retry it until the timeout. Host memory, like MPI (device buffers staged);
// calls from any thread (one at a time); reductions bit-identical to the MPI backend's.
// Failures (the contract above): a peer's connection that ends without its "bye" (sent when its last
// communicator of the world is destroyed normally) fails the calls of every communicator of the world
// at once, naming it ("rank 2 (10.0.0.3:40123) closed its connection (the process died or gave up)");
// a peer that did say bye fails only the calls that wait on it ("has shut down its communicators"); a
// rank whose call fails (a timeout names the peers not heard from) tells the others why ("gave up: ...")
// and shuts its connections down, so peers blocked on it fail at once; a peer whose host stops
// answering is reported lost after ZERO8_COMM_LINK_TIMEOUT seconds of TCP silence (keepalive), or at
// the timeout while data to it is in flight. Sizes that do not match across ranks (a recv of the wrong
// size, all_to_all_v chunks that disagree) and ranks calling different collectives at the same place
// fail at once, naming both sides. Errors of `exchange` propagate unchanged.
using AddressExchange = std::function<std::vector<std::string>(const std::string& mine)>;
std::unique_ptr<Communicator> tcp_create(int rank, int size, const AddressExchange& exchange);
// A tcp world of the ranks of `rendezvous` (a host-memory communicator: "mpi", say), the contact strings
// exchanged by its all_gather; collective over it. For tests and benchmarks of the tcp backend under mpirun.
std::unique_ptr<Communicator> tcp_create(Communicator& rendezvous);

// "nccl" for the ranks of `host`, which it bootstraps over and keeps: a world of the "tcp" backend (how
// zero8.initialize makes NCCL under torchrun) or of "mpi" (comm_create("nccl") does that), or a
// communicator split from one. Rank 0's ncclUniqueId, splits and barriers go through `host`, and while
// an NCCL call waits, host's connections are watched: a peer that dies or gives up anywhere in the world
// fails the call at once, naming it, and a rank whose call fails tells the others through them. The
// device is the rank's index among the ranks of its node (ZERO8_COMM_NODE, else the host name) modulo the
// devices it sees, as comm_create("nccl") chooses it: device 0 where each rank sees only its own GPU
// (CUDA_VISIBLE_DEVICES per rank, srun --gpus-per-task). Ranks whose devices are one GPU (gpu_owners) all
// fail at creation, naming the ranks, the GPU and the way out; with `host_if_shared` every rank gets
// `host` back instead (what "auto" wants: staging through host memory). Error(unsupported) without NCCL
// or a CUDA device; Error(invalid_argument) for another host.
std::unique_ptr<Communicator> nccl_create_over(std::unique_ptr<Communicator> host, bool host_if_shared = false);
// comm_create("nccl"), or where ranks share a GPU the "mpi" world it would bootstrap over (every rank
// alike): "auto" for a model on GPUs under an MPI launcher.
std::unique_ptr<Communicator> nccl_or_host_create();
// Which ranks of `comm` (collective) use one GPU: for each rank, the lowest rank whose CUDA
// device `device` (each rank's own index) is the same GPU, by its UUID; the rank itself where none before
// it is. Error(unsupported) without NCCL.
std::vector<int> gpu_owners(Communicator& comm, int device);

// The backend "auto" stands for, for buffers in `memory`: host memory as comm_create("auto") decides;
// device memory "nccl" instead of "mpi" when the MPI launcher started several processes and zero8 was
// built with NCCL (one rank per GPU), else the same ("single" and "mpi" stage device buffers).
std::string comm_auto_backend(MemSpace memory);

// For code that hands the communicator host buffers (std::vector, stack values: the sharded
// optimizer, checkpoints, node_groups, the Python bytes/list helpers): throws
// Error(invalid_argument) naming `arg`, the communicator and `user` unless memory() is host
// (`alternative`, when given, says what else to call). The NCCL backend takes device buffers only
// (ncclBroadcast etc. cannot read pageable host memory).
void check_host_memory(const Communicator& c, const std::string& arg, const std::string& user,
                       const std::string& alternative = "");

// Host buffers (small control data: flags, norms, sizes, configs, checkpoint manifests) on any
// communicator: collective like all_gather / all_gather_v / all_reduce / broadcast, and on a device-memory
// backend (NCCL) the data goes through a device scratch buffer on the communicator's device (whichever
// device is current) ordered on its stream; on a host backend these are the plain calls.
void all_gather_host(Communicator& c, const void* send, void* recv, int64_t bytes);
void all_gather_v_host(Communicator& c, const void* send, int64_t send_bytes, void* recv,
                       const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs);
void all_reduce_host(Communicator& c, void* data, int64_t count, ScalarType type, ReduceOp op);
void broadcast_host(Communicator& c, void* buf, int64_t bytes, int root);
// Point-to-point like send / recv (the pipeline's message headers).
void send_host(Communicator& c, const void* buf, int64_t bytes, int peer, int tag = 0);
void recv_host(Communicator& c, void* buf, int64_t bytes, int peer, int tag = 0);
template <class T> T all_reduce_host_value(Communicator& c, T v, ReduceOp op) {
  all_reduce_host(c, &v, 1, scalar_type_of<T>(), op);
  return v;
}

// ---- topology helpers (collective over `world`, built on split) ----

// pp x dp: rank = pp_stage * dp + dp_rank (stage-major, as DeepSpeed's PipeModelDataParallelTopology
// with axes [pipe, data]), so a data-parallel group is `dp` consecutive ranks (usually one node)
// and a pipeline group is the ranks with the same dp_rank, one per stage.
struct Topology {
  int pp = 1, dp = 1;
  int pp_stage = 0, dp_rank = 0;
  std::unique_ptr<Communicator> dp_group;  // "dp[stage s]": ZeRO shards within it; rank() == dp_rank
  std::unique_ptr<Communicator> pp_group;  // "pp[dp d]": stage s is rank s; send/recv between stages
};
Topology topology_split(Communicator& world, int pp);  // world.size() must be a multiple of pp

// Node = ranks with the same node name (ZERO8_COMM_NODE, default hostname). intra: the ranks of my
// node ("node[i]"), ordered by rank; inter: one rank per node with my local rank ("inter[l]"), so
// a hierarchical all-to-all runs intra-node, then inter-node among equal local ranks.
struct NodeGroups {
  int node = 0, nodes = 1;   // my node index (in order of first rank), number of nodes
  int local_rank = 0, local_size = 1;
  std::unique_ptr<Communicator> intra;
  std::unique_ptr<Communicator> inter;
};
NodeGroups node_groups(Communicator& world);

}  // namespace zero8::comm
