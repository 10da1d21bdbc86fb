// The int8 linear-layer kernels written once over a vector-traits class V, included by int8_avx2.cpp
// and int8_avx512.cpp. Each loop applies the element rules of zero8/kernels/int8.h lane by lane (the
// same division, rounding, clamping and draw per element), with the scalar rules for the tail
// elements, so every variant is bit-identical to int8_ref.cpp. Internal linkage throughout: each ISA's
// copy stays in its own translation unit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "zero8/kernels/int8.h"

namespace zero8::int8 {
namespace {

// V provides: F (W floats), U (W uint32), W, set1, add, mul, div, rint (ties to even), floor,
// clamp127, load<D>(p, i) (exact widening), loadf(const float*), load_i8, load_i32 (to float),
// store(p, dtype, i, v) (rounding as dtype_store), store_i8(int8_t*, v) (v integral in [-127, 127]),
// u_zero / u_load / u_store, absbits_max(acc, v) (lane max of int8_abs_bits), hmax (of U),
// masked_zero(v, mask bytes) (lanes whose byte is nonzero become +0), or_outliers(mask bytes, v, thr)
// (byte |= |v| >= thr), rng(seed, index0) (rng_uniform of index0 + lane), nonpos_zero(q, s) (lanes
// whose scale is not > 0 become 0).

template <class V, DType D>
inline float simd_row_scale(const void* x, int64_t base, int64_t cols, const uint8_t* mask) {
  typename V::U bits = V::u_zero();
  int64_t c = 0;
  for (; c + V::W <= cols; c += V::W) {
    typename V::F v = V::template load<D>(x, base + c);
    if (mask) v = V::masked_zero(v, mask + c);
    bits = V::absbits_max(bits, v);
  }
  uint32_t b = V::hmax(bits);
  for (; c < cols; ++c)
    if (!mask || !mask[c]) b = std::max(b, int8_abs_bits(dtype_load(x, D, base + c)));
  return int8_scale_from_bits(b);
}

// Codes of elements [base + c0, base + c1) (all scaled by s), nearest or stochastic; masked columns 0.
template <class V, DType D, bool kStochastic>
inline void simd_quant_span(const void* x, int64_t base, int64_t c0, int64_t c1, float s, const uint8_t* mask,
                            int8_t* q, uint64_t seed, uint64_t index_base) {
  if (!(s > 0.0f)) {
    std::memset(q + base + c0, 0, size_t(c1 - c0));
    return;
  }
  const typename V::F vs = V::set1(s);
  int64_t c = c0;
  for (; c + V::W <= c1; c += V::W) {
    typename V::F v = V::template load<D>(x, base + c);
    if (mask) v = V::masked_zero(v, mask + c);
    typename V::F n = V::div(v, vs);
    if constexpr (kStochastic) {
      n = V::floor(V::add(n, V::rng(seed, index_base + uint64_t(base + c))));
    } else {
      n = V::rint(n);
    }
    V::store_i8(q + base + c, V::clamp127(n));
  }
  for (; c < c1; ++c) {
    const int64_t i = base + c;
    if (mask && mask[c]) {
      q[i] = 0;
      continue;
    }
    const float xv = dtype_load(x, D, i);
    q[i] = kStochastic ? int8_quant_stochastic(xv, s, rng_uniform(seed, index_base + uint64_t(i))) : int8_quant_nearest(xv, s);
  }
}

template <class V, DType D>
void simd_row_quant_t(const RowQuantArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * a.cols;
    const float s = simd_row_scale<V, D>(a.x, base, a.cols, a.col_mask);
    a.scale[r] = s;
    if (a.stochastic)
      simd_quant_span<V, D, true>(a.x, base, 0, a.cols, s, a.col_mask, a.q, a.seed, a.index_base);
    else
      simd_quant_span<V, D, false>(a.x, base, 0, a.cols, s, a.col_mask, a.q, a.seed, a.index_base);
  }
}

template <class V, DType D>
void simd_block_quant_t(const BlockQuantArgs& a) {
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  for (int64_t r0 = 0; r0 < a.rows; r0 += a.block_rows) {
    const int64_t r1 = std::min(a.rows, r0 + a.block_rows);
    for (int64_t c0 = 0; c0 < a.cols; c0 += a.block_cols) {
      const int64_t c1 = std::min(a.cols, c0 + a.block_cols);
      uint32_t b = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t base = r * a.cols;
        typename V::U bits = V::u_zero();
        int64_t c = c0;
        for (; c + V::W <= c1; c += V::W) bits = V::absbits_max(bits, V::template load<D>(a.x, base + c));
        b = std::max(b, V::hmax(bits));
        for (; c < c1; ++c) b = std::max(b, int8_abs_bits(dtype_load(a.x, D, base + c)));
      }
      const float s = int8_scale_from_bits(b);
      a.scale[(r0 / a.block_rows) * nbc + c0 / a.block_cols] = s;
      for (int64_t r = r0; r < r1; ++r) {
        if (a.stochastic)
          simd_quant_span<V, D, true>(a.x, r * a.cols, c0, c1, s, nullptr, a.q, a.seed, a.index_base);
        else
          simd_quant_span<V, D, false>(a.x, r * a.cols, c0, c1, s, nullptr, a.q, a.seed, a.index_base);
      }
    }
  }
}

