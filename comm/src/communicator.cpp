// The backend-independent half of Communicator: argument checks, byte counters, the deterministic
// rank-order reductions built on all-to-all + all-gather, the topology helpers and comm_create().
#include "zero8/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include "backends.h"
#include "comm_env.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"

namespace zero8::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

const char* scalar_type_name(ScalarType t) {
  switch (t) {
    case ScalarType::u8: return "uint8";
    case ScalarType::i32: return "int32";
    case ScalarType::i64: return "int64";
    case ScalarType::f32: return "float32";
    case ScalarType::f64: return "float64";
  }
  return "?";
}

int scalar_type_size(ScalarType t) {
  switch (t) {
    case ScalarType::u8: return 1;
    case ScalarType::i32: return 4;
    case ScalarType::i64: return 8;
    case ScalarType::f32: return 4;
    case ScalarType::f64: return 8;
  }
  return 0;
}

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::all_to_all: return "all_to_all";
    case OpKind::all_to_all_v: return "all_to_all_v";
    case OpKind::all_gather: return "all_gather";
    case OpKind::all_gather_v: return "all_gather_v";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::broadcast: return "broadcast";
    case OpKind::barrier: return "barrier";
    case OpKind::send: return "send";
    case OpKind::recv: return "recv";
    case OpKind::split: return "split";
    case OpKind::sync: return "sync";
  }
  return "?";
}

uint64_t CommStats::bytes() const {
  uint64_t b = 0;
  for (const OpStats& s : ops) b += s.bytes;
  return b;
}

std::vector<uint64_t> CommStats::bytes_to_peer() const {
  std::vector<uint64_t> out;
  for (const OpStats& s : ops) {
    if (out.size() < s.bytes_to_peer.size()) out.resize(s.bytes_to_peer.size(), 0);
    for (size_t p = 0; p < s.bytes_to_peer.size(); ++p) out[p] += s.bytes_to_peer[p];
  }
  return out;
}

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Element-wise acc = acc (op) x. max/min propagate NaN so an overflow is never reduced away.
template <class T> void fold_typed(T* acc, const T* x, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      for (int64_t i = 0; i < n; ++i) acc[i] = T(acc[i] + x[i]);
      break;
    case ReduceOp::max:
      for (int64_t i = 0; i < n; ++i) {
        const T a = acc[i], b = x[i];
        acc[i] = (a != a) ? a : (b != b) ? b : (b > a ? b : a);
      }
      break;
    case ReduceOp::min:
      for (int64_t i = 0; i < n; ++i) {
        const T a = acc[i], b = x[i];
        acc[i] = (a != a) ? a : (b != b) ? b : (b < a ? b : a);
      }
      break;
  }
}

void fold(void* acc, const void* x, int64_t n, ScalarType t, ReduceOp op) {
  switch (t) {
    case ScalarType::u8: return fold_typed(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(x), n, op);
    case ScalarType::i32: return fold_typed(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), n, op);
    case ScalarType::i64: return fold_typed(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), n, op);
    case ScalarType::f32: return fold_typed(static_cast<float*>(acc), static_cast<const float*>(x), n, op);
    case ScalarType::f64: return fold_typed(static_cast<double*>(acc), static_cast<const double*>(x), n, op);
  }
}

// Part p of n elements split into `parts` near-equal contiguous ranges (all_reduce's byte model).
int64_t part_begin(int64_t n, int parts, int p) { return n * p / parts; }

void check_scalar_type(ScalarType t) {
  ZERO8_CHECK_ARG(scalar_type_size(t) > 0, "type", "unknown ScalarType " << int(t));
}
void check_reduce_op(ReduceOp op) {
  ZERO8_CHECK_ARG(op == ReduceOp::sum || op == ReduceOp::max || op == ReduceOp::min, "op",
                  "unknown ReduceOp " << int(op));
}

}  // namespace

namespace {

struct BackgroundWork {
  const void* owner;
  std::thread::id runner;
  std::function<void()> wait;
};

// A wait in progress: `thread` is running `owner`'s wait.
struct RunningWait {
  const void* owner;
  std::thread::id thread;
};

std::mutex g_background_mu;
std::condition_variable g_background_cv;   // a RunningWait ended
std::vector<BackgroundWork> g_background;  // guarded by g_background_mu
std::vector<RunningWait> g_running;        // guarded by g_background_mu
std::atomic<int> g_background_count{0};    // g_background's size, read without the lock on every call

// Before a public call: the background work of other threads is done (see add_background_work). The
// waits run outside the lock: they may take the communicator's timeout, and they remove their entry.
// Each wait is looked up again just before it runs and marked running (remove_background_work blocks
// until other threads' runs of its owner's wait ended), so a wait never runs after its owner removed
// it and went away.
void wait_for_background_work() {
  if (g_background_count.load(std::memory_order_acquire) == 0) return;
  const std::thread::id me = std::this_thread::get_id();
  std::vector<const void*> owners;
  {
    std::lock_guard<std::mutex> lk(g_background_mu);
    for (const BackgroundWork& w : g_background)
      if (w.runner != me) owners.push_back(w.owner);
  }
  for (const void* owner : owners) {
    std::function<void()> wait;
    {
      std::lock_guard<std::mutex> lk(g_background_mu);
      auto it = std::find_if(g_background.begin(), g_background.end(),
                             [&](const BackgroundWork& w) { return w.owner == owner && w.runner != me; });
      if (it == g_background.end()) continue;  // removed meanwhile
      wait = it->wait;
      g_running.push_back({owner, me});
    }
    struct Done {
      const void* owner;
      std::thread::id me;
      ~Done() {
        std::lock_guard<std::mutex> lk(g_background_mu);
        auto it = std::find_if(g_running.begin(), g_running.end(),
                               [&](const RunningWait& r) { return r.owner == owner && r.thread == me; });
        if (it != g_running.end()) g_running.erase(it);
        g_background_cv.notify_all();
      }
    } done{owner, me};
    wait();
  }
}

// A call's start time: after the background work it waited for, which is not the call's own time.
double call_start() {
  wait_for_background_work();
  return now_seconds();
}

}  // namespace

