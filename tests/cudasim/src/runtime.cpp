// zero8's CUDA simulator: the runtime API on one simulated device (ZERO8_CUDA=SIM, tests only).
//
// Device memory: each cudaMalloc maps its own pages, the allocation ending at a guard page, and the pages
// are inaccessible except while the simulator runs device work; host code that dereferences a device
// pointer, or a kernel that runs past its allocation, faults and the report names it.
//
// Streams: work is queued and runs only when the host waits for it (a synchronize, an event query, a copy
// to host memory that the runtime documents as synchronous), so host code that reads a result before
// waiting for it reads stale memory, and a stream that uses another's result without an event sees it
// missing. Each device has its own legacy default stream, ordered with that device's blocking streams;
// non-blocking streams are not. A stream and an event belong to the device current when they were made: a
// kernel launched on another device's stream and an event recorded on another device's stream fail with
// cudaErrorInvalidResourceHandle, as on a machine with several GPUs ("Stream and Event Behavior" in the
// CUDA C++ Programming Guide's multi-device section); copies and waits across devices succeed.
// Copies follow the runtime's documented synchronization ("API synchronization behavior" in the CUDA
// runtime API reference): from pageable host memory the source is read at the call; to pageable host
// memory the call returns after the copy; pinned memory and device-to-device copies are asynchronous.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda.h"
#include "sim.h"

struct CUstream_st {
  // Operations return false while they wait for another process (a peer's NCCL part): see run_until.
  struct Op {
    const char* what;
    std::function<bool()> run;
    int memory;  // the devices whose memory it may touch: zero8_cudasim::kAllDevices or one device
  };
  std::deque<Op> queue;
  int device = 0;
  uint64_t queued = 0, done = 0;  // operations ever queued / run
  bool blocking = true;
  bool told_not_ready = false;
};

struct CUevent_st {
  int device = 0;                 // current when it was made
  CUstream_st* stream = nullptr;  // where it was last recorded
  uint64_t position = 0;          // done when stream->done >= position
  bool timing = true;
  bool recorded = false;
  bool told_not_ready = false;
  std::shared_ptr<std::chrono::steady_clock::time_point> when;  // set when the record runs
};

