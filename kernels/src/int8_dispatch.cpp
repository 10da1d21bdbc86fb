// Int8 kernel dispatch: picks the CPU variant for an Isa and splits the work across OpenMP threads in
// pieces that the single-threaded variants process whole (rows, block rows, column chunks, row groups),
// passing each piece its global element index so stochastic draws do not depend on the split.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/int8.h"

namespace zero8::int8 {
namespace {

// Below this many elements per thread a parallel region costs more than it saves.
constexpr int64_t kMinElementsPerThread = int64_t(1) << 15;

int thread_count(int64_t elements, int64_t pieces, int threads) {
  const int64_t t = threads > 0 ? threads : std::min<int64_t>(omp_get_max_threads(), elements / kMinElementsPerThread);
  return int(std::max<int64_t>(1, std::min(t, pieces)));
}

void check_isa(Isa isa) {
  if (!isa_supported(isa)) ZERO8_THROW(unsupported, "int8 kernel variant '" << isa_name(isa) << "' cannot run on this CPU/build");
}

// AVX-512 or a superset of it (the int8 kernels have no form that needs more than F/BW/DQ/VL).
bool has_avx512(Isa isa) { return int(isa) >= int(Isa::avx512); }

template <class Fn>
Fn pick(Isa isa, Fn ref, Fn avx2, Fn avx512) {
  check_isa(isa);
#if ZERO8_WITH_X86_SIMD
  if (has_avx512(isa)) return avx512;
  if (isa == Isa::avx2) return avx2;
#else
  (void)avx2, (void)avx512;
#endif
  return ref;
}

const char* bytes_at(const void* p, int64_t elements, DType t) { return static_cast<const char*>(p) + elements * dtype_size(t); }
char* bytes_at(void* p, int64_t elements, DType t) { return static_cast<char*>(p) + elements * dtype_size(t); }

// Piece p of n over [0, count) in units of `unit` (the last piece takes the remainder).
struct Span {
  int64_t lo, hi;
};
Span piece(int64_t count, int64_t unit, int p, int n) {
  const int64_t units = (count + unit - 1) / unit;
  return {std::min(count, units * p / n * unit), std::min(count, units * (p + 1) / n * unit)};
}

// body(span) on nt threads, each with its piece of [0, count) in units of `unit` (none if empty).
template <class Body>
void parallel_pieces(int nt, int64_t count, int64_t unit, const Body& body) {
#pragma omp parallel num_threads(nt)
  {
    const Span s = piece(count, unit, omp_get_thread_num(), omp_get_num_threads());
    if (s.hi > s.lo) body(s);
  }
}

}  // namespace

void int8_row_quant(const RowQuantArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_row_quant_ref, &int8_row_quant_avx2, &int8_row_quant_avx512);
  const int nt = thread_count(a.rows * a.cols, a.rows, threads);
  if (nt <= 1) return fn(a);
  parallel_pieces(nt, a.rows, 1, [&](Span s) {
    RowQuantArgs b = a;
    b.x = bytes_at(a.x, s.lo * a.cols, a.dtype);
    b.rows = s.hi - s.lo;
    b.q = a.q + s.lo * a.cols;
    b.scale = a.scale + s.lo;
    b.index_base = a.index_base + uint64_t(s.lo * a.cols);
    fn(b);
  });
}

void int8_col_quant(const ColQuantArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_col_quant_ref, &int8_col_quant_avx2, &int8_col_quant_avx512);
  const int64_t ld = a.ld > 0 ? a.ld : a.cols;
  // Column chunks of 64: whole vectors for either ISA, and independent scales.
  const int nt = thread_count(a.rows * a.cols, (a.cols + 63) / 64, threads);
  if (nt <= 1) return fn(a);
  parallel_pieces(nt, a.cols, 64, [&](Span s) {
    ColQuantArgs b = a;
    b.ld = ld;
    b.x = bytes_at(a.x, s.lo, a.dtype);
    b.cols = s.hi - s.lo;
    b.q = a.q + s.lo;
    b.scale = a.scale + s.lo;
    b.index_base = a.index_base + uint64_t(s.lo);
    fn(b);
  });
}