void add_background_work(const void* owner, std::thread::id runner, std::function<void()> wait) {
  std::lock_guard<std::mutex> lk(g_background_mu);
  for (BackgroundWork& w : g_background)
    if (w.owner == owner) {
      w.runner = runner;
      w.wait = std::move(wait);
      return;
    }
  g_background.push_back({owner, runner, std::move(wait)});
  g_background_count.store(int(g_background.size()), std::memory_order_release);
}

void remove_background_work(const void* owner) {
  std::unique_lock<std::mutex> lk(g_background_mu);
  g_background.erase(std::remove_if(g_background.begin(), g_background.end(),
                                    [&](const BackgroundWork& w) { return w.owner == owner; }),
                     g_background.end());
  g_background_count.store(int(g_background.size()), std::memory_order_release);
  // Other threads' runs of this owner's wait end before the owner may go away (a wait removing its own
  // entry does not wait for itself).
  const std::thread::id me = std::this_thread::get_id();
  g_background_cv.wait(lk, [&] {
    return std::none_of(g_running.begin(), g_running.end(),
                        [&](const RunningWait& r) { return r.owner == owner && r.thread != me; });
  });
}

// Around every public call: wait for other threads' background work, refuse a call overlapping
// another thread's and a forked child, fail fast after an earlier failure, number the call, time it.
class Communicator::Call {
 public:
  Call(Communicator& c, OpKind kind)
      : c_(c), kind_(kind), t0_(call_start()), on_device_(c.device(), "Communicator") {
    // One compare-exchange per call. A refused call changes nothing (not even the call numbers,
    // which the running call's messages and the peers' mismatch checks use).
    const char* running = nullptr;
    if (!c_.running_.compare_exchange_strong(running, op_kind_name(kind), std::memory_order_acquire)) {
      // A fork()ed child inherits a call another thread of the parent was running at fork(), which
      // nothing in the child will ever end: the fork is what to report there.
      c_.check_process(kind);
      ZERO8_THROW(invalid_argument,
                  op_kind_name(kind) << " called while " << running << " is still running on communicator '"
                                     << c_.name_ << "' (rank " << c_.rank_ << " of " << c_.size_
                                     << ") from another thread; zero8 calls on one communicator must not overlap "
                                        "(every rank must issue its collectives in one order, from one thread "
                                        "at a time)");
    }
    ++c_.seq_;
    if (kind != OpKind::send && kind != OpKind::recv && kind != OpKind::sync) ++c_.collective_seq_;
    try {
      c_.check_process(kind);
      if (c_.failed())
        ZERO8_THROW(comm, c_.op_label(kind) << ": communicator unusable after an earlier failure: " << c_.failure());
    } catch (...) {
      c_.running_.store(nullptr, std::memory_order_release);  // ~Call does not run for a throwing constructor
      throw;
    }
  }
  ~Call() {
    {
      std::lock_guard<std::mutex> lk(c_.stats_mu_);
      OpStats& s = c_.stats_.ops[size_t(kind_)];
      s.calls += 1;
      s.seconds += now_seconds() - t0_;
    }
    c_.running_.store(nullptr, std::memory_order_release);
  }

 private:
  Communicator& c_;
  OpKind kind_;
  double t0_;
  // A communicator with a device of its own (NCCL) works on it, whatever the caller has made current, and
  // the caller's is current again after (as torch's process groups do): its stream and events, and the
  // legacy default stream it orders its work after, must be that device's, or CUDA refuses them on a
  // machine with several GPUs. Host backends have none (-1): nothing changes.
  device::DeviceGuard on_device_;
};

namespace detail {
// The page-locked scratch of a host backend's staged device buffers: inputs and outputs apart, since a
// call reads the one while the transport writes the other. Grown on demand, kept for later calls.
struct StagingArea {
  device::PinnedBuffer in, out;
};
}  // namespace detail

// Device buffers of one call on a host backend (communicator.h, "Memory"): input() copies the chunks of
// a device buffer that the call reads into page-locked memory and returns that, output() returns the
// page-locked place the call writes and remembers where the chunks go back; run() waits for the inputs,
// runs the backend, copies the outputs back and waits for them. Host buffers pass through untouched,
// and a call with none on the device touches no CUDA API beyond the pointer queries.
class Communicator::Staging {
 public:
  Staging(Communicator& c, OpKind kind) : c_(c), kind_(kind), active_(!c.native_device_buffers()) {}

  // Chunks [displs[i], +bytes[i]) of p for i < n (displs null: one chunk of bytes[0] at 0).
  const void* input(const void* p, int n, const int64_t* bytes, const int64_t* displs) {
    if (!staged(p)) return p;
    char* h = static_cast<char*>(reserve(c_.area().in, extent(n, bytes, displs)));
    for (int i = 0; i < n; ++i) {
      const int64_t off = displs ? displs[i] : 0;
      device::copy(h + off, static_cast<const char*>(p) + off, bytes[i], c_.stream_, where());
    }
    pending_in_ = true;
    return h;
  }
  // copy_in: the call also reads the chunks (broadcast's root, an in-place all_reduce).
  void* output(void* p, int n, const int64_t* bytes, const int64_t* displs, bool copy_in = false) {
    if (!staged(p)) return p;
    char* h = static_cast<char*>(reserve(c_.area().out, extent(n, bytes, displs)));
    for (int i = 0; i < n; ++i) {
      const int64_t off = displs ? displs[i] : 0;
      if (copy_in) device::copy(h + off, static_cast<const char*>(p) + off, bytes[i], c_.stream_, where());
      back_.push_back({static_cast<char*>(p) + off, h + off, bytes[i]});
    }
    pending_in_ = pending_in_ || copy_in;
    return h;
  }
  template <class F> void run(F&& backend) {
    if (pending_in_) device::synchronize(c_.stream_, where());
    backend();
    for (const Back& b : back_) device::copy(b.dst, b.src, b.bytes, c_.stream_, where());
    if (!back_.empty()) device::synchronize(c_.stream_, where());
  }

