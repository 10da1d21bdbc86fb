// The CUDA runtime behind zero8/kernels/device.h. Without CUDA every entry that needs the runtime says
// "zero8 was not built with CUDA", naming its caller, and pointers are host memory.
#include "zero8/kernels/device.h"

#include <map>
#include <mutex>
#include <utility>

#include "zero8/error.h"
#include "zero8/kernels/quant_map.h"

#if ZERO8_WITH_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#endif

namespace zero8 {

const char* mem_space_name(MemSpace m) { return m == MemSpace::device ? "device" : "host"; }

namespace device {

namespace {
thread_local int vouched_depth = 0;  // VouchedPointers scopes alive on this thread
}  // namespace

VouchedPointers::VouchedPointers(bool on) : on_(on) {
  if (on_) ++vouched_depth;
}
VouchedPointers::~VouchedPointers() {
  if (on_) --vouched_depth;
}
bool VouchedPointers::active() { return vouched_depth > 0; }

const char* memory_kind_name(MemoryKind k) {
  switch (k) {
    case MemoryKind::host: return "pageable host memory";
    case MemoryKind::pinned: return "page-locked host memory";
    case MemoryKind::device: return "device memory";
    case MemoryKind::managed: return "managed memory";
  }
  return "memory of an unknown kind";
}

void require_cuda(const std::string& where) {
  const std::string& why = cuda_unavailable();
  if (!why.empty()) ZERO8_THROW(unsupported, where << ": " << why);
}

#if ZERO8_WITH_CUDA

namespace {

[[noreturn]] void fail(cudaError_t e, const std::string& where, const char* call) {
  (void)cudaGetLastError();  // clear a sticky launch error so the next check does not report it again
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
    ZERO8_THROW(unsupported, where << ": no usable CUDA device (" << cudaGetErrorString(e) << ")");
  if (e == cudaErrorMemoryAllocation)
    ZERO8_THROW(unsupported, where << ": " << call << " is out of memory (" << cudaGetErrorString(e) << ")");
  ZERO8_THROW(internal, where << ": " << call << " failed: " << cudaGetErrorString(e));
}

void check(cudaError_t e, const std::string& where, const char* call) {
  if (e != cudaSuccess) fail(e, where, call);
}

cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

const std::string& cuda_unavailable() {
  static const std::string why = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")";
    }
    return count == 0 ? std::string("no usable CUDA device (0 devices)") : std::string();
  }();
  return why;
}

namespace {

// Whether this process has a CUDA context (torch's, zero8's own, any library's): only then can it hold
// device memory. Asking the runtime about a pointer before that would make one, which costs hundreds of
// MB of device memory per process (a CPU job's every MPI rank on a GPU machine) and leaves CUDA state a
// fork()ed child cannot use; the driver's primary-context state and current context say it without.
bool context_exists() {
  static std::atomic<bool> seen{false};
  if (seen.load(std::memory_order_relaxed)) return true;
  struct Driver {
    PFN_cuDevicePrimaryCtxGetState_v7000 primary_state = nullptr;
    PFN_cuDeviceGet_v2000 device_get = nullptr;
    PFN_cuCtxGetCurrent_v4000 current = nullptr;
  };
  static const Driver d = [] {
    Driver r;
    auto get = [](const char* name, void** fn, unsigned version) {
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, fn, version, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        *fn = nullptr;
      }
    };
    get("cuDevicePrimaryCtxGetState", reinterpret_cast<void**>(&r.primary_state), 7000);
    get("cuDeviceGet", reinterpret_cast<void**>(&r.device_get), 2000);
    get("cuCtxGetCurrent", reinterpret_cast<void**>(&r.current), 4000);
    return r;
  }();
  // Without the driver's answers, ask about the pointer (which may make a context).
  if (d.primary_state == nullptr || d.device_get == nullptr || d.current == nullptr) return true;
  CUcontext cur = nullptr;
  bool found = d.current(&cur) == CUDA_SUCCESS && cur != nullptr;
  int count = 0;
  if (!found && cudaGetDeviceCount(&count) != cudaSuccess) (void)cudaGetLastError();
  for (int i = 0; i < count && !found; ++i) {
    CUdevice dev = 0;
    unsigned flags = 0;
    int active = 0;
    found = d.device_get(&dev, i) == CUDA_SUCCESS && d.primary_state(dev, &flags, &active) == CUDA_SUCCESS && active;
  }
  if (found) seen.store(true, std::memory_order_relaxed);
  return found;
}

}  // namespace

