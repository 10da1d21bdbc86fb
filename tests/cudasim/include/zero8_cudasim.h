// zero8's CUDA simulator for tests (ZERO8_CUDA=SIM): kernels/cuda/*.cu compiled as C++ and run on the CPU,
// each CUDA thread a fiber, so the kernels' indexing, barriers, warp shuffles and launch limits, and the host
// code's streams, events, copies and pointer kinds run in CI, which has no GPU. This header is what device
// code sees (threadIdx, __syncthreads, __shfl_xor_sync, ...) and the launch that replaces <<<...>>>
// (tests/cudasim/rewrite_cu.py). What it cannot show: nvcc's code generation, timing, and races between
// threads that the GPU runs at once (a block's threads run one at a time between synchronization points).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "zero8_cudasim_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace zero8_cudasim {

// The running CUDA thread's indices (valid inside a kernel only).
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_smem();
// The running block's storage of the __shared__ variable `key` (rewrite_cu.py names each declaration):
// made at its first use in the block, filled with NaN bytes.
void* shared_storage(const char* key, size_t bytes);
template <class T>
T& shared_var(const char* key) {
  static_assert(alignof(T) <= 128, "shared variables are aligned to 128 bytes");
  return *static_cast<T*>(shared_storage(key, sizeof(T)));
}

// Barriers. Each returns the block's (warp's) combination of the threads' values.
int sync_block(int value, int op);  // op: 0 none, 1 and, 2 or, 3 count
uint64_t sync_warp_exchange(unsigned mask, uint64_t value, unsigned* gen_out);
uint64_t warp_slot(unsigned gen, int lane);
int lane_id();

// Launch: queues `body` (one CUDA thread) on `stream` for grid x block threads; an invalid configuration
// sets the runtime's last error, as the CUDA runtime does.
void launch_kernel(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   std::function<void()> body);

template <class... P>
struct Launcher {
  void (*kernel)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <class... A>
  void operator()(A&&... a) const {
    // Arguments are copied at the launch (kernel parameters are passed by value), converted as the call would.
    auto args = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(a)...);
    auto k = kernel;
    launch_kernel(reinterpret_cast<const void*>(kernel), name, grid, block, smem, stream,
                  [k, args] { std::apply(k, *args); });
  }
};

template <class... P>
Launcher<P...> launch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t smem = 0,
                      cudaStream_t stream = nullptr) {
  return Launcher<P...>{kernel, name, grid, block, smem, stream};
}

template <class T>
uint64_t to_slot(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp shuffles move values of 8 bytes at most");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T from_slot(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// The value of lane src in the exchange this lane took part in; a lane outside the mask is the error
// CUDA leaves undefined, reported by the simulator.
uint64_t shfl_value(unsigned mask, unsigned gen, int src);

}  // namespace zero8_cudasim

#define threadIdx (::zero8_cudasim::thread_idx())
#define blockIdx (::zero8_cudasim::block_idx())
#define blockDim (::zero8_cudasim::block_dim())
#define gridDim (::zero8_cudasim::grid_dim())
static constexpr int warpSize = 32;

inline void __syncthreads() { (void)::zero8_cudasim::sync_block(0, 0); }
inline int __syncthreads_and(int p) { return ::zero8_cudasim::sync_block(p, 1); }
inline int __syncthreads_or(int p) { return ::zero8_cudasim::sync_block(p, 2); }
inline int __syncthreads_count(int p) { return ::zero8_cudasim::sync_block(p, 3); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  unsigned gen = 0;
  (void)::zero8_cudasim::sync_warp_exchange(mask, 0, &gen);
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  unsigned gen = 0;
  ::zero8_cudasim::sync_warp_exchange(mask, ::zero8_cudasim::to_slot(v), &gen);
  const int lane = ::zero8_cudasim::lane_id();
  const int s = (lane & ~(width - 1)) + (src & (width - 1));
  return ::zero8_cudasim::from_slot<T>(::zero8_cudasim::shfl_value(mask, gen, s));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  unsigned gen = 0;
  ::zero8_cudasim::sync_warp_exchange(mask, ::zero8_cudasim::to_slot(v), &gen);
  const int lane = ::zero8_cudasim::lane_id();
  int s = lane ^ lane_mask;
  if (s >= ((lane & ~(width - 1)) + width)) s = lane;  // beyond the segment: the lane's own value
  return ::zero8_cudasim::from_slot<T>(::zero8_cudasim::shfl_value(mask, gen, s));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  unsigned gen = 0;
  ::zero8_cudasim::sync_warp_exchange(mask, ::zero8_cudasim::to_slot(v), &gen);
  const int lane = ::zero8_cudasim::lane_id();
  const int s = (lane & (width - 1)) + int(delta) < width ? lane + int(delta) : lane;
  return ::zero8_cudasim::from_slot<T>(::zero8_cudasim::shfl_value(mask, gen, s));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  unsigned gen = 0;
  ::zero8_cudasim::sync_warp_exchange(mask, ::zero8_cudasim::to_slot(v), &gen);
  const int lane = ::zero8_cudasim::lane_id();
  const int s = (lane & (width - 1)) >= int(delta) ? lane - int(delta) : lane;
  return ::zero8_cudasim::from_slot<T>(::zero8_cudasim::shfl_value(mask, gen, s));
}
unsigned __ballot_sync(unsigned mask, int p);
inline int __all_sync(unsigned mask, int p) { return __ballot_sync(mask, p) == mask; }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }

// Atomics: a block's threads never run at once and blocks run one at a time, so plain read-modify-writes.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  const T old = *p;
  if (old < v) *p = v;
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  const T old = *p;
  if (v < old) *p = v;
  return old;
}

inline float __uint_as_float(unsigned u) { return ::zero8_cudasim::from_slot<float>(u); }
inline unsigned __float_as_uint(float x) { return unsigned(::zero8_cudasim::to_slot(x)); }
inline float __int_as_float(int i) { return ::zero8_cudasim::from_slot<float>(uint32_t(i)); }
inline int __float_as_int(float x) { return int(uint32_t(::zero8_cudasim::to_slot(x))); }
template <class T>
T __ldg(const T* p) {
  return *p;
}

// CUDA's device min/max overloads, for the kernels' unqualified calls.
inline int min(int a, int b) { return b < a ? b : a; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return b < a ? b : a; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return b < a ? b : a; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline long min(long a, long b) { return b < a ? b : a; }
inline long max(long a, long b) { return a < b ? b : a; }
inline unsigned long min(unsigned long a, unsigned long b) { return b < a ? b : a; }
inline unsigned long max(unsigned long a, unsigned long b) { return a < b ? b : a; }
