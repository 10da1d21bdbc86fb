// Host side of zero8/kernels/vec.h, and the dispatch to the CUDA side (kernels/cuda/vec_kernel.cu) for
// device memory. The element expressions here and there are the same, written once per operation.
#include "zero8/kernels/vec.h"

#include <cstring>

#include "zero8/error.h"

namespace zero8::vec {
namespace {

// Element-wise loops run on OpenMP threads only when the work pays for starting them.
constexpr int64_t kParallelMin = 65536;

// One block of the fixed-order sum (see sum_squares in vec.h): x[0, len) with len <= kSumBlock.
template <bool Square, class T>
double sum_block(const T* x, int64_t len) {
  double lane[kSumLanes];
  for (int t = 0; t < kSumLanes; ++t) {
    double acc = 0.0;
    for (int k = 0; k < kSumBlock / kSumLanes; ++k) {
      const int64_t i = t + int64_t(k) * kSumLanes;
      if (i >= len) break;
      const double v = double(x[i]);
      acc = acc + (Square ? v * v : v);
    }
    lane[t] = acc;
  }
  for (int s = kSumLanes / 2; s > 0; s >>= 1)
    for (int t = 0; t < s; ++t) lane[t] = lane[t] + lane[t + s];
  return lane[0];
}

template <bool Square, class T>
void sum_level(const T* x, int64_t n, double* out) {
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kSumBlock;
    out[b] = sum_block<Square>(x + lo, n - lo < kSumBlock ? n - lo : kSumBlock);
  }
}

int64_t level_count(int64_t n) { return (n + kSumBlock - 1) / kSumBlock; }

}  // namespace

void copy(void* dst, const void* src, int64_t bytes, const Where& w) {
  if (bytes <= 0) return;
  if (w.mem == MemSpace::device) return device::copy(dst, src, bytes, w.stream, "vec::copy");
  std::memcpy(dst, src, size_t(bytes));
}

void zero(void* dst, int64_t bytes, const Where& w) {
  if (bytes <= 0) return;
  if (w.mem == MemSpace::device) return device::zero(dst, bytes, w.stream, "vec::zero");
  std::memset(dst, 0, size_t(bytes));
}

void convert(void* y, DType yt, const void* x, DType xt, int64_t n, const Where& w) {
  if (n <= 0) return;
  if (w.mem == MemSpace::device) return convert_cuda(y, yt, x, xt, n, w.stream);
  if (yt == xt) {
    std::memcpy(y, x, size_t(n) * size_t(dtype_size(xt)));
    return;
  }
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dtype_store(y, yt, i, dtype_load(x, xt, i));
}

void add(void* y, DType yt, const void* x, DType xt, int64_t n, const Where& w) {
  if (n <= 0) return;
  if (w.mem == MemSpace::device) return add_cuda(y, yt, x, xt, n, w.stream);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dtype_store(y, yt, i, dtype_load(y, yt, i) + dtype_load(x, xt, i));
}

void sum(float* z, const float* a, const float* b, int64_t n, const Where& w) {
  if (n <= 0) return;
  if (w.mem == MemSpace::device) return sum_cuda(z, a, b, n, w.stream);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) z[i] = a[i] + b[i];
}

void diff(float* z, const float* a, const void* x, DType xt, int64_t n, const Where& w) {
  if (n <= 0) return;
  if (w.mem == MemSpace::device) return diff_cuda(z, a, x, xt, n, w.stream);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) z[i] = a[i] - dtype_load(x, xt, i);
}

void residual_update(float* e, const float* v, const float* d, int64_t n, const float* scales, int32_t block,
                     const Where& w) {
  if (n <= 0) return;
  if (w.mem == MemSpace::device) return residual_update_cuda(e, v, d, n, scales, block, w.stream);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = block > 0 ? scales[i / block] != scales[i / block] : !(v[i] - v[i] == 0.0f);
    if (!keep) e[i] = v[i] - d[i];
  }
}

int64_t sum_squares_work(int64_t n) {
  int64_t total = 0;
  for (int64_t c = level_count(n); c > 1; c = level_count(c)) total += c;
  return total;
}

void sum_squares(const float* x, int64_t n, double* out, double* work, const Where& w) {
  if (w.mem == MemSpace::device) return sum_squares_cuda(x, n, out, work, w.stream);
  if (n <= 0) {
    *out = 0.0;
    return;
  }
  int64_t c = level_count(n);
  double* level = c > 1 ? work : out;
  sum_level<true>(x, n, level);
  while (c > 1) {
    const int64_t next = level_count(c);
    double* dst = next > 1 ? level + c : out;
    sum_level<false>(level, c, dst);
    level = dst;
    c = next;
  }
}

#if !ZERO8_WITH_CUDA
// Reached only for device memory, which a build without CUDA cannot hold.
void convert_cuda(void*, DType, const void*, DType, int64_t, void*) { device::require_cuda("vec::convert"); }
void add_cuda(void*, DType, const void*, DType, int64_t, void*) { device::require_cuda("vec::add"); }
void sum_cuda(float*, const float*, const float*, int64_t, void*) { device::require_cuda("vec::sum"); }
void diff_cuda(float*, const float*, const void*, DType, int64_t, void*) { device::require_cuda("vec::diff"); }
void residual_update_cuda(float*, const float*, const float*, int64_t, const float*, int32_t, void*) {
  device::require_cuda("vec::residual_update");
}
void sum_squares_cuda(const float*, int64_t, double*, double*, void*) { device::require_cuda("vec::sum_squares"); }
#endif

}  // namespace zero8::vec
