// NCCL backend: collectives on device buffers, enqueued on the caller's stream (set_stream) or, without
// one, on a stream of the communicator ordered after the legacy default stream. Bootstrapped over a host
// communicator of the same ranks (backends.h, HostComm): MPI under an MPI launcher (comm_create), the tcp
// backend under torchrun (nccl_create_over). The host broadcasts rank 0's ncclUniqueId, carries splits
// and barriers, and watches the peers while NCCL calls wait. Communicators are created non-blocking
// (config.blocking = 0) and every call waits by polling ncclCommGetAsyncError + cudaStreamQuery against
// the deadline and the peers; on failure the NCCL communicator is aborted (ncclCommAbort) before
// throwing. Every call waits on an event recorded after its work, so work that other threads queue on
// the same stream later does not delay it. The one exception, send_queued/recv_queued on a caller's
// stream (pipeline stages), returns once NCCL has issued the transfer; an event after each lets sync()
// wait for them one by one, naming the first that does not finish. Set-up (device, stream, rank 0's
// unique id) is agreed on in one all_gather first, so a failure on any rank fails every rank at once,
// naming it. CI runs it against the CUDA simulator's NCCL (tests/cudasim) on 1 to 3 ranks, over both
// hosts.
#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends.h"
#include "comm_env.h"
#include "zero8/error.h"
#if ZERO8_WITH_MPI
#include "comm_mpi.h"
#endif