 private:
  struct Back {
    char* dst;
    const char* src;
    int64_t bytes;
  };
  bool staged(const void* p) const { return active_ && p != nullptr && device::on_device(p); }
  static int64_t extent(int n, const int64_t* bytes, const int64_t* displs) {
    int64_t e = 0;
    for (int i = 0; i < n; ++i) e = std::max(e, (displs ? displs[i] : 0) + bytes[i]);
    return e;
  }
  void* reserve(device::PinnedBuffer& b, int64_t bytes) {
    // Every staged buffer of a call has its own area (at most one input and one output per call).
    return b.reserve(std::max<int64_t>(bytes, 1), where());
  }
  std::string where() const { return c_.op_label(kind_) + " (staging device buffers through host memory)"; }

  Communicator& c_;
  OpKind kind_;
  bool active_;
  bool pending_in_ = false;
  std::vector<Back> back_;
};

detail::StagingArea& Communicator::area() {
  if (!staging_) staging_ = std::make_unique<detail::StagingArea>();
  return *staging_;
}

void Communicator::check_device_buffer(const void* p, const char* arg, OpKind kind) const {
  if (memory() != MemSpace::device) return;
  device::check_device_ptr(p, arg,
                           std::string(op_kind_name(kind)) + " on '" + name_ + "' (" + backend() + ", rank " +
                               std::to_string(rank_) + " of " + std::to_string(size_) + ")");
}

void Communicator::set_stream(void* stream) {
  device::check_stream(stream, "stream", "Communicator::set_stream on '" + name_ + "'");
  stream_ = stream;
}

Communicator::Communicator(int rank, int size, std::string name, std::vector<int> world_ranks, double timeout_s)
    : rank_(rank), size_(size), name_(std::move(name)), world_ranks_(std::move(world_ranks)), timeout_s_(timeout_s) {
  ZERO8_ASSERT(size_ >= 1 && rank_ >= 0 && rank_ < size_ && int(world_ranks_.size()) == size_);
  stats_reset();
}

Communicator::~Communicator() = default;

void Communicator::set_timeout(double seconds) {
  ZERO8_CHECK_ARG(seconds > 0.0 && seconds <= 1e9, "seconds", "timeout must be in (0, 1e9], got " << seconds);
  timeout_s_ = seconds;
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

void Communicator::stats_reset() {
  std::lock_guard<std::mutex> lk(stats_mu_);
  for (OpStats& s : stats_.ops) s = OpStats{0, 0, 0.0, std::vector<uint64_t>(size_t(size_), 0)};
}

void Communicator::count_bytes(OpKind kind, int peer, int64_t bytes) {
  if (peer == rank_ || bytes <= 0) return;
  std::lock_guard<std::mutex> lk(stats_mu_);
  OpStats& s = stats_.ops[size_t(kind)];
  s.bytes += uint64_t(bytes);
  s.bytes_to_peer[size_t(peer)] += uint64_t(bytes);
}

std::string Communicator::op_call(OpKind kind) const {
  std::ostringstream os;
  os << op_kind_name(kind) << " #" << seq_ << " on '" << name_ << "'";
  return os.str();
}

std::string Communicator::op_label(OpKind kind) const {
  return op_call(kind) + " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")";
}

void Communicator::set_failed(const std::string& reason) {
  if (failure_.empty()) failure_ = reason;
}

// ---- data movement ----

void Communicator::all_to_all(const void* send, void* recv, int64_t bytes) {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  ZERO8_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "send/recv", "null buffer");
  check_device_buffer(send, "send", OpKind::all_to_all);
  check_device_buffer(recv, "recv", OpKind::all_to_all);
  Call call(*this, OpKind::all_to_all);
  std::vector<int64_t> counts(size_t(size_), bytes), displs(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    displs[size_t(p)] = bytes * p;
    count_bytes(OpKind::all_to_all, p, bytes);
  }
  Staging st(*this, OpKind::all_to_all);
  const void* s = st.input(send, size_, counts.data(), displs.data());
  void* r = st.output(recv, size_, counts.data(), displs.data());
  st.run([&] { do_all_to_all_v(s, counts.data(), displs.data(), r, counts.data(), displs.data(), OpKind::all_to_all); });
}

void Communicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes,
                                const std::vector<int64_t>& send_displs, void* recv,
                                const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs) {
  const size_t n = size_t(size_);
  ZERO8_CHECK_ARG(send_bytes.size() == n && send_displs.size() == n && recv_bytes.size() == n &&
                      recv_displs.size() == n,
                  "send_bytes/send_displs/recv_bytes/recv_displs", "each needs size() = " << size_ << " entries");
  for (size_t p = 0; p < n; ++p) {
    ZERO8_CHECK_ARG(send_bytes[p] >= 0 && send_displs[p] >= 0, "send_bytes/send_displs",
                    "negative entry for rank " << p);
    ZERO8_CHECK_ARG(recv_bytes[p] >= 0 && recv_displs[p] >= 0, "recv_bytes/recv_displs",
                    "negative entry for rank " << p);
    ZERO8_CHECK_ARG(send_bytes[p] == 0 || send != nullptr, "send", "null buffer");
    ZERO8_CHECK_ARG(recv_bytes[p] == 0 || recv != nullptr, "recv", "null buffer");
  }
  ZERO8_CHECK_ARG(send_bytes[size_t(rank_)] == recv_bytes[size_t(rank_)], "recv_bytes",
                  "the chunk to self must have the same size on both sides (send " << send_bytes[size_t(rank_)]
                                                                                   << ", recv " << recv_bytes[size_t(rank_)] << ")");
  check_device_buffer(send, "send", OpKind::all_to_all_v);
  check_device_buffer(recv, "recv", OpKind::all_to_all_v);
  Call call(*this, OpKind::all_to_all_v);
  for (int p = 0; p < size_; ++p) count_bytes(OpKind::all_to_all_v, p, send_bytes[size_t(p)]);
  Staging st(*this, OpKind::all_to_all_v);
  const void* s = st.input(send, size_, send_bytes.data(), send_displs.data());
  void* r = st.output(recv, size_, recv_bytes.data(), recv_displs.data());
  st.run([&] {
    do_all_to_all_v(s, send_bytes.data(), send_displs.data(), r, recv_bytes.data(), recv_displs.data(),
                    OpKind::all_to_all_v);
  });
}

