// Scalar reference of the per-block int8 product (BlockGemmArgs in zero8/kernels/int8.h): the definition
// the VNNI and CUDA kernels are tested against, one output at a time, slices in ascending order.
#include <algorithm>

#include "zero8/kernels/int8.h"

namespace zero8::int8 {

void int8_block_gemm_ref(const BlockGemmArgs& g, int64_t row_begin, int64_t row_end) {
  const int64_t m = g.m, n = g.n, k = g.k, bs = g.block;
  const int64_t nmb = (m + bs - 1) / bs, nnb = (n + bs - 1) / bs, nkb = (k + bs - 1) / bs;
  // Elements and scales of the logical A (m x k) and B (k x n), whichever way they are stored.
  auto a_at = [&](int64_t i, int64_t kk) { return int32_t(g.a_trans ? g.a[kk * m + i] : g.a[i * k + kk]); };
  auto b_at = [&](int64_t kk, int64_t j) { return int32_t(g.b_trans ? g.b[j * k + kk] : g.b[kk * n + j]); };
  auto a_scale = [&](int64_t ib, int64_t s) { return g.a_trans ? g.a_scale[s * nmb + ib] : g.a_scale[ib * nkb + s]; };
  auto b_scale = [&](int64_t s, int64_t jb) { return g.b_trans ? g.b_scale[jb * nkb + s] : g.b_scale[s * nnb + jb]; };
  if (row_end < 0) row_end = m;
  for (int64_t i = row_begin; i < row_end; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t s = 0; s < nkb; ++s) {
        int32_t dot = 0;
        for (int64_t kk = s * bs; kk < std::min(k, (s + 1) * bs); ++kk) dot += a_at(i, kk) * b_at(kk, j);
        acc = int8_block_accumulate(acc, dot, a_scale(i / bs, s), b_scale(s, j / bs));
      }
      if (g.bias) acc = acc + g.bias[j];
      dtype_store(g.out, g.out_dtype, i * n + j, acc);
    }
}

}  // namespace zero8::int8
