// Shared state of the multi-rank GoogleTest executables: the world communicator created once by
// dist_main.cpp (every rank runs every test; each test makes the same collective calls on all ranks),
// and deterministic per-rank test data every rank can regenerate for any other rank.
#pragma once

#include <cmath>
#include <cstdint>

#include "zero8/comm/communicator.h"
#include "zero8/kernels/hd.h"

namespace zero8::test {

comm::Communicator& world();

// A value of rank r's data at index i: mixed signs and magnitudes over ~6 decades, so float sums
// depend on their order (a wrong summation order shows up as a bit difference).
inline float dist_value(uint64_t salt, int r, int64_t i) {
  const float u = rng_uniform(salt * 1000003ull + uint64_t(r), uint64_t(i)) - 0.5f;
  const int e = int((uint64_t(i) * 7 + uint64_t(r) * 3 + salt) % 20) - 10;
  return std::ldexp(u, e);
}

}  // namespace zero8::test