void Communicator::all_gather(const void* send, void* recv, int64_t bytes) {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  ZERO8_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "send/recv", "null buffer");
  check_device_buffer(send, "send", OpKind::all_gather);
  check_device_buffer(recv, "recv", OpKind::all_gather);
  Call call(*this, OpKind::all_gather);
  std::vector<int64_t> counts(size_t(size_), bytes), displs(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    displs[size_t(p)] = bytes * p;
    count_bytes(OpKind::all_gather, p, bytes);
  }
  Staging st(*this, OpKind::all_gather);
  const void* s = st.input(send, 1, &bytes, nullptr);
  void* r = st.output(recv, size_, counts.data(), displs.data());
  st.run([&] { do_all_gather_v(s, bytes, r, counts.data(), displs.data(), OpKind::all_gather); });
}

void Communicator::all_gather_v(const void* send, int64_t send_bytes, void* recv,
                                const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs) {
  const size_t n = size_t(size_);
  ZERO8_CHECK_ARG(recv_bytes.size() == n && recv_displs.size() == n, "recv_bytes/recv_displs",
                  "each needs size() = " << size_ << " entries");
  int64_t total = 0;
  for (size_t p = 0; p < n; ++p) {
    ZERO8_CHECK_ARG(recv_bytes[p] >= 0 && recv_displs[p] >= 0, "recv_bytes/recv_displs", "negative entry for rank " << p);
    total += recv_bytes[p];
  }
  ZERO8_CHECK_ARG(send_bytes == recv_bytes[size_t(rank_)], "send_bytes",
                  send_bytes << " != recv_bytes[rank()] = " << recv_bytes[size_t(rank_)]);
  ZERO8_CHECK_ARG(send_bytes == 0 || send != nullptr, "send", "null buffer");
  ZERO8_CHECK_ARG(total == 0 || recv != nullptr, "recv", "null buffer");
  check_device_buffer(send, "send", OpKind::all_gather_v);
  check_device_buffer(recv, "recv", OpKind::all_gather_v);
  Call call(*this, OpKind::all_gather_v);
  for (int p = 0; p < size_; ++p) count_bytes(OpKind::all_gather_v, p, send_bytes);
  // Staged in place, the send chunk is copied out apart and the backend gathers out of place.
  Staging st(*this, OpKind::all_gather_v);
  const void* s = st.input(send, 1, &send_bytes, nullptr);
  void* r = st.output(recv, size_, recv_bytes.data(), recv_displs.data());
  st.run([&] { do_all_gather_v(s, send_bytes, r, recv_bytes.data(), recv_displs.data(), OpKind::all_gather_v); });
}

void Communicator::broadcast(void* buf, int64_t bytes, int root) {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  ZERO8_CHECK_ARG(root >= 0 && root < size_, "root", root << " is not a rank of a communicator of size " << size_);
  ZERO8_CHECK_ARG(bytes == 0 || buf != nullptr, "buf", "null buffer");
  check_device_buffer(buf, "buf", OpKind::broadcast);
  Call call(*this, OpKind::broadcast);
  if (rank_ == root)
    for (int p = 0; p < size_; ++p) count_bytes(OpKind::broadcast, p, bytes);
  Staging st(*this, OpKind::broadcast);
  void* b = st.output(buf, 1, &bytes, nullptr, rank_ == root);
  st.run([&] { do_broadcast(b, bytes, root); });
}

// ---- reductions ----

void Communicator::reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, ScalarType type,
                                  ReduceOp op) {
  check_scalar_type(type);
  check_reduce_op(op);
  ZERO8_CHECK_ARG(counts.size() == size_t(size_), "counts", "needs size() = " << size_ << " entries, got " << counts.size());
  const int64_t es = scalar_type_size(type);
  int64_t total = 0, my_begin = 0;
  for (int p = 0; p < size_; ++p) {
    ZERO8_CHECK_ARG(counts[size_t(p)] >= 0, "counts", "negative count for rank " << p);
    if (p == rank_) my_begin = total;
    total += counts[size_t(p)];
  }
  const int64_t mine = counts[size_t(rank_)];
  ZERO8_CHECK_ARG(total == 0 || send != nullptr, "send", "null buffer");
  ZERO8_CHECK_ARG(mine == 0 || recv != nullptr, "recv", "null buffer");
  if (mine > 0 && total > 0) {
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    ZERO8_CHECK_ARG(r + mine * es <= s || r >= s + total * es, "recv", "must not overlap send (no in-place reduce_scatter)");
  }
  (void)my_begin;
  check_device_buffer(send, "send", OpKind::reduce_scatter);
  check_device_buffer(recv, "recv", OpKind::reduce_scatter);
  Call call(*this, OpKind::reduce_scatter);
  for (int p = 0; p < size_; ++p) count_bytes(OpKind::reduce_scatter, p, counts[size_t(p)] * es);
  const int64_t send_total = total * es, recv_total = mine * es;
  Staging st(*this, OpKind::reduce_scatter);
  const void* s = st.input(send, 1, &send_total, nullptr);
  void* r = st.output(recv, 1, &recv_total, nullptr);
  st.run([&] { do_reduce_scatter(s, r, counts.data(), type, op); });
}

void Communicator::all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp op) {
  check_scalar_type(type);
  check_reduce_op(op);
  ZERO8_CHECK_ARG(count >= 0, "count", "must be >= 0, got " << count);
  ZERO8_CHECK_ARG(count == 0 || (send != nullptr && recv != nullptr), "send/recv", "null buffer");
  if (count > 0 && send != recv) {
    const int64_t es = scalar_type_size(type);
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    ZERO8_CHECK_ARG(r + count * es <= s || r >= s + count * es, "recv", "must equal send (in place) or not overlap it");
  }
  check_device_buffer(send, "send", OpKind::all_reduce);
  check_device_buffer(recv, "recv", OpKind::all_reduce);
  Call call(*this, OpKind::all_reduce);
  const int64_t es = scalar_type_size(type);
  const int64_t mine = part_begin(count, size_, rank_ + 1) - part_begin(count, size_, rank_);
  for (int p = 0; p < size_; ++p) {
    const int64_t part = part_begin(count, size_, p + 1) - part_begin(count, size_, p);
    count_bytes(OpKind::all_reduce, p, (part + mine) * es);
  }
  const int64_t bytes = count * es;
  Staging st(*this, OpKind::all_reduce);
  if (send == recv) {
    void* b = st.output(recv, 1, &bytes, nullptr, true);
    st.run([&] { do_all_reduce(b, b, count, type, op); });
  } else {
    const void* s = st.input(send, 1, &bytes, nullptr);
    void* r = st.output(recv, 1, &bytes, nullptr);
    st.run([&] { do_all_reduce(s, r, count, type, op); });
  }
}

