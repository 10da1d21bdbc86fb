// Inside zero8's CUDA simulator: the pieces runtime.cpp, threads.cpp and cublaslt.cpp share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "cuda_runtime.h"

namespace zero8_cudasim {

// The machine's device (0 .. ZERO8_CUDASIM_DEVICES - 1) that this process's `device` is (CUDA_VISIBLE_DEVICES).
int machine_device(int device);

// Every runtime entry holds this lock: streams run their work on whichever host thread waits for it.
std::recursive_mutex& runtime_mutex();

// Reports a CUDA program error that a GPU would leave undefined (a deadlocked barrier, a shuffle with a
// lane that is not there, a fault) with the kernel, block and thread it happened in, and aborts.
[[noreturn]] void fatal(const std::string& what);

// Whose device memory an operation may touch while it runs (enqueue's `memory`): its stream's device's
// (kernels, NCCL, cuBLASLt: a GPU faults on another device's memory without peer access), every device's
// (copies), none (waits, event records), or one device's.
constexpr int kAllDevices = -1, kNoDevice = -2, kStreamsDevice = -3;

// Queues `op` on the stream; `what` names it in reports.
cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<void()> op, int memory = kStreamsDevice);
// The same for an operation that may have to wait for another process (a peer's NCCL part): it returns
// false while it does, and runs again at the stream's next query or wait (never at once in a loop: the
// host that blocks sleeps between tries), until it returns true.
cudaError_t enqueue_waiting(cudaStream_t stream, const char* what, std::function<bool()> op,
                            int memory = kStreamsDevice);

// Runs one kernel's grid now (called from a stream's queue, with device memory accessible).
void run_grid(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);

// Where the host thread is inside a kernel, for reports: "kernel K, block (x,y,z), thread (x,y,z)" or "".
std::string where_in_kernel();

// The element range [p, p + bytes) lies in one device (or managed) allocation.
bool device_range(const void* p, size_t bytes);

// The number in environment variable `name`, or `fallback` when it is unset, not a number or outside [lo, hi].
double env_number(const char* name, double fallback, double lo, double hi);

// Sets the calling thread's last error (cudaGetLastError) and returns e.
cudaError_t set_error(cudaError_t e);

}  // namespace zero8_cudasim