template <class V, DType D>
void simd_col_quant_t(const ColQuantArgs& a) {
  const int64_t ld = a.ld > 0 ? a.ld : a.cols;
  // Pass 1: per-column max of |x| bits.
  std::vector<uint32_t> bitv(size_t(a.cols), 0u);
  uint32_t* bits = bitv.data();
  const int64_t cv = a.cols - a.cols % V::W;
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * ld;
    for (int64_t c = 0; c < cv; c += V::W)
      V::u_store(bits + c, V::absbits_max(V::u_load(bits + c), V::template load<D>(a.x, base + c)));
    for (int64_t c = cv; c < a.cols; ++c) bits[c] = std::max(bits[c], int8_abs_bits(dtype_load(a.x, D, base + c)));
  }
  for (int64_t c = 0; c < a.cols; ++c) a.scale[c] = int8_scale_from_bits(bits[c]);
  // Pass 2: codes, one scale per lane.
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * ld;
    for (int64_t c = 0; c < cv; c += V::W) {
      const typename V::F vs = V::loadf(a.scale + c);
      typename V::F n = V::div(V::template load<D>(a.x, base + c), vs);
      n = a.stochastic ? V::floor(V::add(n, V::rng(a.seed, a.index_base + uint64_t(base + c)))) : V::rint(n);
      V::store_i8(a.q + base + c, V::nonpos_zero(V::clamp127(n), vs));
    }
    for (int64_t c = cv; c < a.cols; ++c) {
      const int64_t i = base + c;
      const float xv = dtype_load(a.x, D, i);
      a.q[i] = a.stochastic ? int8_quant_stochastic(xv, a.scale[c], rng_uniform(a.seed, a.index_base + uint64_t(i)))
                            : int8_quant_nearest(xv, a.scale[c]);
    }
  }
}

template <class V, DType D>
int64_t simd_col_outliers_t(const OutlierArgs& a) {
  std::memset(a.mask, 0, size_t(a.cols));
  const typename V::F thr = V::set1(a.threshold);
  const int64_t cv = a.cols - a.cols % V::W;
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * a.cols;
    for (int64_t c = 0; c < cv; c += V::W) V::or_outliers(a.mask + c, V::template load<D>(a.x, base + c), thr);
    for (int64_t c = cv; c < a.cols; ++c)
      if (std::fabs(dtype_load(a.x, D, base + c)) >= a.threshold) a.mask[c] = 1;
  }
  int64_t count = 0;
  for (int64_t c = 0; c < a.cols; ++c) count += a.mask[c];
  return count;
}

// The per-column scale of every output column, expanded from its group (one float per column).
inline std::vector<float> simd_expand_col_scale(const EpilogueArgs& a) {
  std::vector<float> cs(size_t(a.cols));
  for (int64_t j = 0; j < a.cols; ++j) cs[size_t(j)] = a.col_scale[(j / a.col_group) * a.col_stride];
  return cs;
}

template <class V>
void simd_epilogue_t(const EpilogueArgs& a) {
  const std::vector<float> cs = simd_expand_col_scale(a);
  const int64_t cv = a.cols - a.cols % V::W;
  for (int64_t i = 0; i < a.rows; ++i) {
    const float rs = a.row_scale[(i / a.row_group) * a.row_stride];
    const typename V::F vrs = V::set1(rs);
    const int64_t base = i * a.cols;
    for (int64_t j = 0; j < cv; j += V::W) {
      typename V::F v = V::mul(V::load_i32(a.acc + base + j), V::mul(vrs, V::loadf(cs.data() + j)));
      if (a.add) v = V::add(v, V::loadf(a.add + base + j));
      if (a.bias) v = V::add(v, V::loadf(a.bias + j));
      if (a.accumulate) v = V::add(V::loadf(static_cast<const float*>(a.out) + base + j), v);
      V::store(a.out, a.out_dtype, base + j, v);
    }
    for (int64_t j = cv; j < a.cols; ++j) {
      const int64_t e = base + j;
      float v = int8_dequant_one(a.acc[e], rs, cs[size_t(j)]);
      if (a.add) v = v + a.add[e];
      if (a.bias) v = v + a.bias[j];
      if (a.accumulate) v = static_cast<float*>(a.out)[e] + v;
      dtype_store(a.out, a.out_dtype, e, v);
    }
  }
}

template <class V>
void simd_block_dequant_t(const BlockDequantArgs& a) {
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  std::vector<float> srow(size_t(a.cols));
  const int64_t cv = a.cols - a.cols % V::W;
  for (int64_t r = 0; r < a.rows; ++r) {
    if (r % a.block_rows == 0)
      for (int64_t c = 0; c < a.cols; ++c) srow[size_t(c)] = a.scale[(r / a.block_rows) * nbc + c / a.block_cols];
    const int64_t base = r * a.cols;
    for (int64_t c = 0; c < cv; c += V::W)
      V::store(a.y, a.dtype, base + c, V::mul(V::load_i8(a.q + base + c), V::loadf(srow.data() + c)));
    for (int64_t c = cv; c < a.cols; ++c) dtype_store(a.y, a.dtype, base + c, float(a.q[base + c]) * srow[size_t(c)]);
  }
}

// dtype switch: one instantiation per element type.
template <template <class, DType> class Fn, class V, class Args>
auto simd_by_dtype(DType t, const Args& a) {
  if (t == DType::bf16) return Fn<V, DType::bf16>::run(a);
  if (t == DType::f16) return Fn<V, DType::f16>::run(a);
  return Fn<V, DType::f32>::run(a);
}
template <class V, DType D> struct RowQuantFn { static void run(const RowQuantArgs& a) { simd_row_quant_t<V, D>(a); } };
template <class V, DType D> struct ColQuantFn { static void run(const ColQuantArgs& a) { simd_col_quant_t<V, D>(a); } };
template <class V, DType D> struct BlockQuantFn { static void run(const BlockQuantArgs& a) { simd_block_quant_t<V, D>(a); } };
template <class V, DType D> struct OutlierFn { static int64_t run(const OutlierArgs& a) { return simd_col_outliers_t<V, D>(a); } };

}  // namespace
}  // namespace zero8::int8