namespace zero8_cudasim {
namespace {

enum class Kind { device, managed, pinned };

struct Alloc {
  char* base = nullptr;  // what the program got
  size_t bytes = 0;
  char* map = nullptr;  // the mapping (guard page included)
  size_t map_bytes = 0;
  Kind kind = Kind::device;
  int device = 0;
  bool open = true;  // its pages are accessible (device memory: only while device work that may touch it runs)
};

struct State {
  std::recursive_mutex mu;
  std::map<uintptr_t, Alloc> allocs;  // by base address
  std::set<CUstream_st*> streams;
  // Destroyed streams, all their work done: kept, because events recorded on them and waits queued on other
  // streams still name them (CUDA completes those), and never reused as another stream's address.
  std::vector<std::unique_ptr<CUstream_st>> retired;
  std::set<CUevent_st*> events;
  std::map<const void*, int> max_dyn_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
  static constexpr int kMaxDevices = 16;  // ZERO8_CUDASIM_DEVICES' limit
  CUstream_st legacy[kMaxDevices], per_thread[kMaxDevices];  // per device
  int open_memory = kNoDevice;  // whose device memory is accessible now (DeviceAccess)
  zero8_cudasim_counts counts{};
  bool context = false;
  State() {
    for (int d = 0; d < kMaxDevices; ++d) {
      legacy[d].device = per_thread[d].device = d;
      streams.insert(&legacy[d]);
      streams.insert(&per_thread[d]);
    }
  }
  bool is_legacy(const CUstream_st* s) const { return s == &legacy[s->device]; }
};

State& st() {
  static State* s = new State;  // never destroyed: streams may be used by static destructors
  return *s;
}

thread_local cudaError_t tl_last = cudaSuccess;
thread_local int tl_device = 0;
constexpr size_t kSmemDefault = 48 * 1024, kSmemOptin = 227 * 1024;
constexpr unsigned char kCanary = 0xa5;

size_t page() { return size_t(getpagesize()); }

// ZERO8_CUDASIM_TRACE: every operation printed as it is queued and as it runs.
bool tracing() {
  static const bool on = std::getenv("ZERO8_CUDASIM_TRACE") != nullptr;
  return on;
}

// Devices of the simulated machine (ZERO8_CUDASIM_DEVICES, default 1): labels on one memory, so that ranks
// can each have one (NCCL refuses two ranks on a device). This process sees those CUDA_VISIBLE_DEVICES
// lists, as CUDA does (numbered from 0 in the list's order; the list ends at its first entry that is not a
// device of the machine; unset: all), so that ranks can each see a device of their own as device 0.
const std::vector<int>& visible_devices() {
  static const std::vector<int> v = [] {
    const int machine = int(env_number("ZERO8_CUDASIM_DEVICES", 1, 1, 16));
    std::vector<int> out;
    const char* list = std::getenv("CUDA_VISIBLE_DEVICES");
    if (list == nullptr) {
      for (int d = 0; d < machine; ++d) out.push_back(d);
      return out;
    }
    std::stringstream entries(list);
    std::string entry;
    while (std::getline(entries, entry, ',')) {
      char* end = nullptr;
      const long d = std::strtol(entry.c_str(), &end, 10);
      if (entry.empty() || *end != 0 || d < 0 || d >= machine) break;
      out.push_back(int(d));
    }
    return out;
  }();
  return v;
}

int devices() { return int(visible_devices().size()); }

int sms() {
  static const int n = int(env_number("ZERO8_CUDASIM_SMS", 2, 1, 1024));
  return n;
}

Alloc* find(const void* p) {
  State& s = st();
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.upper_bound(u);
  if (it == s.allocs.begin()) return nullptr;
  --it;
  Alloc& a = it->second;
  return u < uintptr_t(a.base) + (a.bytes > 0 ? a.bytes : 1) ? &a : nullptr;
}

// Device memory of device `memory` (kAllDevices: of every device; kNoDevice: none) is accessible.
bool accessible(const Alloc& a, int memory) {
  return a.kind != Kind::device || memory == kAllDevices || (memory != kNoDevice && a.device == memory);
}

void protect(Alloc& a, int memory) {
  const bool open = accessible(a, memory);
  if (open == a.open) return;
  const size_t data = a.map_bytes - page();  // the last page is the guard
  if (mprotect(a.map, data, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) fatal("mprotect failed");
  a.open = open;
}

// While this is held, the device memory that device work may touch is accessible: a kernel's own device's
// (a GPU faults on another's without peer access, which zero8 never enables), a copy's every device's.
// Device work runs under the runtime lock; nested work (a wait that runs another stream) restores the outer
// work's view when it ends.
class DeviceAccess {
 public:
  explicit DeviceAccess(int memory) : outer_(st().open_memory) { open(memory); }
  ~DeviceAccess() { open(outer_); }
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;

 private:
  static void open(int memory) {
    State& s = st();
    if (s.open_memory == memory) return;
    s.open_memory = memory;
    for (auto& [u, a] : s.allocs) protect(a, memory);
  }
  int outer_;
};

void install_fault_handler();

// Device memory: the allocation's end 256-byte aligned against a guard page, so an overrun faults.
cudaError_t map_alloc(void** p, size_t bytes, Kind kind) {
  if (p == nullptr) return set_error(cudaErrorInvalidValue);
  install_fault_handler();
  const size_t span = (bytes + 255) / 256 * 256;
  const size_t data = (span + page() - 1) / page() * page();
  const size_t total = data + page();
  void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return set_error(cudaErrorMemoryAllocation);
  char* map = static_cast<char*>(m);
  mprotect(map + data, page(), PROT_NONE);
  Alloc a;
  a.map = map;
  a.map_bytes = total;
  a.base = map + data - span;
  a.bytes = bytes;
  a.kind = kind;
  a.device = tl_device;
  std::memset(a.base, kCanary, span);  // fresh device memory is garbage, not zeros; past the end, canaries
  State& s = st();
  s.context = true;
  protect(a, s.open_memory);
  s.allocs[uintptr_t(a.base)] = a;
  *p = a.base;
  return cudaSuccess;
}

cudaError_t unmap_alloc(void* p, bool pinned) {
  State& s = st();
  if (p == nullptr) return cudaSuccess;
  auto it = s.allocs.find(uintptr_t(p));
  if (it == s.allocs.end() || (it->second.kind == Kind::pinned) != pinned) return set_error(cudaErrorInvalidValue);
  munmap(it->second.map, it->second.map_bytes);
  s.allocs.erase(it);
  return cudaSuccess;
}

CUstream_st* stream_of(cudaStream_t s) {
  State& g = st();
  if (s == nullptr || s == cudaStreamLegacy) return &g.legacy[tl_device];
  if (s == cudaStreamPerThread) return &g.per_thread[tl_device];
  return g.streams.count(s) ? s : nullptr;
}

bool pending(const CUstream_st* s) { return s->done < s->queued; }

bool run_until(CUstream_st* s, uint64_t position);

// Work queued on s waits for the work now queued on w.
void order_after(CUstream_st* s, CUstream_st* w) {
  if (!pending(w)) return;
  const uint64_t pos = w->queued;
  s->queue.push_back({"implicit wait (legacy default stream)", [w, pos] { return run_until(w, pos); }, kNoDevice});
  ++s->queued;
}

// Between an allocation's end and its guard page lie up to 255 bytes (the start is 256-byte aligned, as
// cudaMalloc's is): they hold kCanary, and a write past the end that stays short of the guard page shows here.
void check_canaries(const char* op) {
  DeviceAccess all(kAllDevices);
  for (auto& [u, a] : st().allocs) {
    if (a.kind == Kind::pinned) continue;
    const char* end = a.base + a.bytes;
    const char* stop = a.map + a.map_bytes - page();
    for (const char* p = end; p < stop; ++p)
      if (static_cast<unsigned char>(*p) != kCanary) {
        std::ostringstream s;
        s << op << " wrote past the end of the allocation of " << a.bytes << " bytes at "
          << static_cast<const void*>(a.base) << " (at byte " << (p - a.base) << ")";
        fatal(s.str());
      }
  }
}

// Runs s's work up to `position` as far as it goes now. An operation that waits for another process (a
// peer's NCCL part: it returns false) stays first in the queue, and the stream stops there: false. So a
// query answers "not ready" while a peer is missing, as on a GPU, where the NCCL kernel spins.
bool run_until(CUstream_st* s, uint64_t position) {
  if (s->done >= position || s->queue.empty()) return true;
  while (s->done < position && !s->queue.empty()) {
    auto op = std::move(s->queue.front());
    s->queue.pop_front();
    ++s->done;  // before running: a wait inside may come back to this stream
    if (tracing()) std::fprintf(stderr, "cudasim: %s runs (stream %p)\n", op.what, static_cast<void*>(s));
    bool ran;
    {
      DeviceAccess access(op.memory);
      ran = op.run();
    }
    if (!ran) {
      --s->done;
      s->queue.push_front(std::move(op));
      return false;
    }
    check_canaries(op.what);
  }
  return true;
}

// run_until for a host that blocks (a synchronize, a synchronous copy): waits for other processes.
void run_until_done(CUstream_st* s, uint64_t position) {
  auto pause = std::chrono::microseconds(20);
  while (!run_until(s, position)) {
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(2)) pause *= 2;
  }
}

void run_all() {
  State& g = st();
  for (CUstream_st* s : std::vector<CUstream_st*>(g.streams.begin(), g.streams.end())) run_until_done(s, s->queued);
}

struct Lock {
  std::lock_guard<std::recursive_mutex> g{st().mu};
};

[[noreturn]] void on_fault(int sig, siginfo_t* info, void*) {
  char buf[512];
  const void* addr = info->si_addr;
  const Alloc* a = nullptr;
  const Alloc* near = nullptr;
  for (auto& [u, al] : st().allocs) {
    if (addr >= static_cast<const void*>(al.map) && addr < static_cast<const void*>(al.map + al.map_bytes)) {
      near = &al;
      if (addr >= static_cast<const void*>(al.base) && addr < static_cast<const void*>(al.base + al.bytes)) a = &al;
    }
  }
  const std::string where = where_in_kernel();
  const int open = st().open_memory;
  if (a != nullptr && open >= 0 && a->kind == Kind::device && a->device != open) {
    std::snprintf(buf, sizeof buf,
                  "%s%saccess at %p to device %d's memory (allocation of %zu bytes at %p) by work on device %d: "
                  "a GPU faults there without peer access",
                  where.c_str(), where.empty() ? "" : ": ", addr, a->device, a->bytes,
                  static_cast<const void*>(a->base), open);
  } else if (!where.empty() && near != nullptr && a == nullptr) {
    std::snprintf(buf, sizeof buf,
                  "%s: access at %p outside the allocation of %zu bytes at %p (%td bytes from its start)",
                  where.c_str(), addr, near->bytes, static_cast<const void*>(near->base),
                  static_cast<const char*>(addr) - near->base);
  } else if (where.empty() && a != nullptr) {
    std::snprintf(buf, sizeof buf,
                  "host code dereferenced device memory at %p (allocation of %zu bytes at %p): "
                  "copy it to the host first",
                  addr, a->bytes, static_cast<const void*>(a->base));
  } else {
    std::snprintf(buf, sizeof buf, "%s%s%s at %p", where.empty() ? "" : where.c_str(), where.empty() ? "" : ": ",
                  sig == SIGSEGV ? "segmentation fault" : "bus error", addr);
  }
  std::fprintf(stderr, "cudasim: %s\n", buf);
  std::fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
  std::abort();
}

void install_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::vector<char> alt(1 << 16);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, nullptr);
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
  });
}