namespace zero8::comm::detail {
namespace {

ncclDataType_t nccl_type(ScalarType t) {
  switch (t) {
    case ScalarType::u8: return ncclUint8;
    case ScalarType::i32: return ncclInt32;
    case ScalarType::i64: return ncclInt64;
    case ScalarType::f32: return ncclFloat32;
    case ScalarType::f64: return ncclFloat64;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

class NcclComm final : public Communicator {
 public:
  // `unusable`: why this rank cannot take part (checked at creation), reported by every rank together.
  NcclComm(std::unique_ptr<HostComm> host, const std::string& name, int device, const std::string& unusable = "")
      : Communicator(host->rank(), host->size(), name, host->world_ranks(), host->timeout()),
        host_(std::move(host)),
        device_(device) {
    init(unusable);
  }

  ~NcclComm() override {
    // On the communicator's device, as every call (Communicator::Call), without throwing: a destructor must not.
    int caller = -1;
    const bool moved =
        cudaGetDevice(&caller) == cudaSuccess && caller != device_ && cudaSetDevice(device_) == cudaSuccess;
    if (nccl_ != nullptr) {
      if (!failed()) {
        // Flush and free; bounded, since a destructor must not hang either.
        ncclCommFinalize(nccl_);
        const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout());
        ncclResult_t st = ncclInProgress;
        while (std::chrono::steady_clock::now() < until) {
          ncclCommGetAsyncError(nccl_, &st);
          if (st != ncclInProgress) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        if (st == ncclSuccess)
          ncclCommDestroy(nccl_);
        else
          ncclCommAbort(nccl_);
      } else {
        ncclCommAbort(nccl_);
      }
    }
    for (const Queued& q : queued_) cudaEventDestroy(q.done);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (moved) cudaSetDevice(caller);
  }

  std::string description() const override {
    std::ostringstream os;
    os << "nccl communicator '" << name() << "' (rank " << rank() << " of " << size() << ", CUDA device " << device_
       << ", NCCL " << NCCL_MAJOR << "." << NCCL_MINOR << "." << NCCL_PATCH << "; bootstrap: " << host_->description()
       << ")";
    return os.str();
  }
  const char* backend() const override { return "nccl"; }
  MemSpace memory() const override { return MemSpace::device; }
  // Barriers, the bootstrap and the failure reports go through the host communicator.
  bool calls_from_any_thread() const override { return host_->calls_from_any_thread(); }
  int device() const override { return device_; }
  [[noreturn]] void abort(int exit_code) override {
    if (host_->forked()) std::_Exit(exit_code);  // the NCCL and host state are the parent's
    if (nccl_ != nullptr) ncclCommAbort(nccl_);
    host_->abort(exit_code);
    std::abort();  // not reached: GCC does not take [[noreturn]] from a virtual call
  }

  // The host watches this communicator's waits (watch) against its own timeout: both take the new one.
  void set_timeout(double seconds) override {
    Communicator::set_timeout(seconds);
    host_->set_timeout(seconds);
  }
  void set_failed(const std::string& reason) override { host_->set_failed(reason); }
  bool failed() const override { return host_->failed(); }
  std::string failure() const override { return host_->failure(); }
  void check_process(OpKind kind) const override {
    if (host_->forked()) host_->check_not_forked(op_label(kind));
  }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* sb, const int64_t* sd, void* recv, const int64_t* rb,
                       const int64_t* rd, OpKind kind) override {
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    const int me = rank();
    const cudaStream_t st = work_stream(kind);
    if (sb[me] > 0) cuda_check(cudaMemcpyAsync(r + rd[me], s + sd[me], size_t(sb[me]), cudaMemcpyDeviceToDevice, st), kind);
    nccl_check(ncclGroupStart(), kind, "ncclGroupStart");
    for (int p = 0; p < size(); ++p) {
      if (p == me) continue;
      if (sb[p] > 0) nccl_check(ncclSend(s + sd[p], size_t(sb[p]), ncclUint8, p, nccl_, st), kind, "ncclSend");
      if (rb[p] > 0) nccl_check(ncclRecv(r + rd[p], size_t(rb[p]), ncclUint8, p, nccl_, st), kind, "ncclRecv");
    }
    nccl_check(ncclGroupEnd(), kind, "ncclGroupEnd");
    wait(kind, st);
  }

  void do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* rb, const int64_t* rd,
                       OpKind kind) override {
    char* r = static_cast<char*>(recv);
    const int me = rank();
    bool equal = true;
    for (int p = 0; p < size(); ++p) equal = equal && rb[p] == send_bytes && rd[p] == send_bytes * p;
    const cudaStream_t st = work_stream(kind);
    if (equal) {
      nccl_check(ncclAllGather(send, recv, size_t(send_bytes), ncclUint8, nccl_, st), kind, "ncclAllGather");
    } else {
      if (send != r + rd[me] && send_bytes > 0)
        cuda_check(cudaMemcpyAsync(r + rd[me], send, size_t(send_bytes), cudaMemcpyDeviceToDevice, st), kind);
      nccl_check(ncclGroupStart(), kind, "ncclGroupStart");
      for (int p = 0; p < size(); ++p) {
        if (p == me) continue;
        if (send_bytes > 0) nccl_check(ncclSend(send, size_t(send_bytes), ncclUint8, p, nccl_, st), kind, "ncclSend");
        if (rb[p] > 0) nccl_check(ncclRecv(r + rd[p], size_t(rb[p]), ncclUint8, p, nccl_, st), kind, "ncclRecv");
      }
      nccl_check(ncclGroupEnd(), kind, "ncclGroupEnd");
    }
    wait(kind, st);
  }

  void do_broadcast(void* buf, int64_t bytes, int root) override {
    const cudaStream_t st = work_stream(OpKind::broadcast);
    nccl_check(ncclBroadcast(buf, buf, size_t(bytes), ncclUint8, root, nccl_, st), OpKind::broadcast,
               "ncclBroadcast");
    wait(OpKind::broadcast, st);
  }

  // Every call returns with its stream work complete, so a host barrier orders device work too.
  void do_barrier() override { host_->barrier(); }

  // NCCL matches messages per peer pair in call order; tags are not part of its matching.
  void do_send(const void* buf, int64_t bytes, int peer, int) override {
    transfer(OpKind::send, const_cast<void*>(buf), bytes, peer, false);
  }
  void do_recv(void* buf, int64_t bytes, int peer, int) override { transfer(OpKind::recv, buf, bytes, peer, false); }

  // Queued where the blocking calls run (work_stream: the caller's stream, or stream_ after the legacy
  // stream's work): the call returns once NCCL has issued the transfer (non-blocking mode may still hold
  // it), with an event recorded after it, which the legacy stream waits for when there is no caller's
  // stream, and which lets sync() name the first transfer that does not finish and its peer.
  bool can_queue_p2p() const override { return true; }
  void do_send_queued(const void* buf, int64_t bytes, int peer, int) override {
    transfer(OpKind::send, const_cast<void*>(buf), bytes, peer, true);
  }
  void do_recv_queued(void* buf, int64_t bytes, int peer, int) override {
    transfer(OpKind::recv, buf, bytes, peer, true);
  }
  void transfer(OpKind kind, void* buf, int64_t bytes, int peer, bool queue) {
    const cudaStream_t st = queue ? queue_stream(kind, peer) : work_stream(kind, peer);
    if (kind == OpKind::send)
      nccl_check(ncclSend(buf, size_t(bytes), ncclUint8, peer, nccl_, st), kind, "ncclSend");
    else
      nccl_check(ncclRecv(buf, size_t(bytes), ncclUint8, peer, nccl_, st), kind, "ncclRecv");
    if (queue)
      queued(kind, st, peer);
    else
      wait(kind, st, peer);
  }
  // Waits for each queued transfer in turn (stream order: the first one not done is what holds the rest),
  // watched as that transfer, so a dead or stalled peer is named with the transfer that waits for it.
  void do_sync() override { wait_queued(", queued and waited for by " + op_call(OpKind::sync)); }
  void wait_queued(const std::string& by) {
    while (!queued_.empty()) {
      Queued& q = queued_.front();
      HostComm::DeviceCall c = q.call;
      c.label += by;
      watch_until(c, q.call.kind, q.call.p2p_peer, [&] { return event_done(q.done, q.call.kind, q.call.p2p_peer); });
      retire(1);
    }
  }
  // The first n queued transfers are done: their events are kept for reuse.
  void retire(size_t n) {
    for (size_t i = 0; i < n; ++i) spare_events_.push_back(queued_[i].done);
    queued_.erase(queued_.begin(), queued_.begin() + std::ptrdiff_t(n));
  }

  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override {
    std::unique_ptr<HostComm> child = host_->split_host(color, key, name);
    if (!child) return nullptr;
    return std::make_unique<NcclComm>(std::move(child), name, device_);
  }

  // NCCL's own reductions (ring order, identical on every rank). NCCL's float max/min follow its own NaN
  // rules and can drop a NaN, unlike the other backends (communicator.h says so).
  void do_reduce_scatter(const void* send, void* recv, const int64_t* counts, ScalarType type, ReduceOp op) override {
    const int n = size(), me = rank();
    const int64_t es = scalar_type_size(type);
    bool equal = true;
    for (int p = 0; p < n; ++p) equal = equal && counts[p] == counts[0];
    const cudaStream_t st = work_stream(OpKind::reduce_scatter);
    if (equal) {
      nccl_check(ncclReduceScatter(send, recv, size_t(counts[0]), nccl_type(type), nccl_op(op), nccl_, st),
                 OpKind::reduce_scatter, "ncclReduceScatter");
    } else {
      // Unequal ranges: one reduce per owner, grouped into a single launch.
      nccl_check(ncclGroupStart(), OpKind::reduce_scatter, "ncclGroupStart");
      int64_t off = 0;
      for (int p = 0; p < n; ++p) {
        const char* src = static_cast<const char*>(send) + off * es;
        void* dst = p == me ? recv : const_cast<char*>(src);  // only the root's receive buffer is written
        if (counts[p] > 0)
          nccl_check(ncclReduce(src, dst, size_t(counts[p]), nccl_type(type), nccl_op(op), p, nccl_, st),
                     OpKind::reduce_scatter, "ncclReduce");
        off += counts[p];
      }
      nccl_check(ncclGroupEnd(), OpKind::reduce_scatter, "ncclGroupEnd");
    }
    wait(OpKind::reduce_scatter, st);
  }

  void do_all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp op) override {
    const cudaStream_t st = work_stream(OpKind::all_reduce);
    nccl_check(ncclAllReduce(send, recv, size_t(count), nccl_type(type), nccl_op(op), nccl_, st),
               OpKind::all_reduce, "ncclAllReduce");
    wait(OpKind::all_reduce, st);
  }