// Default reduce-scatter: every rank sends peer p its range p (all-to-all), then folds the size()
// contributions to its own range in rank order. Deterministic and equal to a serial left fold.
void Communicator::do_reduce_scatter(const void* send, void* recv, const int64_t* counts, ScalarType type,
                                     ReduceOp op) {
  const int n = size_, me = rank_;
  const int64_t es = scalar_type_size(type);
  std::vector<int64_t> offset(size_t(n) + 1, 0);
  for (int p = 0; p < n; ++p) offset[size_t(p) + 1] = offset[size_t(p)] + counts[p];
  const int64_t mine = counts[me];
  std::vector<char> slots(static_cast<size_t>(mine * es * n));
  std::vector<int64_t> sb(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    sb[size_t(p)] = p == me ? 0 : counts[p] * es;
    sd[size_t(p)] = offset[size_t(p)] * es;
    rb[size_t(p)] = p == me ? 0 : mine * es;
    rd[size_t(p)] = mine * es * p;
  }
  do_all_to_all_v(send, sb.data(), sd.data(), slots.data(), rb.data(), rd.data(), OpKind::reduce_scatter);
  if (mine == 0) return;
  auto contribution = [&](int q) -> const void* {
    return q == me ? static_cast<const char*>(send) + offset[size_t(me)] * es : slots.data() + mine * es * q;
  };
  std::memcpy(recv, contribution(0), size_t(mine * es));
  for (int q = 1; q < n; ++q) fold(recv, contribution(q), mine, type, op);
}

// Default all-reduce: reduce-scatter of near-equal parts (rank-order fold) then all-gather, the
// bandwidth-optimal pair, so every rank ends with the same bits.
void Communicator::do_all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp op) {
  const int n = size_, me = rank_;
  const int64_t es = scalar_type_size(type);
  std::vector<int64_t> counts(static_cast<size_t>(n)), displs(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    displs[size_t(p)] = part_begin(count, n, p);
    counts[size_t(p)] = part_begin(count, n, p + 1) - displs[size_t(p)];
  }
  const int64_t mine = counts[size_t(me)];
  std::vector<char> slots(static_cast<size_t>(mine * es * n));
  std::vector<int64_t> sb(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    sb[size_t(p)] = p == me ? 0 : counts[size_t(p)] * es;
    sd[size_t(p)] = displs[size_t(p)] * es;
    rb[size_t(p)] = p == me ? 0 : mine * es;
    rd[size_t(p)] = mine * es * p;
  }
  do_all_to_all_v(send, sb.data(), sd.data(), slots.data(), rb.data(), rd.data(), OpKind::all_reduce);
  // Fold into a separate buffer: in place, send's own part must stay readable until the fold ends.
  std::vector<char> acc(static_cast<size_t>(mine * es));
  auto contribution = [&](int q) -> const void* {
    return q == me ? static_cast<const char*>(send) + displs[size_t(me)] * es : slots.data() + mine * es * q;
  };
  if (mine > 0) {
    std::memcpy(acc.data(), contribution(0), size_t(mine * es));
    for (int q = 1; q < n; ++q) fold(acc.data(), contribution(q), mine, type, op);
    std::memcpy(static_cast<char*>(recv) + displs[size_t(me)] * es, acc.data(), size_t(mine * es));
  }
  for (int p = 0; p < n; ++p) {
    counts[size_t(p)] *= es;
    displs[size_t(p)] *= es;
  }
  do_all_gather_v(static_cast<char*>(recv) + displs[size_t(me)], counts[size_t(me)], recv, counts.data(),
                  displs.data(), OpKind::all_reduce);
}

// ---- synchronization, point-to-point, split ----

void Communicator::barrier() {
  Call call(*this, OpKind::barrier);
  do_barrier();
}

void Communicator::check_p2p_args(const void* buf, int64_t bytes, int peer, int tag, OpKind kind) const {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  ZERO8_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, "peer",
                  peer << " is not another rank of a communicator of size " << size_ << " (this is rank " << rank_ << ")");
  ZERO8_CHECK_ARG(tag >= 0 && tag <= 32767, "tag", "must be in [0, 32767], got " << tag);
  ZERO8_CHECK_ARG(bytes == 0 || buf != nullptr, "buf", "null buffer");
  check_device_buffer(buf, "buf", kind);
}

void Communicator::send(const void* buf, int64_t bytes, int peer, int tag) {
  check_p2p_args(buf, bytes, peer, tag, OpKind::send);
  Call call(*this, OpKind::send);
  count_bytes(OpKind::send, peer, bytes);
  Staging st(*this, OpKind::send);
  const void* b = st.input(buf, 1, &bytes, nullptr);
  st.run([&] { do_send(b, bytes, peer, tag); });
}

void Communicator::recv(void* buf, int64_t bytes, int peer, int tag) {
  check_p2p_args(buf, bytes, peer, tag, OpKind::recv);
  Call call(*this, OpKind::recv);
  Staging st(*this, OpKind::recv);
  void* b = st.output(buf, 1, &bytes, nullptr);
  st.run([&] { do_recv(b, bytes, peer, tag); });
}

// Queued only where the backend moves the buffers itself on stream(): no staging to wait for.
void Communicator::send_queued(const void* buf, int64_t bytes, int peer, int tag) {
  if (!queues_p2p()) return send(buf, bytes, peer, tag);
  check_p2p_args(buf, bytes, peer, tag, OpKind::send);
  Call call(*this, OpKind::send);
  count_bytes(OpKind::send, peer, bytes);
  do_send_queued(buf, bytes, peer, tag);
}

void Communicator::recv_queued(void* buf, int64_t bytes, int peer, int tag) {
  if (!queues_p2p()) return recv(buf, bytes, peer, tag);
  check_p2p_args(buf, bytes, peer, tag, OpKind::recv);
  Call call(*this, OpKind::recv);
  do_recv_queued(buf, bytes, peer, tag);
}