CUresult drv_ctx_get_current(CUcontext* c) {
  *c = st().context ? reinterpret_cast<CUcontext>(&st()) : nullptr;
  return CUDA_SUCCESS;
}
CUresult drv_device_get(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult drv_primary_state(CUdevice d, unsigned* flags, int* active) {
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = st().context ? 1 : 0;
  return CUDA_SUCCESS;
}

bool is_host(const void* p) {
  const Alloc* a = find(p);
  return a == nullptr || a->kind == Kind::pinned;
}
bool is_pageable(const void* p) { return find(p) == nullptr; }

// A copy's validity: device-side ranges inside one allocation, the kind matching the pointers.
cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  const bool dh = is_host(dst), sh = is_host(src);
  if ((!dh && !device_range(dst, bytes)) || (!sh && !device_range(src, bytes))) return cudaErrorInvalidValue;
  switch (kind) {
    case cudaMemcpyHostToHost: return dh && sh ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToDevice: return sh && !dh ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost: return !sh && dh ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice: return !sh && !dh ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault: return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream, bool sync) {
  Lock l;
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (const cudaError_t e = check_copy(dst, src, bytes, kind); e != cudaSuccess) return set_error(e);
  if (bytes == 0) return cudaSuccess;
  const bool dh = is_host(dst), sh = is_host(src);
  if (dh && !sh) ++st().counts.copies_to_host;
  if (sh && !dh) ++st().counts.copies_to_device;
  if (dh && sh) {  // host to host: synchronous
    run_until_done(s, s->queued);
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  if (sh && is_pageable(src)) {
    // Staged: the source is read now, the copy to the device runs in stream order.
    if (sync) run_until_done(s, s->queued);
    auto staged =
        std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    enqueue(stream, "cudaMemcpy (from pageable host memory)",
            [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); }, kAllDevices);
    return cudaSuccess;
  }
  enqueue(stream, "cudaMemcpy", [dst, src, bytes] { std::memmove(dst, src, bytes); }, kAllDevices);
  // To host memory the call returns after the copy (pageable always; pinned when synchronous); from pinned
  // host memory a synchronous copy waits too.
  if ((dh && (sync || is_pageable(dst))) || (sync && sh)) run_until_done(s, s->queued);
  return cudaSuccess;
}

cudaError_t memset_impl(void* p, int value, size_t bytes, cudaStream_t stream, bool sync) {
  Lock l;
  if (bytes == 0) return cudaSuccess;
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (!device_range(p, bytes)) return set_error(cudaErrorInvalidValue);
  enqueue(stream, "cudaMemset", [p, value, bytes] { std::memset(p, value, bytes); }, kAllDevices);
  if (sync && find(p)->kind == Kind::pinned) run_until_done(s, s->queued);
  return cudaSuccess;
}

}  // namespace

