// The fp32 gradient input of a sharded group: anonymous memory whose pages go back to the operating
// system once their gradients are reduced, so that a rank does not hold every gradient of the model
// between reductions (ZeRO stage 2 keeps only its partition; see docs/ENGINE.md, "Memory per rank").
#pragma once

#include <cstdint>

namespace zero8::shard {

class GradBuffer {
 public:
  // Huge-page size: the unit in which release() hands pages back.
  static constexpr int64_t kPageBytes = int64_t(2) << 20;

  GradBuffer() = default;
  // n zero floats. `release`: whether zero() and release() hand pages back (ShardConfig::release_grads:
  // memory for time, as every step then maps its pages again; far more time where the kernel cannot
  // give 2 MiB pages, since refaulting 4 KiB pages costs about 20x the writes). Throws zero8::Error when
  // the memory cannot be mapped.
  GradBuffer(int64_t n, bool release);
  ~GradBuffer();
  GradBuffer(GradBuffer&& o) noexcept;
  GradBuffer& operator=(GradBuffer&& o) noexcept;
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  int64_t size() const { return n_; }
  bool releases() const { return release_; }

  // Every element becomes 0: the pages are handed back (they read as zeros and take memory again when
  // written), or, when !releases(), written with zeros.
  void zero();
  // Elements [begin, end) are no longer needed until the next zero(): when releases(), the whole huge
  // pages inside the range are handed back (they read as zeros); the rest keeps its values.
  void release(int64_t begin, int64_t end);
  // Bytes of the buffer backed by memory now (mincore), at most the mapped size.
  int64_t resident_bytes() const;

 private:
  void unmap();
  float* data_ = nullptr;
  int64_t n_ = 0;
  int64_t mapped_ = 0;  // bytes mapped at data_ (a multiple of kPageBytes)
  bool release_ = false;
};

}  // namespace zero8::shard
