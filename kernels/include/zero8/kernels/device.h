// CUDA runtime plumbing shared by comm/ and zero8/ without CUDA headers: whether CUDA can run here,
// what kind of memory a pointer is, owning device / pinned buffers, streams, events and copies. In a
// build without CUDA every call that would need the runtime throws Error(unsupported) naming the caller.
#pragma once

#include <cstdint>
#include <string>

namespace zero8 {

// Where a buffer lives: host memory, or the memory of the current CUDA device.
enum class MemSpace : uint8_t { host = 0, device = 1 };
const char* mem_space_name(MemSpace m);  // "host", "device"

namespace device {

// "" when CUDA work can run in this process, else why not: "zero8 was not built with CUDA" or "no usable
// CUDA device (<the runtime's words>)". Probed once; cheap afterwards.
const std::string& cuda_unavailable();
// Throws Error(unsupported) "<where>: <cuda_unavailable()>" unless CUDA work can run.
void require_cuda(const std::string& where);

// What a pointer points at, per cudaPointerGetAttributes. Null, and every pointer when CUDA cannot run
// here or the process has no CUDA context yet, is host (pageable) memory: such a process holds no device
// memory, and asking would make a context (device memory of its own) in CPU-only processes.
enum class MemoryKind : uint8_t { host = 0, pinned = 1, device = 2, managed = 3 };
const char* memory_kind_name(MemoryKind k);  // "pageable host memory", "page-locked host memory", ...
MemoryKind memory_kind(const void* p);
// Device or managed memory: what a kernel may touch and what a host-memory transport must stage.
inline bool device_accessible(MemoryKind k) { return k == MemoryKind::device || k == MemoryKind::managed; }
inline bool on_device(const void* p) { return device_accessible(memory_kind(p)); }

// p (argument `arg` of `where`) must be device or managed memory; null passes (the caller decides whether
// null is allowed). Error(invalid_argument) naming the argument and the memory it got, or Error(unsupported)
// when CUDA cannot run. Inside a VouchedPointers scope of this thread it asks nothing.
void check_device_ptr(const void* p, const char* arg, const std::string& where);

// While one is alive on this thread (and made with true), check_device_ptr takes every pointer on trust: the
// caller vouches that each pointer it hands the kernels is device memory of the current device, as zero8's
// Python side does for the data of CUDA tensors it has checked (and zero8.optim for a planned step's). The
// query it skips (cudaPointerGetAttributes) costs about a microsecond, and a kernel call checks three to
// eight pointers. Scopes nest.
class VouchedPointers {
 public:
  explicit VouchedPointers(bool on);
  ~VouchedPointers();
  VouchedPointers(const VouchedPointers&) = delete;
  VouchedPointers& operator=(const VouchedPointers&) = delete;
  static bool active();

 private:
  bool on_;
};

// A stream handle (cudaStream_t as void*; null is the legacy default stream) must be valid on the
// current device: Error(invalid_argument) naming `arg`, or Error(unsupported) when CUDA cannot run.
void check_stream(void* stream, const char* arg, const std::string& where);

int current_device(const std::string& where);

// Makes `device` current for its lifetime and restores the previous one (-1: leaves it as it is).
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& where);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// `bytes` of memory on the current device (cudaMalloc, never managed), freed by the destructor; empty
// for 0 bytes. Contents are undefined until written.
class Buffer {
 public:
  Buffer() = default;
  Buffer(int64_t bytes, const std::string& what);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  // At least `bytes`. Growing drops the contents, and first waits for the whole device (work queued
  // on any stream may still use the old memory); scratch buffers grow rarely, to their largest use.
  void reserve(int64_t bytes, const std::string& what);

 private:
  void* p_ = nullptr;
  int64_t bytes_ = 0;
};

// Page-locked host memory (cudaMallocHost) that grows on demand and is reused: the staging area of
// host transports for device buffers. Contents are not kept when it grows.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* reserve(int64_t bytes, const std::string& what);
  void* data() const { return p_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  int64_t bytes_ = 0;
};

// A stream of the current device that does not synchronize with the legacy default stream.
class Stream {
 public:
  explicit Stream(const std::string& what);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const { return s_; }

 private:
  void* s_ = nullptr;
};

// A timing-free event: record() on one stream, then make another stream (or the host) wait for it.
class Event {
 public:
  explicit Event(const std::string& what);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(void* stream);
  void wait_on(void* stream);  // work enqueued on `stream` from now on waits for the recorded work
  bool done();                 // the recorded work completed (cudaEventQuery); throws on a CUDA error
  void synchronize();

 private:
  void* e_ = nullptr;
  std::string what_;
};

// Asynchronous on `stream` (null: the legacy default stream); src and dst may be any memory
// (cudaMemcpyDefault). Pageable host memory makes the copy synchronous with respect to the host.
void copy(void* dst, const void* src, int64_t bytes, void* stream, const std::string& where);
void zero(void* dst, int64_t bytes, void* stream, const std::string& where);
void synchronize(void* stream, const std::string& where);

}  // namespace device
}  // namespace zero8