std::recursive_mutex& runtime_mutex() { return st().mu; }

int machine_device(int device) { return visible_devices().at(size_t(device)); }

double env_number(const char* name, double fallback, double lo, double hi) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  return end != v && *end == 0 && x >= lo && x <= hi ? x : fallback;
}

void fatal(const std::string& what) {
  const std::string where = where_in_kernel();
  std::fprintf(stderr, "cudasim: %s%s%s\n", where.c_str(), where.empty() ? "" : ": ", what.c_str());
  std::fflush(stderr);
  std::abort();
}

cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) tl_last = e;
  return e;
}

bool device_range(const void* p, size_t bytes) {
  const Alloc* a = find(p);
  if (a == nullptr || a->kind == Kind::pinned) return false;
  return static_cast<const char*>(p) + bytes <= a->base + a->bytes;
}

cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<void()> op, int memory) {
  return enqueue_waiting(
      stream, what,
      [op = std::move(op)] {
        op();
        return true;
      },
      memory);
}

cudaError_t enqueue_waiting(cudaStream_t stream, const char* what, std::function<bool()> op, int memory) {
  Lock l;
  State& g = st();
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  g.context = true;
  install_fault_handler();
  if (g.is_legacy(s)) {
    ++g.counts.ops_legacy_stream;
    for (CUstream_st* o : g.streams)
      if (o != s && o->blocking && o->device == s->device) order_after(s, o);
  } else if (s->blocking) {
    order_after(s, &g.legacy[s->device]);
  }
  if (tracing()) std::fprintf(stderr, "cudasim: %s queued on stream %p\n", what, static_cast<void*>(s));
  s->queue.push_back({what, std::move(op), memory == kStreamsDevice ? s->device : memory});
  ++s->queued;
  s->told_not_ready = false;
  return cudaSuccess;
}

