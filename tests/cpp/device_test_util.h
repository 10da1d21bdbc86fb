// What the C++ tests of device code share: a skip where no CUDA device can run them, a device copy of a
// host vector, and a bit-for-bit comparison. Device code: include only where ZERO8_WITH_CUDA.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "zero8/kernels/device.h"

#define SKIP_WITHOUT_CUDA()                                                                                \
  do {                                                                                                     \
    if (!::zero8::device::cuda_unavailable().empty()) GTEST_SKIP() << ::zero8::device::cuda_unavailable(); \
  } while (0)

namespace zero8::test {

// A device copy of a host vector; get() reads it back. Both wait for the legacy default stream, which
// waits for nothing a test leaves in flight on other streams: callers synchronize those first.
template <class T>
struct Dev {
  device::Buffer buf;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : buf(int64_t(h.size() * sizeof(T)) + 8, "test buffer"), n(h.size()) {
    device::copy(buf.data(), h.data(), int64_t(n * sizeof(T)), nullptr, "test upload");
    device::synchronize(nullptr, "test upload");
  }
  explicit Dev(size_t count) : Dev(std::vector<T>(count)) {}
  T* p() const { return buf.as<T>(); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    device::copy(h.data(), buf.data(), int64_t(n * sizeof(T)), nullptr, "test download");
    device::synchronize(nullptr, "test download");
    return h;
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace zero8::test