MemoryKind memory_kind(const void* p) {
  if (p == nullptr || !cuda_unavailable().empty() || !context_exists()) return MemoryKind::host;
  cudaPointerAttributes at{};
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return MemoryKind::host;
  }
  switch (at.type) {
    case cudaMemoryTypeDevice: return MemoryKind::device;
    case cudaMemoryTypeManaged: return MemoryKind::managed;
    case cudaMemoryTypeHost: return MemoryKind::pinned;
    default: return MemoryKind::host;
  }
}

void check_device_ptr(const void* p, const char* arg, const std::string& where) {
  if (p == nullptr || VouchedPointers::active()) return;
  require_cuda(where);
  cudaPointerAttributes at{};
  const cudaError_t e = cudaPointerGetAttributes(&at, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << " cannot query pointer " << p
                                                        << " (cudaPointerGetAttributes: " << cudaGetErrorString(e)
                                                        << ")");
  }
  if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) {
    const MemoryKind k = at.type == cudaMemoryTypeHost ? MemoryKind::pinned : MemoryKind::host;
    ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << " needs device or managed memory, got "
                                                        << memory_kind_name(k) << " at " << p);
  }
}

void check_stream(void* stream, const char* arg, const std::string& where) {
  if (stream == nullptr) return;
  require_cuda(where);
  const cudaError_t q = cudaStreamQuery(stream_of(stream));
  if (q != cudaSuccess && q != cudaErrorNotReady) {
    (void)cudaGetLastError();
    ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << ": " << stream
                                                        << " is not a usable CUDA stream (" << cudaGetErrorString(q)
                                                        << ")");
  }
#if CUDART_VERSION >= 12080
  // The legacy and per-thread default handles belong to whichever device is current.
  if (stream_of(stream) != cudaStreamLegacy && stream_of(stream) != cudaStreamPerThread) {
    int dev = -1, cur = -1;
    if (cudaStreamGetDevice(stream_of(stream), &dev) == cudaSuccess && cudaGetDevice(&cur) == cudaSuccess &&
        dev != cur)
      ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << ": stream " << stream
                                                          << " belongs to CUDA device " << dev << ", but device " << cur
                                                          << " is current");
    (void)cudaGetLastError();
  }
#endif
}

int current_device(const std::string& where) {
  require_cuda(where);
  int d = 0;
  check(cudaGetDevice(&d), where, "cudaGetDevice");
  return d;
}

DeviceGuard::DeviceGuard(int device, const std::string& where) {
  if (device < 0) return;
  int cur = 0;
  check(cudaGetDevice(&cur), where, "cudaGetDevice");
  if (cur == device) return;
  check(cudaSetDevice(device), where, "cudaSetDevice");
  previous_ = cur;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

Buffer::Buffer(int64_t bytes, const std::string& what) { reserve(bytes, what); }

Buffer::~Buffer() {
  if (p_ != nullptr) (void)cudaFree(p_);
}

Buffer::Buffer(Buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void Buffer::reserve(int64_t bytes, const std::string& what) {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", what << ": negative size " << bytes);
  if (bytes <= bytes_) return;
  require_cuda(what);
  if (p_ != nullptr) {
    // Kernels queued on any stream may still use the old memory: wait for them before it goes.
    check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
    check(cudaFree(p_), what, "cudaFree");
    p_ = nullptr;
    bytes_ = 0;
  }
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, size_t(bytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (e == cudaErrorMemoryAllocation)
      ZERO8_THROW(unsupported, what << ": cannot allocate " << bytes << " bytes of device memory ("
                                    << cudaGetErrorString(e) << ")");
    fail(e, what, "cudaMalloc");
  }
  p_ = p;
  bytes_ = bytes;
}

PinnedBuffer::~PinnedBuffer() {
  if (p_ != nullptr) (void)cudaFreeHost(p_);
}

void* PinnedBuffer::reserve(int64_t bytes, const std::string& what) {
  if (bytes <= bytes_) return p_;
  require_cuda(what);
  if (p_ != nullptr) {
    check(cudaFreeHost(p_), what, "cudaFreeHost");
    p_ = nullptr;
    bytes_ = 0;
  }
  // Grow by half again, so a series of slowly growing calls does not reallocate every time.
  const int64_t want = bytes + bytes / 2;
  check(cudaMallocHost(&p_, size_t(want)), what, "cudaMallocHost");
  bytes_ = want;
  return p_;
}

Stream::Stream(const std::string& what) {
  require_cuda(what);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what, "cudaStreamCreateWithFlags");
  s_ = s;
}

Stream::~Stream() {
  if (s_ != nullptr) (void)cudaStreamDestroy(stream_of(s_));
}

Event::Event(const std::string& what) : what_(what) {
  require_cuda(what);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what, "cudaEventCreateWithFlags");
  e_ = e;
}

Event::~Event() {
  if (e_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e_));
}

void Event::record(void* stream) { check(cudaEventRecord(static_cast<cudaEvent_t>(e_), stream_of(stream)), what_, "cudaEventRecord"); }

