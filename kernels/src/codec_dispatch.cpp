// Codec dispatch: picks the CPU variant for an Isa and splits the blocks across OpenMP threads.
// Each part runs the single-threaded variant on a whole-block sub-range (with its global
// index_base), so the result does not depend on the thread count or on which thread runs a part.
#include <omp.h>

#include <algorithm>

#include "zero8/error.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

// Below this many elements per thread a parallel region costs more than it saves (only used when
// the caller leaves the thread count to us).
constexpr int64_t kMinElementsPerThread = int64_t(1) << 16;

int thread_count(int64_t n, int64_t nblocks, int threads) {
  int64_t t = threads > 0 ? threads : std::min<int64_t>(omp_get_max_threads(), n / kMinElementsPerThread);
  return int(std::max<int64_t>(1, std::min(t, nblocks)));
}

using EncodeFn = void (*)(const EncodeArgs&);
using DecodeFn = void (*)(const DecodeArgs&);

void check_isa(Isa isa) {
  if (!isa_supported(isa)) ZERO8_THROW(unsupported, "codec variant '" << isa_name(isa) << "' cannot run on this CPU/build");
}

EncodeFn encode_variant(Isa isa) {
  check_isa(isa);
#if ZERO8_WITH_X86_SIMD
  if (isa == Isa::avx512) return isa_avx512_vbmi() ? quant_encode_avx512vbmi : quant_encode_avx512;
  if (isa == Isa::avx2) return quant_encode_avx2;
#else
  (void)isa;
#endif
  return quant_encode_ref;
}

DecodeFn decode_variant(Isa isa) {
  check_isa(isa);
#if ZERO8_WITH_X86_SIMD
  if (isa == Isa::avx512) return isa_avx512_vbmi() ? quant_decode_avx512vbmi : quant_decode_avx512;
  if (isa == Isa::avx2) return quant_decode_avx2;
#else
  (void)isa;
#endif
  return quant_decode_ref;
}

// Blocks [b0, b1) of a tensor of n elements: the element range [b0 * block, min(n, b1 * block)).
struct Range {
  int64_t lo, n, b0;
};
Range block_range(int64_t n, int32_t block, int64_t nblocks, int part, int parts) {
  const int64_t b0 = nblocks * part / parts, b1 = nblocks * (part + 1) / parts;
  const int64_t lo = b0 * block;
  return {lo, std::min(n, b1 * block) - lo, b0};
}

EncodeArgs part_args(const EncodeArgs& a, const Range& r) {
  EncodeArgs s = a;
  s.x = static_cast<const char*>(a.x) + r.lo * dtype_size(a.dtype);
  s.n = r.n;
  s.codes = a.codes + r.lo;
  s.absmax = a.absmax + r.b0;
  s.index_base = a.index_base + uint64_t(r.lo);
  return s;
}

DecodeArgs part_args(const DecodeArgs& a, const Range& r) {
  DecodeArgs s = a;
  s.codes = a.codes + r.lo;
  s.absmax = a.absmax + r.b0;
  s.n = r.n;
  s.y = static_cast<char*>(a.y) + r.lo * dtype_size(a.dtype);
  return s;
}

// The blocks go out in kPartsPerThread contiguous parts per thread, handed to whichever thread is
// free: on a shared machine a thread that loses its core does not hold up the others. Parts stay
// large (a few MiB at least for big tensors), which keeps the variants' streaming stores in play.
constexpr int kPartsPerThread = 4;

template <class Args>
void run_parts(void (*fn)(const Args&), const Args& a, int threads) {
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  const int nt = thread_count(a.n, nblocks, threads);
  if (nt <= 1) return fn(a);
  const int parts = int(std::min<int64_t>(nblocks, int64_t(nt) * kPartsPerThread));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int part = 0; part < parts; ++part) {
    const Range r = block_range(a.n, a.block, nblocks, part, parts);
    if (r.n > 0) fn(part_args(a, r));
  }
}

// Rows whose length is a multiple of the block are blocked as one row of all their elements.
template <class Args>
bool one_row(const Args& a) {
  return a.row <= 0 || a.row >= a.n || a.row % a.block == 0;
}

// Row r of a rows call (EncodeArgs::row, DecodeArgs::row), as a one-row call.
template <class Args>
Args row_args(const Args& a, int64_t r) {
  Args s = part_args(a, Range{r * a.row, a.row, r * ((a.row + a.block - 1) / a.block)});
  s.row = 0;
  return s;
}

DecodeArgs sum_row_args(const DecodeArgs& a, int64_t r) {  // every row into y, the first added only when accumulating
  DecodeArgs s = row_args(a, r);
  s.sum_rows = false;
  s.y = a.y;
  s.accumulate = a.accumulate || r > 0;
  return s;
}

}  // namespace

void quant_encode(const EncodeArgs& a, Isa isa, int threads) {
  const EncodeFn fn = encode_variant(isa);
  if (one_row(a)) {
    EncodeArgs s = a;
    s.row = 0;
    return run_parts(fn, s, threads);
  }
  for (int64_t r = 0; r < a.n / a.row; ++r) run_parts(fn, row_args(a, r), threads);
}

void quant_decode(const DecodeArgs& a, Isa isa, int threads) {
  const DecodeFn fn = decode_variant(isa);
  if (!a.sum_rows && one_row(a)) {
    DecodeArgs s = a;
    s.row = 0;
    return run_parts(fn, s, threads);
  }
  DecodeArgs s = a;
  if (s.row <= 0) s.row = s.n;  // a sum of one row of n
  for (int64_t r = 0; r < s.n / s.row; ++r) {
    run_parts(fn, s.sum_rows ? sum_row_args(s, r) : row_args(s, r), threads);
  }
}

}  // namespace zero8::quant