void int8_block_quant(const BlockQuantArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_block_quant_ref, &int8_block_quant_avx2, &int8_block_quant_avx512);
  const int64_t nbr = (a.rows + a.block_rows - 1) / a.block_rows, nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  const int nt = thread_count(a.rows * a.cols, nbr, threads);
  if (nt <= 1) return fn(a);
  parallel_pieces(nt, a.rows, a.block_rows, [&](Span s) {
    BlockQuantArgs b = a;
    b.x = bytes_at(a.x, s.lo * a.cols, a.dtype);
    b.rows = s.hi - s.lo;
    b.q = a.q + s.lo * a.cols;
    b.scale = a.scale + (s.lo / a.block_rows) * nbc;
    b.index_base = a.index_base + uint64_t(s.lo * a.cols);
    fn(b);
  });
}

void int8_block_dequant(const BlockDequantArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_block_dequant_ref, &int8_block_dequant_avx2, &int8_block_dequant_avx512);
  const int64_t nbr = (a.rows + a.block_rows - 1) / a.block_rows, nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  const int nt = thread_count(a.rows * a.cols, nbr, threads);
  if (nt <= 1) return fn(a);
  parallel_pieces(nt, a.rows, a.block_rows, [&](Span s) {
    BlockDequantArgs b = a;
    b.q = a.q + s.lo * a.cols;
    b.scale = a.scale + (s.lo / a.block_rows) * nbc;
    b.rows = s.hi - s.lo;
    b.y = bytes_at(a.y, s.lo * a.cols, a.dtype);
    fn(b);
  });
}

int64_t int8_col_outliers(const OutlierArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_col_outliers_ref, &int8_col_outliers_avx2, &int8_col_outliers_avx512);
  const int nt = thread_count(a.rows * a.cols, a.rows, threads);
  if (nt <= 1) return fn(a);
  // Each thread marks its rows in its own mask; the masks are OR-ed.
  std::vector<std::vector<uint8_t>> masks(size_t(nt), std::vector<uint8_t>(size_t(a.cols), 0));
  parallel_pieces(nt, a.rows, 1, [&](Span s) {
    OutlierArgs b = a;
    b.x = bytes_at(a.x, s.lo * a.cols, a.dtype);
    b.rows = s.hi - s.lo;
    b.mask = masks[size_t(omp_get_thread_num())].data();
    fn(b);
  });
  int64_t count = 0;
  for (int64_t c = 0; c < a.cols; ++c) {
    uint8_t m = 0;
    for (const auto& t : masks) m |= t[size_t(c)];
    a.mask[c] = m;
    count += m;
  }
  return count;
}

void int8_epilogue(const EpilogueArgs& a, Isa isa, int threads) {
  const auto fn = pick(isa, &int8_epilogue_ref, &int8_epilogue_avx2, &int8_epilogue_avx512);
  const int nt = thread_count(a.rows * a.cols, (a.rows + a.row_group - 1) / a.row_group, threads);
  if (nt <= 1) return fn(a);
  // Whole row groups, so each piece starts at a group boundary of the row scales.
  parallel_pieces(nt, a.rows, a.row_group, [&](Span s) {
    EpilogueArgs b = a;
    b.acc = a.acc + s.lo * a.cols;
    b.rows = s.hi - s.lo;
    b.row_scale = a.row_scale + (s.lo / a.row_group) * a.row_stride;
    if (a.add) b.add = a.add + s.lo * a.cols;
    b.out = bytes_at(a.out, s.lo * a.cols, a.out_dtype);
    fn(b);
  });
}

bool int8_block_gemm_vnni_supported() { return isa_avx512_vnni_supported(); }

namespace {
bool block_gemm_uses_vnni(Isa isa) {
  check_isa(isa);
  return has_avx512(isa) && int8_block_gemm_vnni_supported();
}
}  // namespace

const char* int8_block_gemm_variant(Isa isa) { return block_gemm_uses_vnni(isa) ? "avx512-vnni" : "reference"; }

void int8_block_gemm(const BlockGemmArgs& a, Isa isa, int threads) {
  if (a.m == 0 || a.n == 0) return;
#if ZERO8_WITH_X86_SIMD
  if (a.k > 0 && block_gemm_uses_vnni(isa)) return int8_block_gemm_vnni(a, threads);
#endif
  check_isa(isa);
  // The reference, rows split across threads (outputs are independent).
  const int nt = thread_count(a.m * a.n * std::max<int64_t>(a.k, 1), a.m, threads);
  if (nt <= 1) return int8_block_gemm_ref(a);
  parallel_pieces(nt, a.m, 1, [&](Span s) { int8_block_gemm_ref(a, s.lo, s.hi); });
}

}  // namespace zero8::int8