void launch_kernel(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   std::function<void()> body) {
  Lock l;
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      threads > 1024) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  size_t limit = kSmemDefault;
  if (auto it = st().max_dyn_smem.find(kernel); it != st().max_dyn_smem.end()) limit = size_t(it->second);
  if (smem > limit) {
    set_error(cudaErrorInvalidValue);
    return;
  }
  const CUstream_st* s = stream_of(stream);
  if (s == nullptr || s->device != tl_device) {  // a stream of another device: the launch fails
    set_error(cudaErrorInvalidResourceHandle);
    return;
  }
  ++st().counts.kernels;
  enqueue(stream, name, [name, grid, block, smem, body = std::move(body)] { run_grid(name, grid, block, smem, body); });
}

}  // namespace zero8_cudasim

using namespace zero8_cudasim;

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return cudaGetErrorName(e);
  }
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = tl_last;
  tl_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return tl_last; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return set_error(cudaErrorInvalidValue);
  *count = devices();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return set_error(cudaErrorInvalidValue);
  *device = tl_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= devices()) return set_error(cudaErrorInvalidDevice);
  tl_device = device;
  Lock l;
  st().context = true;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (p == nullptr) return set_error(cudaErrorInvalidValue);
  if (device < 0 || device >= devices()) return set_error(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "zero8 CUDA simulator (CPU, %d SMs)", sms());
  p->totalGlobalMem = size_t(16) << 30;
  p->sharedMemPerBlock = kSmemDefault;
  p->sharedMemPerBlockOptin = kSmemOptin;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsPerMultiProcessor = 2048;
  p->multiProcessorCount = sms();
  p->major = 9;
  p->minor = 0;
  // One UUID per device of the machine, whatever index CUDA_VISIBLE_DEVICES gives it in this process.
  std::memcpy(p->uuid.bytes, "zero8-cudasim-", 14);
  p->uuid.bytes[15] = char(machine_device(device));
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return set_error(cudaErrorInvalidValue);
  if (device < 0 || device >= devices()) return set_error(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = int(kSmemDefault); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = sms(); break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(kSmemOptin); break;
    default: return set_error(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

// The current device's streams only: another device's work may still be queued, as on a GPU.
cudaError_t cudaDeviceSynchronize() {
  Lock l;
  ++st().counts.host_waits;
  State& g = st();
  for (CUstream_st* s : std::vector<CUstream_st*>(g.streams.begin(), g.streams.end()))
    if (s->device == tl_device) run_until_done(s, s->queued);
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr) return set_error(cudaErrorInvalidValue);
  const std::string s = symbol;
  *fn = s == "cuCtxGetCurrent"              ? reinterpret_cast<void*>(&drv_ctx_get_current)
        : s == "cuDeviceGet"                ? reinterpret_cast<void*>(&drv_device_get)
        : s == "cuDevicePrimaryCtxGetState" ? reinterpret_cast<void*>(&drv_primary_state)
                                            : nullptr;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Lock l;
  return map_alloc(p, bytes, Kind::device);
}
cudaError_t cudaMallocManaged(void** p, size_t bytes, unsigned) {
  Lock l;
  return map_alloc(p, bytes, Kind::managed);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  Lock l;
  return map_alloc(p, bytes, Kind::pinned);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }

cudaError_t cudaFree(void* p) {
  Lock l;
  run_all();  // cudaFree waits for the device
  return unmap_alloc(p, false);
}
cudaError_t cudaFreeHost(void* p) {
  Lock l;
  run_all();
  return unmap_alloc(p, true);
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream) {
  Lock l;
  if (stream_of(stream) == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  return map_alloc(p, bytes, Kind::device);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  Lock l;
  if (p == nullptr) return cudaSuccess;
  const auto it = st().allocs.find(uintptr_t(p));
  if (it == st().allocs.end() || it->second.kind == Kind::pinned) return set_error(cudaErrorInvalidValue);
  return enqueue(stream, "cudaFreeAsync", [p] { (void)unmap_alloc(p, false); }, kNoDevice);
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  if (attr == nullptr) return set_error(cudaErrorInvalidValue);
  Lock l;
  ++st().counts.pointer_queries;
  *attr = cudaPointerAttributes{};
  attr->device = -2;
  const Alloc* a = find(p);
  if (a == nullptr) return cudaSuccess;  // cudaMemoryTypeUnregistered
  attr->device = a->device;
  attr->type = a->kind == Kind::device    ? cudaMemoryTypeDevice
               : a->kind == Kind::managed ? cudaMemoryTypeManaged
                                          : cudaMemoryTypeHost;
  attr->devicePointer = const_cast<void*>(p);
  attr->hostPointer = a->kind == Kind::device ? nullptr : const_cast<void*>(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, src, bytes, kind, nullptr, true);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return copy(dst, src, bytes, kind, stream, false);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return memset_impl(p, value, bytes, nullptr, true); }
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  return memset_impl(p, value, bytes, stream, false);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  if (s == nullptr) return set_error(cudaErrorInvalidValue);
  Lock l;
  auto* n = new CUstream_st;
  n->blocking = (flags & cudaStreamNonBlocking) == 0;
  n->device = tl_device;
  st().streams.insert(n);
  st().context = true;
  *s = n;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Lock l;
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread || !st().streams.count(s))
    return set_error(cudaErrorInvalidResourceHandle);
  run_until_done(s, s->queued);  // its queued work still runs
  st().streams.erase(s);
  st().retired.emplace_back(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Lock l;
  ++st().counts.host_waits;
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  run_until_done(s, s->queued);
  return cudaSuccess;
}

// Queries make progress on every second call: the first says "not ready", so that callers' waiting paths
// run as well as their done paths.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Lock l;
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (!pending(s)) return cudaSuccess;
  if (!s->told_not_ready) {
    s->told_not_ready = true;
    return cudaErrorNotReady;
  }
  return run_until(s, s->queued) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned) {
  Lock l;
  if (stream_of(stream) == nullptr || e == nullptr || !st().events.count(e))
    return set_error(cudaErrorInvalidResourceHandle);
  if (!e->recorded) return cudaSuccess;  // an event never recorded is complete
  CUstream_st* w = e->stream;
  const uint64_t pos = e->position;
  return enqueue_waiting(stream, "cudaStreamWaitEvent", [w, pos] { return run_until(w, pos); }, kNoDevice);
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  Lock l;
  if (device == nullptr) return set_error(cudaErrorInvalidValue);
  CUstream_st* s = stream_of(stream);
  if (s == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  *device = s->device;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  if (e == nullptr) return set_error(cudaErrorInvalidValue);
  Lock l;
  auto* n = new CUevent_st;
  n->device = tl_device;
  n->timing = (flags & cudaEventDisableTiming) == 0;
  st().events.insert(n);
  st().context = true;
  *e = n;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  Lock l;
  if (e == nullptr || !st().events.erase(e)) return set_error(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  Lock l;
  CUstream_st* s = stream_of(stream);
  if (s == nullptr || e == nullptr || !st().events.count(e) || e->device != s->device)
    return set_error(cudaErrorInvalidResourceHandle);
  auto when = std::make_shared<std::chrono::steady_clock::time_point>();
  if (const cudaError_t r = enqueue(stream, "cudaEventRecord", [when] { *when = std::chrono::steady_clock::now(); }, kNoDevice);
      r != cudaSuccess)
    return r;
  e->stream = s;
  e->position = s->queued;
  e->recorded = true;
  e->told_not_ready = false;
  e->when = when;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  Lock l;
  if (e == nullptr || !st().events.count(e)) return set_error(cudaErrorInvalidResourceHandle);
  if (!e->recorded || e->stream->done >= e->position) return cudaSuccess;
  if (!e->told_not_ready) {
    e->told_not_ready = true;
    return cudaErrorNotReady;
  }
  return run_until(e->stream, e->position) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Lock l;
  ++st().counts.host_waits;
  if (e == nullptr || !st().events.count(e)) return set_error(cudaErrorInvalidResourceHandle);
  if (e->recorded) run_until_done(e->stream, e->position);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  Lock l;
  if (ms == nullptr) return set_error(cudaErrorInvalidValue);
  if (a == nullptr || b == nullptr || !st().events.count(a) || !st().events.count(b) || !a->timing || !b->timing)
    return set_error(cudaErrorInvalidResourceHandle);
  if (!a->recorded || !b->recorded) return set_error(cudaErrorInvalidResourceHandle);
  if (a->stream->done < a->position || b->stream->done < b->position) return set_error(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(*b->when - *a->when).count();
  return cudaSuccess;
}

cudaError_t zero8_cudasim_func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  Lock l;
  if (kernel == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      size_t(value) > kSmemOptin)
    return set_error(cudaErrorInvalidValue);
  st().max_dyn_smem[kernel] = value;
  return cudaSuccess;
}

cudaError_t zero8_cudasim_occupancy(int* blocks, const void* kernel, int block_size, size_t dyn_smem) {
  Lock l;
  if (blocks == nullptr || kernel == nullptr || block_size <= 0 || block_size > 1024)
    return set_error(cudaErrorInvalidValue);
  size_t limit = kSmemDefault;
  if (auto it = st().max_dyn_smem.find(kernel); it != st().max_dyn_smem.end()) limit = size_t(it->second);
  if (dyn_smem > limit) {
    *blocks = 0;
    return cudaSuccess;
  }
  const int warps = (block_size + 31) / 32;
  int n = std::min(32, 64 / warps);
  if (dyn_smem > 0) n = std::min<int>(n, int((228 * 1024) / (dyn_smem + 1024)));
  *blocks = n;
  return cudaSuccess;
}

zero8_cudasim_counts zero8_cudasim_get_counts() {
  Lock l;
  return st().counts;
}
