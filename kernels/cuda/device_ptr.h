// Pointer checks for the CUDA launchers (kernels/cuda/*.cu): the validated APIs check null and
// alignment (zero8/src/arg_checks.h); here cudaPointerGetAttributes says whether a pointer is device
// or managed memory, so a host pointer is an Error naming the argument instead of a fault in a kernel.
// Not run yet: there is no GPU on the machines zero8 is built on (README.md, "GPUs").
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>
#include <utility>

#include "zero8/error.h"

namespace zero8::cuda_detail {

inline const char* memory_type_name(cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeUnregistered: return "pageable host memory (not registered with CUDA)";
    case cudaMemoryTypeHost: return "page-locked host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
  }
  return "memory of an unknown type";
}

// p (argument `arg` of `where`) must be device or managed memory; null passes (the callers' own
// checks decide whether null is allowed, e.g. for an empty range or an optional bias).
inline void check_device_ptr(const void* p, const char* arg, const char* where) {
  if (p == nullptr) return;
  cudaPointerAttributes at{};
  const cudaError_t e = cudaPointerGetAttributes(&at, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so the next launch check does not report it again
    // No GPU or driver: the same code and words as the other CUDA entry points (quant.cpp's cuda_check).
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
      ZERO8_THROW(unsupported, where << ": no usable CUDA device (" << cudaGetErrorString(e) << ")");
    ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << " cannot query pointer " << p
                                                        << " (cudaPointerGetAttributes: " << cudaGetErrorString(e)
                                                        << ")");
  }
  if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged)
    ZERO8_THROW(invalid_argument, "invalid argument '" << arg << "': " << where << " needs device or managed memory, got "
                                                        << memory_type_name(at.type) << " at " << p);
}

// check_device_ptr for each (pointer, argument name) of `where`, in order.
inline void check_device_ptrs(const char* where, std::initializer_list<std::pair<const void*, const char*>> ptrs) {
  for (const auto& [p, arg] : ptrs) check_device_ptr(p, arg, where);
}

}  // namespace zero8::cuda_detail
