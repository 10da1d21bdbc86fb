// Scalar reference of the int8 linear-layer kernels (zero8/kernels/int8.h): the definition every SIMD
// and CUDA variant is tested against, written as directly as the element rules allow.
#include <algorithm>
#include <cstring>

#include "zero8/kernels/int8.h"

namespace zero8::int8 {

void int8_row_quant_ref(const RowQuantArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * a.cols;
    uint32_t bits = 0;
    for (int64_t c = 0; c < a.cols; ++c)
      if (!a.col_mask || !a.col_mask[c]) bits = std::max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, base + c)));
    const float s = int8_scale_from_bits(bits);
    a.scale[r] = s;
    for (int64_t c = 0; c < a.cols; ++c) {
      const int64_t i = base + c;
      if (a.col_mask && a.col_mask[c]) {
        a.q[i] = 0;
        continue;
      }
      const float x = dtype_load(a.x, a.dtype, i);
      a.q[i] = a.stochastic ? int8_quant_stochastic(x, s, rng_uniform(a.seed, a.index_base + uint64_t(i)))
                            : int8_quant_nearest(x, s);
    }
  }
}

void int8_col_quant_ref(const ColQuantArgs& a) {
  const int64_t ld = a.ld > 0 ? a.ld : a.cols;
  for (int64_t c = 0; c < a.cols; ++c) {
    uint32_t bits = 0;
    for (int64_t r = 0; r < a.rows; ++r) bits = std::max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, r * ld + c)));
    a.scale[c] = int8_scale_from_bits(bits);
  }
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c) {
      const int64_t i = r * ld + c;
      const float x = dtype_load(a.x, a.dtype, i);
      a.q[i] = a.stochastic ? int8_quant_stochastic(x, a.scale[c], rng_uniform(a.seed, a.index_base + uint64_t(i)))
                            : int8_quant_nearest(x, a.scale[c]);
    }
}

void int8_block_quant_ref(const BlockQuantArgs& a) {
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  for (int64_t r0 = 0; r0 < a.rows; r0 += a.block_rows) {
    const int64_t r1 = std::min(a.rows, r0 + a.block_rows);
    for (int64_t c0 = 0; c0 < a.cols; c0 += a.block_cols) {
      const int64_t c1 = std::min(a.cols, c0 + a.block_cols);
      uint32_t bits = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) bits = std::max(bits, int8_abs_bits(dtype_load(a.x, a.dtype, r * a.cols + c)));
      const float s = int8_scale_from_bits(bits);
      a.scale[(r0 / a.block_rows) * nbc + c0 / a.block_cols] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t i = r * a.cols + c;
          const float x = dtype_load(a.x, a.dtype, i);
          a.q[i] = a.stochastic ? int8_quant_stochastic(x, s, rng_uniform(a.seed, a.index_base + uint64_t(i)))
                                : int8_quant_nearest(x, s);
        }
    }
  }
}

void int8_block_dequant_ref(const BlockDequantArgs& a) {
  const int64_t nbc = (a.cols + a.block_cols - 1) / a.block_cols;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c) {
      const float s = a.scale[(r / a.block_rows) * nbc + c / a.block_cols];
      dtype_store(a.y, a.dtype, r * a.cols + c, float(a.q[r * a.cols + c]) * s);
    }
}

int64_t int8_col_outliers_ref(const OutlierArgs& a) {
  std::memset(a.mask, 0, size_t(a.cols));
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c)
      if (std::fabs(dtype_load(a.x, a.dtype, r * a.cols + c)) >= a.threshold) a.mask[c] = 1;
  int64_t count = 0;
  for (int64_t c = 0; c < a.cols; ++c) count += a.mask[c];
  return count;
}

void int8_epilogue_ref(const EpilogueArgs& a) {
  for (int64_t i = 0; i < a.rows; ++i) {
    const float rs = a.row_scale[(i / a.row_group) * a.row_stride];
    for (int64_t j = 0; j < a.cols; ++j) {
      const int64_t e = i * a.cols + j;
      float v = int8_dequant_one(a.acc[e], rs, a.col_scale[(j / a.col_group) * a.col_stride]);
      if (a.add) v = v + a.add[e];
      if (a.bias) v = v + a.bias[j];
      if (a.accumulate) v = static_cast<float*>(a.out)[e] + v;
      dtype_store(a.out, a.out_dtype, e, v);
    }
  }
}

void int8_gemm_ref(const GemmArgs& a) {
  for (int64_t i = 0; i < a.m; ++i)
    for (int64_t j = 0; j < a.n; ++j) {
      int32_t s = 0;
      for (int64_t k = 0; k < a.k; ++k)
        s += int32_t(a.a[i * a.k + k]) * int32_t(a.b_trans ? a.b[j * a.k + k] : a.b[k * a.n + j]);
      a.c[i * a.n + j] = s;
    }
}

}  // namespace zero8::int8