void Event::wait_on(void* stream) {
  check(cudaStreamWaitEvent(stream_of(stream), static_cast<cudaEvent_t>(e_), 0), what_, "cudaStreamWaitEvent");
}

bool Event::done() {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(e_));
  if (e == cudaErrorNotReady) return false;
  check(e, what_, "cudaEventQuery");
  return true;
}

void Event::synchronize() { check(cudaEventSynchronize(static_cast<cudaEvent_t>(e_)), what_, "cudaEventSynchronize"); }

void copy(void* dst, const void* src, int64_t bytes, void* stream, const std::string& where) {
  if (bytes <= 0) return;
  require_cuda(where);
  check(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, stream_of(stream)), where, "cudaMemcpyAsync");
}

void zero(void* dst, int64_t bytes, void* stream, const std::string& where) {
  if (bytes <= 0) return;
  require_cuda(where);
  check(cudaMemsetAsync(dst, 0, size_t(bytes), stream_of(stream)), where, "cudaMemsetAsync");
}

void synchronize(void* stream, const std::string& where) {
  require_cuda(where);
  check(cudaStreamSynchronize(stream_of(stream)), where, "cudaStreamSynchronize");
}

#else  // !ZERO8_WITH_CUDA

const std::string& cuda_unavailable() {
  static const std::string why = "zero8 was not built with CUDA";
  return why;
}

MemoryKind memory_kind(const void*) { return MemoryKind::host; }

void check_device_ptr(const void* p, const char*, const std::string& where) {
  if (p != nullptr) require_cuda(where);
}

void check_stream(void* stream, const char*, const std::string& where) {
  if (stream != nullptr) require_cuda(where);
}

int current_device(const std::string& where) {
  require_cuda(where);
  return -1;
}

DeviceGuard::DeviceGuard(int device, const std::string& where) {
  if (device >= 0) require_cuda(where);
}
DeviceGuard::~DeviceGuard() = default;

Buffer::Buffer(int64_t bytes, const std::string& what) { reserve(bytes, what); }
Buffer::~Buffer() = default;
Buffer::Buffer(Buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  p_ = std::exchange(o.p_, nullptr);
  bytes_ = std::exchange(o.bytes_, 0);
  return *this;
}
void Buffer::reserve(int64_t bytes, const std::string& what) {
  ZERO8_CHECK_ARG(bytes >= 0, "bytes", what << ": negative size " << bytes);
  if (bytes > bytes_) require_cuda(what);
}

PinnedBuffer::~PinnedBuffer() = default;
void* PinnedBuffer::reserve(int64_t bytes, const std::string& what) {
  if (bytes > bytes_) require_cuda(what);
  return p_;
}

Stream::Stream(const std::string& what) { require_cuda(what); }
Stream::~Stream() = default;

Event::Event(const std::string& what) : what_(what) { require_cuda(what); }
Event::~Event() = default;
void Event::record(void*) { require_cuda(what_); }
void Event::wait_on(void*) { require_cuda(what_); }
bool Event::done() {
  require_cuda(what_);
  return true;
}
void Event::synchronize() { require_cuda(what_); }

void copy(void*, const void*, int64_t bytes, void*, const std::string& where) {
  if (bytes > 0) require_cuda(where);
}
void zero(void*, int64_t bytes, void*, const std::string& where) {
  if (bytes > 0) require_cuda(where);
}
void synchronize(void*, const std::string& where) { require_cuda(where); }

#endif

}  // namespace device

namespace quant {

const QuantTable* table_get_device(MapKind kind) {
#if ZERO8_WITH_CUDA
  const QuantTable& host = table_get(kind);
  const char* where = "table_get_device";
  const int dev = device::current_device(where);
  static std::mutex mu;
  static std::map<std::pair<int, int>, QuantTable*> tables;  // (device, map) -> device copy, never freed
  std::lock_guard<std::mutex> lock(mu);
  QuantTable*& t = tables[{dev, int(kind)}];
  if (t == nullptr) {
    QuantTable* p = nullptr;
    device::check(cudaMalloc(&p, sizeof(QuantTable)), where, "cudaMalloc");
    // A copy from pageable memory may return before its DMA lands, and the kernels that read the table run
    // on the callers' streams, which need not be ordered with the legacy stream: wait for the copy.
    cudaError_t e = cudaMemcpy(p, &host, sizeof(QuantTable), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
    if (e != cudaSuccess) cudaFree(p);
    device::check(e, where, "cudaMemcpy");
    t = p;
  }
  return t;
#else
  (void)kind;
  device::require_cuda("table_get_device");
  return nullptr;
#endif
}

}  // namespace quant
}  // namespace zero8
