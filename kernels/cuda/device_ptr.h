// Pointer checks for the CUDA launchers (kernels/cuda/*.cu): the validated APIs check null and
// alignment (zero8/src/arg_checks.h); here cudaPointerGetAttributes says whether a pointer is device
// or managed memory, so a host pointer is an Error naming the argument instead of a fault in a kernel.
// The check itself is device::check_device_ptr (zero8/kernels/device.h), shared with comm/ and zero8/.
#pragma once

#include <initializer_list>
#include <utility>

#include "zero8/kernels/device.h"

namespace zero8::cuda_detail {

// p (argument `arg` of `where`) must be device or managed memory; null passes (the callers' own
// checks decide whether null is allowed, e.g. for an empty range or an optional bias).
inline void check_device_ptr(const void* p, const char* arg, const char* where) {
  device::check_device_ptr(p, arg, where);
}

// check_device_ptr for each (pointer, argument name) of `where`, in order.
inline void check_device_ptrs(const char* where, std::initializer_list<std::pair<const void*, const char*>> ptrs) {
  if (device::VouchedPointers::active()) return;  // the caller vouches for them (device.h)
  for (const auto& [p, arg] : ptrs) check_device_ptr(p, arg, where);
}

}  // namespace zero8::cuda_detail
