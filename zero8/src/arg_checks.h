// Argument checks shared by the validated APIs of zero8/src (quant.cpp, int8.cpp, optim.cpp): each throws
// zero8::Error (invalid_argument) naming the argument, through ZERO8_CHECK_ARG.
#pragma once

#include <cstdint>

#include "zero8/error.h"
#include "zero8/kernels/hd.h"

namespace zero8 {
namespace {

// A pointer to `count` elements of `elem` bytes: non-null unless empty, aligned to its element size.
inline void check_ptr(const void* p, const char* name, int64_t count, int elem) {
  ZERO8_CHECK_ARG(p != nullptr || count == 0, name, "null pointer for " << count << " elements");
  ZERO8_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % uintptr_t(elem) == 0, name,
                  "pointer " << p << " is not aligned to its " << elem << "-byte elements");
}

inline void check_dtype(DType t, const char* name) {
  ZERO8_CHECK_ARG(t == DType::f32 || t == DType::bf16 || t == DType::f16, name, "unknown dtype " << int(t));
}

inline void check_threads(int threads) {
  ZERO8_CHECK_ARG(threads >= 0, "threads", "must be >= 0 (0: OpenMP default), got " << threads);
}

}  // namespace
}  // namespace zero8