 private:
  HostComm::DeviceCall call(OpKind kind, int p2p_peer = -1) const {
    HostComm::DeviceCall c;
    c.kind = kind;
    c.label = op_label(kind);
    c.call = op_call(kind);
    c.seq = collective_seq();
    c.comm_id = host_->id() ^ 0x6e63636cull;  // "nccl": distinct from the bootstrap communicator's calls
    c.p2p_peer = p2p_peer;
    return c;
  }

  [[noreturn]] void fail(OpKind kind, const std::string& cause, int p2p_peer = -1) {
    if (nccl_ != nullptr) ncclCommAbort(nccl_);
    nccl_ = nullptr;
    host_->fail_call(call(kind, p2p_peer), cause);
    std::abort();  // not reached (as in abort())
  }

  void nccl_check(ncclResult_t rc, OpKind kind, const char* call) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    fail(kind, std::string(call) + " failed: " + ncclGetErrorString(rc) + " (" + ncclGetLastError(nccl_) + ")");
  }

  void cuda_check(cudaError_t rc, OpKind kind, int p2p_peer = -1) {
    if (rc != cudaSuccess) fail(kind, std::string("CUDA error: ") + cudaGetErrorString(rc), p2p_peer);
  }

  // The stream a call's work goes on (communicator.h, "Streams"): the caller's (set_stream), which
  // orders it after the work already there; else stream_, which is non-blocking and so does not wait
  // for the legacy default stream, where zero8's own *_cuda kernels (stream nullptr) and most callers'
  // work run: it is made to wait for everything enqueued there so far. (The legacy stream itself waits
  // for blocking streams; work on other non-blocking streams is the caller's to synchronize.)
  cudaStream_t work_stream(OpKind kind, int p2p_peer = -1) {
    if (stream() != nullptr) return static_cast<cudaStream_t>(stream());
    cuda_check(cudaEventRecord(ready_, cudaStreamLegacy), kind, p2p_peer);
    cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), kind, p2p_peer);
    return stream_;
  }

  // Until the communicator has issued everything (non-blocking mode) and the call's work on `st` is
  // done (an event recorded after it: later work on a shared caller's stream does not count).
  void wait(OpKind kind, cudaStream_t st, int p2p_peer = -1) {
    bool recorded = false;
    watch_until(call(kind, p2p_peer), kind, p2p_peer, [&] {
      // In non-blocking mode the work may reach the stream only once the communicator is no longer
      // in progress (watch_until asks first): record after that.
      if (!recorded) {
        cuda_check(cudaEventRecord(done_, st), kind, p2p_peer);
        recorded = true;
      }
      return event_done(done_, kind, p2p_peer);
    });
    // Transfers queued on st came before this call's work there: done too.
    if (st == queued_stream_) retire(queued_.size());
  }

  // Polls `done` (after NCCL has issued everything it holds; an NCCL error fails the call) under the host's
  // watch: the deadline, dead and failed peers. On any failure NCCL's kernels are stopped before the error
  // leaves.
  void watch_until(const HostComm::DeviceCall& c, OpKind kind, int p2p_peer, const std::function<bool()>& done) {
    try {
      host_->watch(c, [&] {
        ncclResult_t rc = ncclSuccess;
        ncclCommGetAsyncError(nccl_, &rc);
        if (rc != ncclSuccess && rc != ncclInProgress)
          fail(kind, std::string("NCCL asynchronous error: ") + ncclGetErrorString(rc), p2p_peer);
        return rc != ncclInProgress && done();
      });
    } catch (...) {
      if (nccl_ != nullptr) ncclCommAbort(nccl_);
      nccl_ = nullptr;
      throw;
    }
  }

  bool event_done(cudaEvent_t e, OpKind kind, int p2p_peer) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaErrorNotReady) return false;
    if (q != cudaSuccess) fail(kind, std::string("CUDA error: ") + cudaGetErrorString(q), p2p_peer);
    return true;
  }

  // The stream a transfer is queued on. Transfers still queued on another stream (set_stream changed in
  // between) are waited for first: sync() follows one stream.
  cudaStream_t queue_stream(OpKind kind, int peer) {
    const cudaStream_t st = work_stream(kind, peer);
    if (!queued_.empty() && st != queued_stream_)
      wait_queued(", queued on another stream and waited for by " + op_call(kind) + " to " + std::to_string(peer));
    queued_stream_ = st;
    return st;
  }

  // After ncclSend/ncclRecv of a queued transfer: waits until NCCL has issued it, then records its event.
  // The transfers known done are dropped first, so the list holds those still in flight.
  void queued(OpKind kind, cudaStream_t st, int peer) {
    HostComm::DeviceCall c = call(kind, peer);
    watch_until(c, kind, peer, [] { return true; });
    while (!queued_.empty() && event_done(queued_.front().done, kind, peer)) retire(1);
    cudaEvent_t e = nullptr;
    if (!spare_events_.empty()) {
      e = spare_events_.back();
      spare_events_.pop_back();
    } else {
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), kind, peer);
    }
    queued_.push_back(Queued{std::move(c), e});  // owned before a failing record can throw
    cuda_check(cudaEventRecord(e, st), kind, peer);
    if (st == stream_) cuda_check(cudaStreamWaitEvent(cudaStreamLegacy, e, 0), kind, peer);
  }

  // The local set-up can fail on any rank (and the unique id only on rank 0): every rank reports its
  // outcome in one all_gather before the id is broadcast, so all fail together naming the rank and
  // its reason, instead of the others waiting timeout() seconds in the broadcast or getting a
  // zeroed id.
  struct SetupStatus {
    int32_t failed = 0;  // 0: ok, 1: the CUDA device (unsupported), 2: other (comm)
    char reason[508] = {};  // room for the longest (a shared GPU: ranks, UUID, the way out)
  };
  static_assert(sizeof(SetupStatus) == 512, "fixed-size record for the all_gather");

  SetupStatus local_setup(ncclUniqueId* id, const std::string& unusable) {
    SetupStatus st;
    auto failed = [&](int32_t kind, const std::string& why) {
      st.failed = kind;
      std::strncpy(st.reason, why.c_str(), sizeof(st.reason) - 1);
      return st;
    };
    if (!unusable.empty()) return failed(1, unusable);
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess)
      return failed(1, "cannot use CUDA device " + std::to_string(device_) + " (" + cudaGetErrorString(e) + ")");
    e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return failed(2, std::string("cudaStreamCreate failed (") + cudaGetErrorString(e) + ")");
    e = cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming);
    if (e != cudaSuccess) return failed(2, std::string("cudaEventCreate failed (") + cudaGetErrorString(e) + ")");
    e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
    if (e != cudaSuccess) return failed(2, std::string("cudaEventCreate failed (") + cudaGetErrorString(e) + ")");
    if (rank() == 0) {
      const ncclResult_t rc = ncclGetUniqueId(id);
      if (rc != ncclSuccess) return failed(2, std::string("ncclGetUniqueId failed (") + ncclGetErrorString(rc) + ")");
    }
    return st;
  }

  void init(const std::string& unusable) {
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    const SetupStatus mine = local_setup(&id, unusable);
    std::vector<SetupStatus> all(static_cast<size_t>(size()));
    host_->all_gather(&mine, all.data(), int64_t(sizeof(SetupStatus)));
    for (int p = 0; p < size(); ++p) {
      const SetupStatus& st = all[size_t(p)];
      if (st.failed == 0) continue;
      if (done_ != nullptr) cudaEventDestroy(done_);
      if (ready_ != nullptr) cudaEventDestroy(ready_);
      if (stream_ != nullptr) cudaStreamDestroy(stream_);
      done_ = ready_ = nullptr;
      stream_ = nullptr;
      const std::string who = p == rank() ? "this rank" : "rank " + std::to_string(p);
      const std::string msg = "nccl communicator '" + name() + "' (rank " + std::to_string(rank()) + " of " +
                              std::to_string(size()) + "): set-up failed on " + who + ": " + st.reason;
      if (st.failed == 1) ZERO8_THROW(unsupported, msg);
      ZERO8_THROW(comm, msg);
    }
    host_->broadcast(&id, int64_t(sizeof(id)), 0);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // every NCCL call returns at once; we poll with a deadline instead
    const ncclResult_t rc = ncclCommInitRankConfig(&nccl_, size(), id, rank(), &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress)
      fail(OpKind::split, std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(rc));
    wait(OpKind::split, stream_);
  }

  std::unique_ptr<HostComm> host_;
  ncclComm_t nccl_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // recorded on the legacy default stream before each call without a stream
  cudaEvent_t done_ = nullptr;   // recorded after each call's work (wait)
  int device_ = 0;
  // Transfers queued (send_queued/recv_queued) and not yet known done, in stream order on queued_stream_,
  // each with the call that names it and an event recorded after it; their events are reused.
  struct Queued {
    HostComm::DeviceCall call;
    cudaEvent_t done;
  };
  std::vector<Queued> queued_;
  cudaStream_t queued_stream_ = nullptr;
  std::vector<cudaEvent_t> spare_events_;
};

