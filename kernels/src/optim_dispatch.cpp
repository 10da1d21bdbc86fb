// Dispatch of the fused optimizers: picks the ISA variant and splits the range across OpenMP threads
// at state-block boundaries (the step) or at the fixed norm-chunk grid (phase 1), so results never
// depend on the number of threads.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/optim_math.h"

namespace zero8::optim {
namespace {

using StepFn = void (*)(const StepArgs&);
using NormsFn = void (*)(const StepArgs&, NormSums*);

void isa_check(Isa isa) {
  if (!isa_supported(isa)) ZERO8_THROW(unsupported, "optimizer: ISA " << isa_name(isa) << " is not available here");
}

StepFn step_fn(Isa isa) {
  isa_check(isa);
#if ZERO8_WITH_X86_SIMD
  if (isa == Isa::avx512) return isa_avx512_vbmi() ? optim_step_avx512vbmi : optim_step_avx512;
  if (isa == Isa::avx2) return optim_step_avx2;
#endif
  return optim_step_ref;
}

NormsFn norms_fn(Isa isa) {
  isa_check(isa);
#if ZERO8_WITH_X86_SIMD
  if (isa == Isa::avx512) return isa_avx512_vbmi() ? optim_norms_avx512vbmi : optim_norms_avx512;
  if (isa == Isa::avx2) return optim_norms_avx2;
#endif
  return optim_norms_ref;
}

// Threads for `units` independent pieces of work covering n elements. An explicit count is honoured
// (up to one unit per thread); the default (0) also keeps at least kMinPerThread elements per thread,
// since a parallel region costs microseconds and small tensors are stepped many at a time.
constexpr int64_t kMinPerThread = 32768;
// Elements per chunk of a multi-threaded step (rounded down to whole blocks): about 1 MB of parameter,
// gradient and state traffic, large next to a chunk's set-up and small next to a step.
constexpr int64_t kStepChunk = 65536;
int threads_for(int threads, int64_t units, int64_t n) {
  int64_t t = threads > 0 ? threads : omp_get_max_threads();
  if (threads <= 0) t = std::min<int64_t>(t, n / kMinPerThread);
  t = std::min<int64_t>(t, units);
  return t < 1 ? 1 : int(t);
}

// The sub-range [lo, hi) of a (lo on a state-block boundary) as its own StepArgs; the segments that
// meet it are re-based into `offs`, and *first_seg is the index of the first of them in a.
StepArgs optim_slice(const StepArgs& a, int64_t lo, int64_t hi, std::vector<int64_t>& offs, int64_t* first_seg) {
  StepArgs s = a;
  s.n = hi - lo;
  s.param = static_cast<char*>(a.param) + lo * dtype_size(a.param_dtype);
  s.grad = static_cast<const char*>(a.grad) + lo * dtype_size(a.grad_dtype);
  if (a.master) s.master = a.master + lo;
  const int64_t b = lo / a.block;
  if (a.code1) s.code1 = a.code1 + lo;
  if (a.code2) s.code2 = a.code2 + lo;
  if (a.absmax1) s.absmax1 = a.absmax1 + b;
  if (a.absmax2) s.absmax2 = a.absmax2 + b;
  if (a.state1) s.state1 = a.state1 + lo;
  if (a.state2) s.state2 = a.state2 + lo;
  *first_seg = 0;
  if (a.nseg > 0) {
    const int64_t* begin = a.seg_offsets;
    const int64_t* end = a.seg_offsets + a.nseg + 1;
    const int64_t s0 = int64_t(std::upper_bound(begin, end, lo) - begin) - 1;
    const int64_t s1 = int64_t(std::upper_bound(begin, end, hi - 1) - begin) - 1;
    offs.clear();
    offs.push_back(0);
    for (int64_t k = s0 + 1; k <= s1; ++k) offs.push_back(a.seg_offsets[k] - lo);
    offs.push_back(hi - lo);
    s.nseg = s1 - s0 + 1;
    s.seg_offsets = offs.data();
    if (a.seg_trust) s.seg_trust = a.seg_trust + s0;
    *first_seg = s0;
  }
  return s;
}

}  // namespace

void optim_step(const StepArgs& a, Isa isa, int threads) {
  const StepFn fn = step_fn(isa);
  if (a.n <= 0) return;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  const int nt = threads_for(threads, nblocks, a.n);
  if (nt == 1) {
    fn(a);
    return;
  }
  // Chunks of whole blocks handed out dynamically: elements are independent, so any split is exact, and
  // a thread that loses its core for a while (a shared machine) no longer holds up the whole step.
  const int64_t per_chunk = std::max<int64_t>(1, kStepChunk / a.block);
  const int64_t nchunks = (nblocks + per_chunk - 1) / per_chunk;
#pragma omp parallel num_threads(nt)
  {
    std::vector<int64_t> offs;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunks; ++c) {
      int64_t first_seg = 0;
      const int64_t lo = c * per_chunk * a.block, hi = std::min<int64_t>(a.n, (c + 1) * per_chunk * a.block);
      fn(optim_slice(a, lo, hi, offs, &first_seg));
    }
  }
}

void optim_norms(const StepArgs& a, NormSums* out, Isa isa, int threads) {
  const NormsFn fn = norms_fn(isa);
  const int64_t nseg = a.nseg > 0 ? a.nseg : 1;
  const int64_t nchunks = (a.n + kOptimNormChunk - 1) / kOptimNormChunk;
  const int nt = threads_for(threads, nchunks, a.n);
  if (nt == 1 || nchunks <= 1) {
    fn(a, out);  // the variant folds the chunks in order itself
    return;
  }
  // Each chunk's per-segment sums, then folded in chunk order: the same additions, in the same
  // order, as the single-threaded variant performs (see optim_math.h).
  std::vector<int64_t> first(nchunks), count(nchunks), base(nchunks + 1, 0);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * kOptimNormChunk, hi = std::min<int64_t>(a.n, lo + kOptimNormChunk);
    if (a.nseg > 0) {
      const int64_t* b = a.seg_offsets;
      const int64_t* e = a.seg_offsets + a.nseg + 1;
      first[c] = int64_t(std::upper_bound(b, e, lo) - b) - 1;
      count[c] = int64_t(std::upper_bound(b, e, hi - 1) - b) - first[c];
    } else {
      first[c] = 0;
      count[c] = 1;
    }
    base[c + 1] = base[c] + count[c];
  }
  std::vector<NormSums> parts(static_cast<size_t>(base[nchunks]));
#pragma omp parallel num_threads(nt)
  {
    std::vector<int64_t> offs;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t lo = c * kOptimNormChunk, hi = std::min<int64_t>(a.n, lo + kOptimNormChunk);
      int64_t first_seg = 0;
      fn(optim_slice(a, lo, hi, offs, &first_seg), parts.data() + base[c]);
    }
  }
  for (int64_t s = 0; s < nseg; ++s) out[s] = NormSums{};
  for (int64_t c = 0; c < nchunks; ++c) {
    for (int64_t k = 0; k < count[c]; ++k) {
      out[first[c] + k].w_sq += parts[size_t(base[c] + k)].w_sq;
      out[first[c] + k].u_sq += parts[size_t(base[c] + k)].u_sq;
    }
  }
}

}  // namespace zero8::optim
