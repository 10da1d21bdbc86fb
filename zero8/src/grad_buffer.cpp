// GradBuffer (see grad_buffer.h): anonymous mappings aligned to huge pages, madvise(MADV_DONTNEED) to
// hand pages back (private anonymous pages read as zeros afterwards), mincore to count what is resident.
#include "zero8/grad_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "zero8/error.h"

namespace zero8::shard {

GradBuffer::GradBuffer(int64_t n, bool release) : n_(n), release_(release) {
  ZERO8_CHECK_ARG(n >= 0, "n", "gradient buffer length must be >= 0, got " << n);
  if (n == 0) return;
  mapped_ = (n * int64_t(sizeof(float)) + kPageBytes - 1) / kPageBytes * kPageBytes;
  // Map one huge page more and trim, so that data_ starts on a huge-page boundary.
  const size_t span = size_t(mapped_ + kPageBytes);
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    ZERO8_THROW(invalid_argument, "gradient buffer of " << n << " floats (" << span << " bytes): mmap failed: "
                                                        << std::strerror(errno));
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (base + uintptr_t(kPageBytes) - 1) & ~uintptr_t(kPageBytes - 1);
  if (aligned > base) munmap(p, aligned - base);
  const uintptr_t end = aligned + uintptr_t(mapped_);
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  data_ = reinterpret_cast<float*>(aligned);
  // Advice only: without transparent huge pages the mapping still works, with 4 KiB pages.
  if (release_) madvise(data_, size_t(mapped_), MADV_HUGEPAGE);
}

GradBuffer::~GradBuffer() { unmap(); }

void GradBuffer::unmap() {
  if (data_) munmap(data_, size_t(mapped_));
  data_ = nullptr;
  n_ = mapped_ = 0;
}

GradBuffer::GradBuffer(GradBuffer&& o) noexcept
    : data_(o.data_), n_(o.n_), mapped_(o.mapped_), release_(o.release_) {
  o.data_ = nullptr;
  o.n_ = o.mapped_ = 0;
}

GradBuffer& GradBuffer::operator=(GradBuffer&& o) noexcept {
  if (this != &o) {
    unmap();
    data_ = o.data_;
    n_ = o.n_;
    mapped_ = o.mapped_;
    release_ = o.release_;
    o.data_ = nullptr;
    o.n_ = o.mapped_ = 0;
  }
  return *this;
}

void GradBuffer::zero() {
  if (!data_) return;
  if (release_ && madvise(data_, size_t(mapped_), MADV_DONTNEED) == 0) return;
  std::memset(data_, 0, size_t(n_) * sizeof(float));
}

void GradBuffer::release(int64_t begin, int64_t end) {
  if (!release_ || !data_) return;
  ZERO8_CHECK_ARG(0 <= begin && begin <= end && end <= n_, "range",
                  "[" << begin << ", " << end << ") is outside the gradient buffer of " << n_ << " floats");
  const int64_t lo = (begin * int64_t(sizeof(float)) + kPageBytes - 1) / kPageBytes * kPageBytes;
  // The buffer's last page may be released whole when the range reaches its end (the rest of that page
  // is padding past n_).
  const int64_t hi_bytes = end == n_ ? mapped_ : end * int64_t(sizeof(float));
  const int64_t hi = hi_bytes / kPageBytes * kPageBytes;
  if (hi > lo) madvise(reinterpret_cast<char*>(data_) + lo, size_t(hi - lo), MADV_DONTNEED);
}

int64_t GradBuffer::resident_bytes() const {
  if (!data_) return 0;
  const int64_t page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> vec(size_t((mapped_ + page - 1) / page));
  if (mincore(data_, size_t(mapped_), vec.data()) != 0)
    ZERO8_THROW(internal, "mincore on the gradient buffer failed: " << std::strerror(errno));
  int64_t pages = 0;
  for (unsigned char v : vec) pages += v & 1;
  return std::min(pages * page, mapped_);
}

}  // namespace zero8::shard