// Checked before any collective, so every rank of a GPU-less job fails the same way.
void check_device_present() {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess || devices == 0)
    ZERO8_THROW(unsupported, "communicator backend 'nccl': no CUDA device ("
                                 << (rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices") << ")");
}

// The GPU that CUDA device `device` of this process is, as every process that sees it knows it: its UUID
// (zero where the runtime cannot say, which matches nothing).
std::array<unsigned char, 16> gpu_uuid(int device) {
  std::array<unsigned char, 16> id{};
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) == cudaSuccess) std::memcpy(id.data(), p.uuid.bytes, id.size());
  return id;
}

}  // namespace

std::vector<int> gpu_owners(Communicator& comm, int device) {
  const std::array<unsigned char, 16> mine = gpu_uuid(device);
  std::vector<std::array<unsigned char, 16>> all(size_t(comm.size()));
  all_gather_host(comm, mine.data(), all.data(), int64_t(mine.size()));
  const std::array<unsigned char, 16> unknown{};
  std::vector<int> owner(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    owner[r] = int(r);
    if (all[r] == unknown) continue;
    for (size_t q = 0; q < r; ++q)
      if (all[q] == all[r]) {
        owner[r] = int(q);
        break;
      }
  }
  return owner;
}

namespace {

std::string uuid_text(const std::array<unsigned char, 16>& id) {
  static const char* hex = "0123456789abcdef";
  std::string s = "GPU-";
  for (size_t i = 0; i < id.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += hex[id[i] >> 4];
    s += hex[id[i] & 15];
  }
  return s;
}

}  // namespace