void Communicator::sync() {
  Call call(*this, OpKind::sync);
  do_sync();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  ZERO8_CHECK_ARG(color >= kNoColor, "color", "must be >= 0, or kNoColor (-1) to opt out, got " << color);
  Call call(*this, OpKind::split);
  std::unique_ptr<Communicator> child = do_split(color, key, name.empty() ? name_ + "/split" : name);
  if (child) {
    child->timeout_s_ = timeout_s_;
    child->stream_ = stream_;
  }
  return child;
}

// ---- topology helpers ----

Topology topology_split(Communicator& world, int pp) {
  ZERO8_CHECK_ARG(pp >= 1 && world.size() % pp == 0, "pp",
                  "the communicator size " << world.size() << " must be a multiple of the pipeline size " << pp);
  Topology t;
  t.pp = pp;
  t.dp = world.size() / pp;
  t.pp_stage = world.rank() / t.dp;
  t.dp_rank = world.rank() % t.dp;
  t.dp_group = world.split(t.pp_stage, world.rank(), "dp[stage " + std::to_string(t.pp_stage) + "]");
  t.pp_group = world.split(t.dp_rank, world.rank(), "pp[dp " + std::to_string(t.dp_rank) + "]");
  ZERO8_ASSERT(t.dp_group->rank() == t.dp_rank && t.pp_group->rank() == t.pp_stage);
  return t;
}

void check_host_memory(const Communicator& c, const std::string& arg, const std::string& user,
                       const std::string& alternative) {
  ZERO8_CHECK_ARG(c.memory() == MemSpace::host, arg,
                  user << " passes host buffers to the communicator, but '" << c.name() << "' (" << c.backend()
                       << ") takes device memory only; use a host communicator (comm_create \"mpi\", \"single\" "
                          "or \"auto\")"
                       << (alternative.empty() ? "" : ", or " + alternative));
}

namespace {
// The device scratch of a *_host helper below: `bytes` (at least 1) on the communicator's device, which is
// current while the scratch lives; the caller's is current again after the scratch is freed (members are
// destroyed in reverse order). `where` names the call in errors.
struct HostScratch {
  const std::string where;
  const device::DeviceGuard on;
  device::Buffer tmp;
  HostScratch(const Communicator& c, const char* op, int64_t bytes)
      : where(std::string(op) + " on '" + c.name() + "'"),
        on(c.device(), where),
        tmp(std::max<int64_t>(bytes, 1), where) {}
  char* data() const { return tmp.as<char>(); }
};
}  // namespace

void all_gather_host(Communicator& c, const void* send, void* recv, int64_t bytes) {
  if (c.memory() == MemSpace::host) return c.all_gather(send, recv, bytes);
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  const int64_t total = bytes * c.size();
  const HostScratch s(c, "all_gather_host", bytes + total);
  char* d = s.data();
  device::copy(d, send, bytes, c.stream(), s.where);
  c.all_gather(d, d + bytes, bytes);
  device::copy(recv, d + bytes, total, c.stream(), s.where);
  device::synchronize(c.stream(), s.where);
}

void all_gather_v_host(Communicator& c, const void* send, int64_t send_bytes, void* recv,
                       const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_displs) {
  if (c.memory() == MemSpace::host) return c.all_gather_v(send, send_bytes, recv, recv_bytes, recv_displs);
  ZERO8_CHECK_ARG(recv_bytes.size() == size_t(c.size()) && recv_displs.size() == size_t(c.size()), "recv_bytes",
                  "need one entry per rank (" << c.size() << "), got " << recv_bytes.size() << " and "
                                              << recv_displs.size());
  int64_t total = 0;
  for (size_t p = 0; p < recv_bytes.size(); ++p) {
    ZERO8_CHECK_ARG(recv_bytes[p] >= 0 && recv_displs[p] >= 0, "recv_bytes",
                    "rank " << p << ": " << recv_bytes[p] << " bytes at " << recv_displs[p]);
    total = std::max(total, recv_displs[p] + recv_bytes[p]);
  }
  const HostScratch s(c, "all_gather_v_host", total);
  char* d = s.data();
  char* mine = d + recv_displs[size_t(c.rank())];
  device::copy(mine, send, send_bytes, c.stream(), s.where);
  c.all_gather_v(mine, send_bytes, d, recv_bytes, recv_displs);  // in place
  for (size_t p = 0; p < recv_bytes.size(); ++p)
    device::copy(static_cast<char*>(recv) + recv_displs[p], d + recv_displs[p], recv_bytes[p], c.stream(), s.where);
  device::synchronize(c.stream(), s.where);
}

void broadcast_host(Communicator& c, void* buf, int64_t bytes, int root) {
  if (c.memory() == MemSpace::host) return c.broadcast(buf, bytes, root);
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  const HostScratch s(c, "broadcast_host", bytes);
  if (c.rank() == root) device::copy(s.data(), buf, bytes, c.stream(), s.where);
  c.broadcast(s.data(), bytes, root);
  device::copy(buf, s.data(), bytes, c.stream(), s.where);
  device::synchronize(c.stream(), s.where);
}

void send_host(Communicator& c, const void* buf, int64_t bytes, int peer, int tag) {
  if (c.memory() == MemSpace::host) return c.send(buf, bytes, peer, tag);
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  const HostScratch s(c, "send_host", bytes);
  device::copy(s.data(), buf, bytes, c.stream(), s.where);
  c.send(s.data(), bytes, peer, tag);
}

void recv_host(Communicator& c, void* buf, int64_t bytes, int peer, int tag) {
  if (c.memory() == MemSpace::host) return c.recv(buf, bytes, peer, tag);
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", "must be >= 0, got " << bytes);
  const HostScratch s(c, "recv_host", bytes);
  c.recv(s.data(), bytes, peer, tag);
  device::copy(buf, s.data(), bytes, c.stream(), s.where);
  device::synchronize(c.stream(), s.where);
}

void all_reduce_host(Communicator& c, void* data, int64_t count, ScalarType type, ReduceOp op) {
  if (c.memory() == MemSpace::host) return c.all_reduce(data, data, count, type, op);
  ZERO8_CHECK_ARG(count >= 0, "count", "must be >= 0, got " << count);
  const int64_t bytes = count * scalar_type_size(type);
  const HostScratch s(c, "all_reduce_host", bytes);
  device::copy(s.data(), data, bytes, c.stream(), s.where);
  c.all_reduce(s.data(), s.data(), count, type, op);
  device::copy(data, s.data(), bytes, c.stream(), s.where);
  device::synchronize(c.stream(), s.where);
}