std::unique_ptr<Communicator> nccl_create_over(std::unique_ptr<HostComm> host, bool host_if_shared) {
  check_device_present();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  // The rank's device: its index among the ranks of its node, modulo the devices it sees (0 where each
  // rank sees only its own GPU: CUDA_VISIBLE_DEVICES per rank, srun --gpus-per-task).
  const NodeGroups g = node_groups(*host);
  const int device = g.local_rank % devices;
  const std::vector<int> owner = detail::gpu_owners(*host, device);
  bool shared = false;
  for (int q = 0; q < host->size(); ++q) shared = shared || owner[size_t(q)] != q;
  if (shared && host_if_shared) return host;  // every rank alike: they all read the same table
  // NCCL refuses two ranks of a communicator on one GPU, with an error that names neither the ranks nor the
  // way out; a rank that shares its GPU with another is reported here instead (as `unusable`), and every
  // rank fails at once.
  std::string unusable;
  std::vector<int> with_me;
  for (int q = 0; q < host->size(); ++q)
    if (q != host->rank() && owner[size_t(q)] == owner[size_t(host->rank())]) with_me.push_back(q);
  if (!with_me.empty()) {
    std::string others;
    for (size_t i = 0; i < with_me.size(); ++i) others += (i ? ", " : "") + std::to_string(with_me[i]);
    unusable = "its CUDA device " + std::to_string(device) + " (" + uuid_text(gpu_uuid(device)) +
               ") is also the device of rank " + others + " (" + std::to_string(g.local_size) + " ranks on its node, " +
               std::to_string(devices) + " CUDA device(s) visible to each), and NCCL needs a GPU per rank: start at "
               "most one rank per GPU of a node, or use the '" + host->backend() +
               "' backend, which stages device buffers through host memory (ranks may share a GPU)";
  }
  const std::string name = host->name();
  return std::make_unique<NcclComm>(std::move(host), name, device, unusable);
}

#if ZERO8_WITH_MPI
std::unique_ptr<Communicator> nccl_create(bool host_if_shared) {
  check_device_present();
  std::unique_ptr<Communicator> host = mpi_create();
  return nccl_create_over(std::unique_ptr<HostComm>(static_cast<MpiComm*>(host.release())), host_if_shared);
}
#else
std::unique_ptr<Communicator> nccl_create(bool) {
  ZERO8_THROW(unsupported,
              "communicator backend 'nccl': zero8 was built with NCCL but without MPI, which "
              "comm_create(\"nccl\") bootstraps over (configure with -DZERO8_MPI=ON); under torchrun "
              "zero8.initialize bootstraps NCCL over the tcp backend (nccl_create_over)");
}
#endif

}  // namespace zero8::comm::detail