NodeGroups node_groups(Communicator& world) {
  check_host_memory(world, "world", "node_groups");
  // Fixed-size names keep this one all_gather; longer node names are compared by their prefix.
  constexpr size_t kName = 256;
  std::string node = detail::env_comm_node();
  std::vector<char> mine(kName, 0), all(kName * size_t(world.size()), 0);
  std::memcpy(mine.data(), node.data(), std::min(node.size(), kName - 1));
  world.all_gather(mine.data(), all.data(), int64_t(kName));
  auto name_of = [&](int r) { return std::string(all.data() + kName * size_t(r)); };
  NodeGroups g;
  std::vector<std::string> nodes;
  for (int r = 0; r < world.size(); ++r) {
    const std::string n = name_of(r);
    const auto it = std::find(nodes.begin(), nodes.end(), n);
    const int idx = int(it - nodes.begin());
    if (it == nodes.end()) nodes.push_back(n);
    if (r == world.rank()) g.node = idx;
  }
  g.nodes = int(nodes.size());
  g.local_rank = 0;
  g.local_size = 0;
  const std::string me = name_of(world.rank());
  for (int r = 0; r < world.size(); ++r) {
    if (name_of(r) != me) continue;
    if (r < world.rank()) ++g.local_rank;
    ++g.local_size;
  }
  g.intra = world.split(g.node, world.rank(), "node[" + std::to_string(g.node) + "]");
  g.inter = world.split(g.local_rank, world.rank(), "inter[" + std::to_string(g.local_rank) + "]");
  return g;
}

// ---- what the backends share ----

namespace detail {
std::vector<int> split_members(const std::vector<int32_t>& pairs, int color) {
  std::vector<int> members;
  for (size_t p = 0; 2 * p < pairs.size(); ++p)
    if (pairs[2 * p] == color) members.push_back(int(p));
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return pairs[size_t(2 * a + 1)] < pairs[size_t(2 * b + 1)]; });
  return members;
}
}  // namespace detail

// ---- factory ----

namespace {
const char* env_set(const char* var) {
  const char* s = std::getenv(var);
  return s != nullptr && *s != '\0' ? s : nullptr;
}

// `var` as a whole decimal integer; false where unset or not one (then it neither confirms nor contradicts).
bool env_long(const char* var, long* out) {
  const char* s = env_set(var);
  if (s == nullptr) return false;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0') return false;
  *out = v;
  return true;
}

// The rank and size an MPI launcher's variables give this process: mpirun (OpenMPI) sets
// OMPI_COMM_WORLD_RANK/SIZE, a PMI launcher (MPICH's hydra, srun --mpi=pmi2) PMI_RANK/SIZE, a PMIx
// launcher (srun --mpi=pmix) PMIX_RANK, the size then being the step's task count (0: not known).
struct MpiLaunchVars {
  const char* rank_var = nullptr;
  const char* size_var = nullptr;
  long rank = -1, size = 0;  // -1, 0: not given
};

bool mpi_launch_vars(MpiLaunchVars* v) {
  for (const auto& pair : {std::pair<const char*, const char*>{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                           std::pair<const char*, const char*>{"PMI_RANK", "PMI_SIZE"}}) {
    if (env_set(pair.second) == nullptr) continue;
    v->rank_var = pair.first;
    v->size_var = pair.second;
    env_long(pair.first, &v->rank);
    env_long(pair.second, &v->size);
    return true;
  }
  if (env_set("PMIX_RANK") == nullptr) return false;
  v->rank_var = "PMIX_RANK";
  env_long("PMIX_RANK", &v->rank);
  for (const char* var : {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"})
    if (env_long(var, &v->size)) {
      v->size_var = var;
      break;
    }
  return true;
}

// Why a process with an MPI launcher's variables is not one of that launcher's ranks ("" where it is).
// torchrun (or DeepSpeed's launcher) started under mpirun or srun (`srun --mpi=pmix torchrun ...`, one
// agent per node) hands its workers the launcher's variables along with a world of its own (RANK,
// WORLD_SIZE); MPI would see one rank per agent, or fail to start. zero8-launch's wrapper sets RANK and
// WORLD_SIZE equal to the launcher's, so its jobs stay MPI.
std::string not_an_mpi_rank_why(const MpiLaunchVars& v) {
  if (env_set("TORCHELASTIC_RUN_ID") != nullptr)
    return "TORCHELASTIC_RUN_ID is set: torchrun started it, under the MPI launcher whose variables it inherited";
  std::ostringstream os;
  long rank = 0, size = 0;
  if (v.rank >= 0 && env_long("RANK", &rank) && rank != v.rank)
    os << "RANK " << rank << " is not the MPI launcher's " << v.rank_var << " " << v.rank;
  else if (v.size > 0 && env_long("WORLD_SIZE", &size) && size != v.size)
    os << "WORLD_SIZE " << size << " is not the MPI launcher's " << v.size_var << " " << v.size;
  return os.str();
}

bool launched_by_mpi_launcher(int* size) {
  MpiLaunchVars v;
  if (!mpi_launch_vars(&v) || !not_an_mpi_rank_why(v).empty()) return false;
  *size = int(v.size);
  return true;
}

// A process that is not an MPI launcher's rank but whose environment says it is one of several would
// make a world of one and train alone, silently disagreeing with its peers: refused, naming the
// launchers that work. Two cases: a launcher without MPI (torchrun, DeepSpeed's) set WORLD_SIZE; srun
// started several tasks without PMI (MpiDefault=none and no --mpi), which sets neither PMI's variables
// nor WORLD_SIZE. SLURM_STEP_NUM_TASKS is the step's count, so a batch script's own python (the batch
// step, one task) is left alone. "single" is left alone (asked for by name).
void check_launched_for(const std::string& backend) {
  MpiLaunchVars v;
  const bool mpi_vars = mpi_launch_vars(&v);
  const std::string not_a_rank = mpi_vars ? not_an_mpi_rank_why(v) : "";
  if (mpi_vars && not_a_rank.empty()) return;  // an MPI launcher's rank (launched_by_mpi_launcher)
  const char* ws = env_set("WORLD_SIZE");
  long tasks = 0;
  if (ws == nullptr && !mpi_vars && env_set("SLURM_PROCID") != nullptr && env_long("SLURM_STEP_NUM_TASKS", &tasks) &&
      tasks > 1)
    ZERO8_THROW(unsupported,
                "communicator backend '"
                    << backend << "': srun started this process as task " << env_set("SLURM_PROCID") << " of "
                    << tasks << " (SLURM_PROCID, SLURM_STEP_NUM_TASKS) without PMI (none of PMI_RANK, PMI_SIZE, "
                                "PMIX_RANK, OMPI_COMM_WORLD_SIZE is set) and without WORLD_SIZE, so each task would "
                                "make a world of one and train alone. Start the tasks with srun --mpi=pmix (or "
                                "--mpi=pmi2) for MPI, run torchrun under srun (one per node), or use zero8-launch "
                                "--launcher slurm; for tasks meant to run independently, ask for it: "
                                "\"comm_backend\": \"single\" (comm_create(\"single\") in C++)");
  if (ws == nullptr || std::atoi(ws) <= 1) return;
  std::ostringstream why;
  if (mpi_vars)
    why << "this process is not one of the ranks of the MPI launcher whose variables it has ("
        << not_a_rank << "), so MPI would not make this world";
  else
    why << "no MPI launcher started this process (none of OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK is set), and "
           "each rank would train alone";
  ZERO8_THROW(unsupported, "communicator backend '"
                               << backend << "': WORLD_SIZE is " << ws << ", but " << why.str()
                               << ". Under torchrun or DeepSpeed's launcher use the 'tcp' backend (zero8.initialize "
                                  "makes it for \"comm_backend\": \"auto\" or \"tcp\", and NCCL over it for a model "
                                  "on GPUs; in C++ tcp_create and nccl_create_over), or start the job with "
                                  "zero8-launch --num_procs "
                               << ws << " or mpirun -np " << ws << " for MPI");
}
}  // namespace

#if !ZERO8_WITH_NCCL
constexpr const char* kNoNccl = "zero8 was not built with NCCL (needs CUDA and NCCL; configure with -DZERO8_NCCL=ON)";
#endif

bool comm_backend_available(const std::string& backend) {
  if (backend == "single" || backend == "auto" || backend == "tcp") return true;
  if (backend == "mpi") return ZERO8_WITH_MPI != 0;
  if (backend == "nccl") return ZERO8_WITH_NCCL != 0;
  return false;
}

std::string comm_auto_backend(MemSpace memory) {
  int launched_size = 0;
  if (!launched_by_mpi_launcher(&launched_size)) return "single";
  if (memory == MemSpace::device && launched_size > 1 && ZERO8_WITH_NCCL != 0) return "nccl";
  // Several processes without MPI: "mpi", whose creation says that it is missing (as "auto" does).
  return ZERO8_WITH_MPI != 0 || launched_size > 1 ? "mpi" : "single";
}

std::unique_ptr<Communicator> comm_create(const std::string& backend) {
  if (backend == "single") return detail::single_create();
  if (backend == "tcp")
    ZERO8_THROW(unsupported, "communicator backend 'tcp': it needs a rendezvous (every rank's address), so it is "
                             "made by zero8.initialize under torchrun or DeepSpeed's launcher (through "
                             "torch.distributed's store), or in C++ by tcp_create(rank, size, exchange)");
  if (backend == "mpi" || backend == "nccl" || backend == "auto") check_launched_for(backend);
  if (backend == "mpi") {
#if ZERO8_WITH_MPI
    return detail::mpi_create();
#else
    ZERO8_THROW(unsupported, "communicator backend 'mpi': zero8 was not built with MPI (install OpenMPI, "
                             "e.g. scripts/setup.sh, and configure with -DZERO8_MPI=ON)");
#endif
  }
  if (backend == "nccl") {
#if ZERO8_WITH_NCCL
    return detail::nccl_create();
#else
    ZERO8_THROW(unsupported, "communicator backend 'nccl': " << kNoNccl);
#endif
  }
  if (backend == "auto") {
    int launched_size = 0;
    if (!launched_by_mpi_launcher(&launched_size)) return detail::single_create();
#if ZERO8_WITH_MPI
    return detail::mpi_create();
#else
    // N copies of a single-process job would each train alone and silently disagree.
    if (launched_size > 1)
      ZERO8_THROW(unsupported, "communicator backend 'auto': started by an MPI launcher with "
                                   << launched_size << " processes, but zero8 was not built with MPI");
    return detail::single_create();
#endif
  }
  ZERO8_THROW(invalid_argument, "invalid argument 'backend': unknown communicator backend '"
                                    << backend << "' (expected auto, single, mpi, nccl or tcp)");
}

std::unique_ptr<Communicator> nccl_or_host_create() {
  check_launched_for("nccl");
#if ZERO8_WITH_NCCL
  return detail::nccl_create(true);
#else
  ZERO8_THROW(unsupported, "communicator backend 'nccl': " << kNoNccl);
#endif
}

std::vector<int> gpu_owners(Communicator& comm, int device) {
#if ZERO8_WITH_NCCL
  return detail::gpu_owners(comm, device);
#else
  (void)device;
  ZERO8_THROW(unsupported, "gpu_owners: " << kNoNccl);
#endif
}

std::unique_ptr<Communicator> nccl_create_over(std::unique_ptr<Communicator> host, bool host_if_shared) {
  ZERO8_CHECK_ARG(host != nullptr, "host", "null (pass the world communicator NCCL is to bootstrap over)");
  auto* h = dynamic_cast<detail::HostComm*>(host.get());
  ZERO8_CHECK_ARG(h != nullptr, "host",
                  host->description() << " cannot bootstrap NCCL: pass a communicator of the 'tcp' or 'mpi' backend");
#if ZERO8_WITH_NCCL
  host.release();
  return detail::nccl_create_over(std::unique_ptr<detail::HostComm>(h), host_if_shared);
#else
  ZERO8_THROW(unsupported, "nccl_create_over: " << kNoNccl);
#endif
}

}  // namespace zero8::comm
