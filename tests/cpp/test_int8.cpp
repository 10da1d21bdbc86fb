// Int8 linear-layer kernels: every SIMD variant bit-identical to the scalar reference (codes, scales,
// outputs, on shapes with vector tails, all dtypes, nearest and stochastic), the quantization rules
// themselves (scale = absmax / 127, round to nearest even, outlier columns), thread-count independence,
// the GEMM against the exact integer reference, the per-block (Jetfire) product's VNNI kernel against its
// reference bit for bit and against float64, and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "zero8/error.h"
#include "zero8/int8.h"
#include "zero8/kernels/int8.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace zero8;
using namespace zero8::int8;

namespace {

const Isa kSimd[] = {Isa::avx2, Isa::avx512};
const DType kTypes[] = {DType::f32, DType::bf16, DType::f16};

// rows x cols values of dtype t (stored as raw bytes), normal with a few large entries, one exact zero
// row and one column of outliers, so scales, masks and tails all get exercised.
std::vector<uint8_t> make_matrix(int64_t rows, int64_t cols, DType t, uint32_t seed, float outlier = 40.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> buf(static_cast<size_t>(rows * cols * dtype_size(t)));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float v = nd(gen);
      if (r == 1) v = 0.0f;                       // an all-zero row
      if (c == 3 && rows > 2 && r % 3 == 0) v *= outlier;  // a systematic outlier column
      dtype_store(buf.data(), t, r * cols + c, v);
    }
  return buf;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{1, 1}, {3, 17}, {37, 83}, {64, 128}, {5, 200}};

}  // namespace

TEST(Int8Rules, RowScaleIsAbsmaxOver127AndRoundsToNearestEven) {
  // absmax 127 makes the scale exactly 1, so codes are rint(x): ties go to the even integer.
  const std::vector<float> x = {127.0f, 2.5f, 3.5f, -2.5f, -3.5f, 0.49f, -126.6f, 0.0f};
  std::vector<int8_t> q(x.size());
  float scale = 0;
  int8_quantize_rows(x.data(), DType::f32, 1, int64_t(x.size()), q.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  const std::vector<int8_t> want = {127, 2, 4, -2, -4, 0, -127, 0};
  EXPECT_EQ(q, want);

  // A general row: the absmax element decodes exactly to itself (code +-127), every code is the
  // rounded quotient, and the dequantization error is at most half a step.
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> y(1000);
  for (auto& v : y) v = nd(gen);
  y[17] = -9.75f;  // the extreme element is negative
  std::vector<int8_t> qy(y.size());
  float sy = 0;
  int8_quantize_rows(y.data(), DType::f32, 1, int64_t(y.size()), qy.data(), &sy);
  EXPECT_EQ(sy, 9.75f / 127.0f);
  EXPECT_EQ(qy[17], -127);
  for (size_t i = 0; i < y.size(); ++i) {
    EXPECT_EQ(qy[i], int8_t(std::nearbyint(y[i] / sy))) << i;
    EXPECT_LE(std::fabs(qy[i] * sy - y[i]), sy / 2 * (1 + 1e-6f)) << i;
  }
}

TEST(Int8Rules, OutlierColumnsAreMarkedExcludedAndZeroed) {
  // Columns 1 (|x| == threshold counts) and 3 (a large negative) are outliers; NaN never counts.
  const float nan = std::nanf("");
  const std::vector<float> x = {0.5f, 6.0f, 1.0f, 0.1f, nan,   //
                                -1.0f, 0.2f, 5.99f, -60.0f, 0.3f};
  std::vector<uint8_t> mask(5);
  EXPECT_EQ(int8_outlier_columns(x.data(), DType::f32, 2, 5, 6.0f, mask.data()), 2);
  EXPECT_EQ(mask, (std::vector<uint8_t>{0, 1, 0, 1, 0}));
  // Row 1 without its outlier columns: absmax 5.99 (column 2), so scale 5.99/127; columns 1, 3 get 0.
  std::vector<int8_t> q(10);
  std::vector<float> s(2);
  const std::vector<float> x2 = {0.5f, 6.0f, 1.0f, 0.1f, 2.0f, -1.0f, 0.2f, 5.99f, -60.0f, 0.3f};
  int8_quantize_rows(x2.data(), DType::f32, 2, 5, q.data(), s.data(), mask.data());
  EXPECT_EQ(s[0], 2.0f / 127.0f);
  EXPECT_EQ(s[1], 5.99f / 127.0f);
  EXPECT_EQ(q[1], 0);
  EXPECT_EQ(q[3], 0);
  EXPECT_EQ(q[6], 0);
  EXPECT_EQ(q[8], 0);
  EXPECT_EQ(q[7], 127);
  EXPECT_EQ(q[4], 127);
}

TEST(Int8Rules, ZeroAndNonFiniteGroups) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {0, 0, 0, 1, inf, 2, 1, std::nanf(""), 3};
  std::vector<int8_t> q(9, 5);
  std::vector<float> s(3);
  int8_quantize_rows(x.data(), DType::f32, 3, 3, q.data(), s.data());
  EXPECT_EQ(s[0], 0.0f);  // all-zero row: scale 0, codes 0
  EXPECT_TRUE(std::isnan(s[1]) && std::isnan(s[2]));  // Inf/NaN row: NaN scale (poisons its outputs), codes 0
  for (int8_t v : q) EXPECT_EQ(v, 0);
}

TEST(Int8Rules, BlockScalesPerTileAndPartialEdges) {
  // 5 x 7 in 2 x 3 blocks: 3 x 3 tiles, edge tiles partial; each tile's scale is its own absmax / 127.
  std::vector<float> x(35);
  for (int i = 0; i < 35; ++i) x[size_t(i)] = float((i * 37) % 23) - 11.0f;
  std::vector<int8_t> q(35);
  std::vector<float> s(static_cast<size_t>(int8_block_count(5, 7, 2, 3)));
  ASSERT_EQ(s.size(), 9u);
  int8_quantize_blocks(x.data(), DType::f32, 5, 7, 2, 3, q.data(), s.data());
  for (int br = 0; br < 3; ++br)
    for (int bc = 0; bc < 3; ++bc) {
      float m = 0;
      for (int r = br * 2; r < std::min(5, br * 2 + 2); ++r)
        for (int c = bc * 3; c < std::min(7, bc * 3 + 3); ++c) m = std::max(m, std::fabs(x[size_t(r * 7 + c)]));
      EXPECT_EQ(s[size_t(br * 3 + bc)], m / 127.0f) << br << "," << bc;
      for (int r = br * 2; r < std::min(5, br * 2 + 2); ++r)
        for (int c = bc * 3; c < std::min(7, bc * 3 + 3); ++c)
          EXPECT_EQ(q[size_t(r * 7 + c)], int8_t(std::nearbyint(x[size_t(r * 7 + c)] / (m / 127.0f))));
    }
  std::vector<float> y(35);
  int8_dequantize_blocks(q.data(), s.data(), 5, 7, 2, 3, y.data(), DType::f32);
  for (int i = 0; i < 35; ++i) EXPECT_EQ(y[size_t(i)], float(q[size_t(i)]) * s[size_t((i / 7 / 2) * 3 + (i % 7) / 3)]);
}

TEST(Int8Rules, StochasticRoundingIsUnbiasedAndNeighbouring) {
  // x / scale = 127 * 0.3 = 38.1: codes are 38 or 39 only, 39 with probability 0.1. Over n draws the
  // count of 39s is binomial; 6 standard deviations bound a correct implementation's deviation.
  const int64_t n = 200000;
  std::vector<float> x(static_cast<size_t>(n), 0.3f);
  x[0] = 1.0f;  // absmax 1
  std::vector<int8_t> q(static_cast<size_t>(n));
  float s = 0;
  Int8QuantOptions opt;
  opt.stochastic = true;
  opt.seed = 11;
  int8_quantize_rows(x.data(), DType::f32, 1, n, q.data(), &s, nullptr, opt);
  const float frac = 0.3f / s - 38.0f;
  int64_t up = 0;
  for (int64_t i = 1; i < n; ++i) {
    ASSERT_TRUE(q[size_t(i)] == 38 || q[size_t(i)] == 39) << int(q[size_t(i)]);
    up += q[size_t(i)] == 39;
  }
  const double mean = double(n - 1) * frac, sd = std::sqrt(double(n - 1) * frac * (1 - frac));
  EXPECT_NEAR(double(up), mean, 6 * sd);
  EXPECT_EQ(q[0], 127);  // the absmax element is exact under stochastic rounding too (u < 1)
}

TEST(Int8Variants, RowQuantMatchesReference) {
  for (Isa isa : kSimd) {
    if (!isa_supported(isa)) continue;
    for (DType t : kTypes)
      for (const Shape& sh : kShapes)
        for (int variant = 0; variant < 3; ++variant) {  // plain, with mask, stochastic
          const auto x = make_matrix(sh.rows, sh.cols, t, 7);
          std::vector<uint8_t> mask(static_cast<size_t>(sh.cols));
          for (int64_t c = 0; c < sh.cols; ++c) mask[size_t(c)] = (c % 5 == 3);
          RowQuantArgs a;
          a.x = x.data();
          a.dtype = t;
          a.rows = sh.rows;
          a.cols = sh.cols;
          a.col_mask = variant == 1 ? mask.data() : nullptr;
          a.stochastic = variant == 2;
          a.seed = 5;
          a.index_base = 1000;
          std::vector<int8_t> q0(static_cast<size_t>(sh.rows * sh.cols)), q1 = q0;
          std::vector<float> s0(static_cast<size_t>(sh.rows)), s1 = s0;
          a.q = q0.data();
          a.scale = s0.data();
          int8_row_quant_ref(a);
          a.q = q1.data();
          a.scale = s1.data();
          int8_row_quant(a, isa, 1);
          EXPECT_EQ(q0, q1) << isa_name(isa) << " " << dtype_name(t) << " " << sh.rows << "x" << sh.cols << " v" << variant;
          EXPECT_TRUE(same_bits(s0, s1)) << isa_name(isa) << " " << dtype_name(t);
        }
  }
}

TEST(Int8Variants, ColQuantMatchesReference) {
  for (Isa isa : kSimd) {
    if (!isa_supported(isa)) continue;
    for (DType t : kTypes)
      for (const Shape& sh : kShapes)
        for (bool stoch : {false, true}) {
          const auto x = make_matrix(sh.rows, sh.cols, t, 9);
          ColQuantArgs a;
          a.x = x.data();
          a.dtype = t;
          a.rows = sh.rows;
          a.cols = sh.cols;
          a.stochastic = stoch;
          a.seed = 3;
          std::vector<int8_t> q0(static_cast<size_t>(sh.rows * sh.cols)), q1 = q0;
          std::vector<float> s0(static_cast<size_t>(sh.cols)), s1 = s0;
          a.q = q0.data();
          a.scale = s0.data();
          int8_col_quant_ref(a);
          a.q = q1.data();
          a.scale = s1.data();
          int8_col_quant(a, isa, 1);
          EXPECT_EQ(q0, q1) << isa_name(isa) << " " << dtype_name(t) << " " << sh.rows << "x" << sh.cols;
          EXPECT_TRUE(same_bits(s0, s1));
        }
  }
}

TEST(Int8Variants, BlockQuantAndDequantMatchReference) {
  const int32_t blocks[][2] = {{32, 32}, {16, 48}, {7, 5}, {1, 64}};
  for (Isa isa : kSimd) {
    if (!isa_supported(isa)) continue;
    for (DType t : kTypes)
      for (const Shape& sh : kShapes)
        for (const auto& b : blocks)
          for (bool stoch : {false, true}) {
            const auto x = make_matrix(sh.rows, sh.cols, t, 13);
            BlockQuantArgs a;
            a.x = x.data();
            a.dtype = t;
            a.rows = sh.rows;
            a.cols = sh.cols;
            a.block_rows = b[0];
            a.block_cols = b[1];
            a.stochastic = stoch;
            a.seed = 21;
            a.index_base = 7;
            const size_t nb = size_t(int8_block_count(sh.rows, sh.cols, b[0], b[1]));
            std::vector<int8_t> q0(static_cast<size_t>(sh.rows * sh.cols)), q1 = q0;
            std::vector<float> s0(nb), s1(nb);
            a.q = q0.data();
            a.scale = s0.data();
            int8_block_quant_ref(a);
            a.q = q1.data();
            a.scale = s1.data();
            int8_block_quant(a, isa, 1);
            ASSERT_EQ(q0, q1) << isa_name(isa) << " " << dtype_name(t) << " " << sh.rows << "x" << sh.cols << " b"
                              << b[0] << "x" << b[1] << " stoch " << stoch;
            ASSERT_TRUE(same_bits(s0, s1));
            BlockDequantArgs d;
            d.q = q0.data();
            d.scale = s0.data();
            d.rows = sh.rows;
            d.cols = sh.cols;
            d.block_rows = b[0];
            d.block_cols = b[1];
            d.dtype = t;
            std::vector<uint8_t> y0(x.size()), y1(x.size());
            d.y = y0.data();
            int8_block_dequant_ref(d);
            d.y = y1.data();
            int8_block_dequant(d, isa, 1);
            ASSERT_EQ(y0, y1) << isa_name(isa) << " dequant " << dtype_name(t);
          }
  }
}

TEST(Int8Variants, OutliersMatchReference) {
  for (Isa isa : kSimd) {
    if (!isa_supported(isa)) continue;
    for (DType t : kTypes)
      for (const Shape& sh : kShapes) {
        const auto x = make_matrix(sh.rows, sh.cols, t, 17);
        OutlierArgs a;
        a.x = x.data();
        a.dtype = t;
        a.rows = sh.rows;
        a.cols = sh.cols;
        a.threshold = 2.5f;  // catches the outlier column and a few normal tails
        std::vector<uint8_t> m0(static_cast<size_t>(sh.cols)), m1 = m0;
        a.mask = m0.data();
        const int64_t n0 = int8_col_outliers_ref(a);
        a.mask = m1.data();
        const int64_t n1 = int8_col_outliers(a, isa, 1);
        EXPECT_EQ(n0, n1);
        EXPECT_EQ(m0, m1) << isa_name(isa) << " " << dtype_name(t) << " " << sh.rows << "x" << sh.cols;
      }
  }
}

TEST(Int8Variants, EpilogueMatchesReference) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int32_t> ai(-2000000, 2000000);
  std::uniform_real_distribution<float> uf(-1.0f, 1.0f);
  for (Isa isa : kSimd) {
    if (!isa_supported(isa)) continue;
    for (DType t : kTypes)
      for (const Shape& sh : kShapes)
        for (int variant = 0; variant < 3; ++variant) {  // vector-wise + add + bias; block groups; accumulate
          const int64_t rows = sh.rows, cols = sh.cols;
          if (variant == 2 && t != DType::f32) continue;
          std::vector<int32_t> acc(static_cast<size_t>(rows * cols));
          for (auto& v : acc) v = ai(gen);
          std::vector<float> rs(static_cast<size_t>(rows * 4 + 4)), cs(static_cast<size_t>(cols * 4 + 4)), add(acc.size()), bias(static_cast<size_t>(cols));
          for (auto& v : rs) v = uf(gen) * 0.01f;
          for (auto& v : cs) v = uf(gen) * 0.02f;
          for (auto& v : add) v = uf(gen);
          for (auto& v : bias) v = uf(gen);
          EpilogueArgs a;
          a.acc = acc.data();
          a.rows = rows;
          a.cols = cols;
          a.row_scale = rs.data();
          a.col_scale = cs.data();
          a.out_dtype = t;
          if (variant == 0) {
            a.add = add.data();
            a.bias = bias.data();
          } else {
            a.row_group = 4;
            a.row_stride = 3;
            a.col_group = 5;
            a.col_stride = 2;
            a.accumulate = variant == 2;
          }
          std::vector<uint8_t> o0(static_cast<size_t>(rows * cols * dtype_size(t)));
          for (size_t i = 0; i < o0.size() / 4 * 4; i += 4) {
            const float v = uf(gen);
            std::memcpy(&o0[i], &v, 4);
          }
          std::vector<uint8_t> o1 = o0;
          a.out = o0.data();
          int8_epilogue_ref(a);
          a.out = o1.data();
          int8_epilogue(a, isa, 1);
          EXPECT_EQ(o0, o1) << isa_name(isa) << " " << dtype_name(t) << " " << rows << "x" << cols << " v" << variant;
        }
  }
}

TEST(Int8Variants, ThreadCountDoesNotChangeResults) {
  // Large enough that the dispatcher splits (2 threads requested), stochastic draws indexed by element.
  const int64_t rows = 300, cols = 520;
  const auto x = make_matrix(rows, cols, DType::f32, 23);
  for (Isa isa : {Isa::scalar, Isa::avx512}) {
    if (!isa_supported(isa)) continue;
    BlockQuantArgs a;
    a.x = x.data();
    a.rows = rows;
    a.cols = cols;
    a.stochastic = true;
    a.seed = 9;
    const size_t nb = size_t(int8_block_count(rows, cols, 32, 32));
    std::vector<int8_t> q0(static_cast<size_t>(rows * cols)), q1 = q0;
    std::vector<float> s0(nb), s1(nb);
    a.q = q0.data();
    a.scale = s0.data();
    int8_block_quant(a, isa, 1);
    a.q = q1.data();
    a.scale = s1.data();
    int8_block_quant(a, isa, 2);
    EXPECT_EQ(q0, q1);
    ColQuantArgs c;
    c.x = x.data();
    c.rows = rows;
    c.cols = cols;
    c.stochastic = true;
    std::vector<float> cs0(static_cast<size_t>(cols)), cs1(static_cast<size_t>(cols));
    c.q = q0.data();
    c.scale = cs0.data();
    int8_col_quant(c, isa, 1);
    c.q = q1.data();
    c.scale = cs1.data();
    int8_col_quant(c, isa, 2);
    EXPECT_EQ(q0, q1);
    EXPECT_TRUE(same_bits(cs0, cs1));
    OutlierArgs o;
    o.x = x.data();
    o.rows = rows;
    o.cols = cols;
    o.threshold = 3.0f;
    std::vector<uint8_t> m0(static_cast<size_t>(cols)), m1(static_cast<size_t>(cols));
    o.mask = m0.data();
    const int64_t n0 = int8_col_outliers(o, isa, 1);
    o.mask = m1.data();
    EXPECT_EQ(int8_col_outliers(o, isa, 2), n0);
    EXPECT_EQ(m0, m1);
  }
}

// Without VNNI, oneDNN's int8 kernels saturate pairwise int16 sums; zero8 then splits the weights into
// two 7-bit products. Random operands catch a saturating product, and operands of only -128 and 127 (the
// largest pair sums, each sign) at the extremes of the split too. tests/CMakeLists.txt runs this suite a
// second time with DNNL_MAX_CPU_ISA=AVX2, so the split path runs on VNNI machines as well.
TEST(Int8Gemm, LibraryMatchesExactIntegerReference) {
  const char* cap = std::getenv("DNNL_MAX_CPU_ISA");
  if (cap && std::string(cap) == "AVX2" && int8_gemm_backend().rfind("onednn", 0) == 0) {
    ASSERT_NE(int8_gemm_backend().find("(avx2, no VNNI"), std::string::npos) << int8_gemm_backend();
  }
  std::mt19937 gen(1);
  std::uniform_int_distribution<int> d(-128, 127);
  for (bool extremes : {false, true})
    for (bool bt : {true, false})
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 13, 33}, {64, 48, 300}, {33, 65, 1024}}) {
        std::vector<int8_t> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
        for (auto& v : a) v = extremes ? int8_t(gen() % 2 ? -128 : 127) : int8_t(d(gen));
        for (auto& v : b) v = extremes ? int8_t(gen() % 2 ? -128 : 127) : int8_t(d(gen));
        std::vector<int32_t> c0(static_cast<size_t>(m * n)), c1(static_cast<size_t>(m * n), 123);
        GemmArgs g;
        g.a = a.data();
        g.b = b.data();
        g.c = c0.data();
        g.m = m;
        g.n = n;
        g.k = k;
        g.b_trans = bt;
        int8_gemm_ref(g);
        int8_gemm(a.data(), b.data(), c1.data(), m, n, k, bt);
        EXPECT_EQ(c0, c1) << int8_gemm_backend() << " " << m << "x" << n << "x" << k << " b_trans " << bt
                          << (extremes ? " extremes" : " random");
      }
  // The largest k: sums of 131071 equal products reach int32's limits (-128 * -128 * k = 2^31 - 2^14).
  const int64_t k = 131071;
  for (int8_t bv : {int8_t(-128), int8_t(127)}) {
    const std::vector<int8_t> a(static_cast<size_t>(2 * k), int8_t(-128)), b(static_cast<size_t>(3 * k), bv);
    std::vector<int32_t> c(6, 0);
    int8_gemm(a.data(), b.data(), c.data(), 2, 3, k, true);
    EXPECT_EQ(c, std::vector<int32_t>(6, int32_t(-128 * int64_t(bv) * k))) << int8_gemm_backend();
  }
}

// ---- per-block (Jetfire) product ----

// A logical m x k (or k x n) int8 operand stored either way, with the per-block scales
// int8_block_quant makes for it as stored, from random floats with one Inf-free outlier per matrix.
struct BlockOperand {
  std::vector<int8_t> q;
  std::vector<float> scale;
};

BlockOperand make_block_operand(int64_t rows, int64_t cols, int32_t block, uint32_t seed) {
  const auto x = make_matrix(rows, cols, DType::f32, seed);
  BlockOperand o;
  o.q.resize(static_cast<size_t>(rows * cols));
  o.scale.resize(static_cast<size_t>(int8_block_count(rows, cols, block, block)));
  int8_quantize_blocks(x.data(), DType::f32, rows, cols, block, block, o.q.data(), o.scale.data());
  return o;
}

struct BlockCase {
  int64_t m, n, k;
  int32_t block;
};
// Edges: k < block, k not a multiple of the block, m and n not multiples of the 4 x 48 register tile or
// of the 64 x 192 thread tile, several reduction chunks (k > 512 at block 32), odd blocks (not a multiple
// of 4: the kernel's byte-wise path).
const BlockCase kBlockCases[] = {{1, 1, 1, 32},     {3, 5, 7, 32},      {4, 48, 32, 32},    {37, 53, 100, 32},
                                 {70, 45, 100, 16}, {66, 200, 1100, 32}, {130, 97, 300, 128}, {64, 192, 512, 64},
                                 {33, 50, 90, 20},  {9, 17, 11, 3},     {5, 130, 64, 128}};

BlockGemmArgs block_args(const BlockOperand& a, bool a_trans, const BlockOperand& b, bool b_trans, const BlockCase& c,
                         const float* bias, void* out, DType t) {
  BlockGemmArgs g;
  g.a = a.q.data();
  g.a_scale = a.scale.data();
  g.a_trans = a_trans;
  g.b = b.q.data();
  g.b_scale = b.scale.data();
  g.b_trans = b_trans;
  g.m = c.m;
  g.n = c.n;
  g.k = c.k;
  g.block = c.block;
  g.bias = bias;
  g.out = out;
  g.out_dtype = t;
  return g;
}

TEST(Int8BlockGemm, VnniMatchesReferenceBitForBit) {
  if (!int8_block_gemm_vnni_supported()) GTEST_SKIP() << "no AVX512_VNNI on this CPU: only the reference runs";
  uint32_t seed = 100;
  for (const BlockCase& c : kBlockCases)
    for (int layout = 0; layout < 4; ++layout) {  // a_trans x b_trans: X W^T, dY W, dY^T X and the fourth
      const bool a_trans = layout & 1, b_trans = !(layout & 2);
      BlockOperand a = a_trans ? make_block_operand(c.k, c.m, c.block, seed++) : make_block_operand(c.m, c.k, c.block, seed++);
      const BlockOperand b = b_trans ? make_block_operand(c.n, c.k, c.block, seed++) : make_block_operand(c.k, c.n, c.block, seed++);
      if (layout == 3) a.scale[0] = std::nanf("");  // a block holding Inf/NaN: its products become NaN
      std::vector<float> bias(static_cast<size_t>(c.n));
      for (size_t j = 0; j < bias.size(); ++j) bias[j] = 0.25f * float(j % 7) - 0.5f;
      const DType t = kTypes[(layout + c.m) % 3];
      const size_t bytes = size_t(c.m * c.n * dtype_size(t));
      std::vector<uint8_t> o_ref(bytes, 0xAB), o_vnni(bytes, 0xCD);
      const float* bp = layout == 1 ? nullptr : bias.data();
      int8_block_gemm_ref(block_args(a, a_trans, b, b_trans, c, bp, o_ref.data(), t));
      for (int threads : {1, 2}) {
        int8_block_gemm_vnni(block_args(a, a_trans, b, b_trans, c, bp, o_vnni.data(), t), threads);
        EXPECT_EQ(o_ref, o_vnni) << c.m << "x" << c.n << "x" << c.k << " block " << c.block << " a_trans " << a_trans
                                 << " b_trans " << b_trans << " " << dtype_name(t) << " threads " << threads;
      }
      // The dispatching entry and the validated API pick the same kernel on this CPU.
      std::fill(o_vnni.begin(), o_vnni.end(), 0);
      int8_block_gemm(block_args(a, a_trans, b, b_trans, c, bp, o_vnni.data(), t), Isa::avx512, 2);
      EXPECT_EQ(o_ref, o_vnni);
      std::fill(o_vnni.begin(), o_vnni.end(), 0);
      int8_block_gemm(block_args(a, a_trans, b, b_trans, c, bp, o_vnni.data(), t), Isa::scalar, 2);
      EXPECT_EQ(o_ref, o_vnni) << "reference split over threads";
    }
}

TEST(Int8BlockGemm, EqualsPerSliceLibraryGemmsWithAccumulatingEpilogue) {
  // The path the fused kernel replaces: one int8 GEMM per block-wide slice of k, then the epilogue
  // float(acc) * (row scale * column scale) accumulated into a float32 output, then the bias.
  const BlockCase c{70, 100, 200, 32};
  const BlockOperand a = make_block_operand(c.m, c.k, c.block, 7), b = make_block_operand(c.n, c.k, c.block, 8);
  std::vector<float> bias(static_cast<size_t>(c.n), 0.125f);
  const int64_t nkb = (c.k + c.block - 1) / c.block;
  std::vector<float> sliced(static_cast<size_t>(c.m * c.n), 0.0f), fused(sliced.size());
  for (int64_t s = 0; s < nkb; ++s) {
    const int64_t k0 = s * c.block, len = std::min<int64_t>(c.block, c.k - k0);
    std::vector<int8_t> as(static_cast<size_t>(c.m * len)), bs(static_cast<size_t>(c.n * len));
    for (int64_t i = 0; i < c.m; ++i) std::memcpy(&as[size_t(i * len)], &a.q[size_t(i * c.k + k0)], size_t(len));
    for (int64_t j = 0; j < c.n; ++j) std::memcpy(&bs[size_t(j * len)], &b.q[size_t(j * c.k + k0)], size_t(len));
    std::vector<int32_t> acc(static_cast<size_t>(c.m * c.n));
    int8_gemm(as.data(), bs.data(), acc.data(), c.m, c.n, len, true);
    EpilogueArgs e;
    e.acc = acc.data();
    e.rows = c.m;
    e.cols = c.n;
    e.row_scale = a.scale.data() + s;
    e.row_group = c.block;
    e.row_stride = nkb;
    e.col_scale = b.scale.data() + s;
    e.col_group = c.block;
    e.col_stride = nkb;
    e.out = sliced.data();
    e.accumulate = true;
    int8_dequantize_matmul(e);
  }
  for (size_t i = 0; i < sliced.size(); ++i) sliced[i] = sliced[i] + bias[i % size_t(c.n)];
  int8_block_matmul(block_args(a, false, b, true, c, bias.data(), fused.data(), DType::f32));
  EXPECT_TRUE(same_bits(sliced, fused)) << int8_block_matmul_backend();
}

TEST(Int8BlockGemm, WithinFloat32RoundingOfFloat64Product) {
  // Against the float64 sum of the same slice terms t_s = dot_s * sA * sB (the dot products are exact
  // integers): float32 accumulation of nkb terms, each rounded up to 3 times (float(dot) above 2^24, the
  // scale product, the product) plus one rounding per addition and one for the bias, is within
  // (nkb + 4) * 2^-24 * (sum_s |t_s| + |bias|) (Higham, "Accuracy and Stability of Numerical Algorithms",
  // 2nd ed., sec. 3.1: the bound gamma_n for a recursive sum of n terms).
  for (const BlockCase& c : kBlockCases)
    for (bool b_trans : {true, false}) {
      const BlockOperand a = make_block_operand(c.m, c.k, c.block, 31);
      const BlockOperand b = b_trans ? make_block_operand(c.n, c.k, c.block, 32) : make_block_operand(c.k, c.n, c.block, 32);
      std::vector<float> bias(static_cast<size_t>(c.n), -0.75f);
      std::vector<float> out(static_cast<size_t>(c.m * c.n));
      int8_block_matmul(block_args(a, false, b, b_trans, c, bias.data(), out.data(), DType::f32));
      const int64_t bs = c.block, nkb = (c.k + bs - 1) / bs, nnb = (c.n + bs - 1) / bs;
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double sum = 0.0, mag = 0.0;
          for (int64_t s = 0; s < nkb; ++s) {
            int64_t dot = 0;
            for (int64_t kk = s * bs; kk < std::min(c.k, (s + 1) * bs); ++kk)
              dot += int64_t(a.q[size_t(i * c.k + kk)]) * (b_trans ? b.q[size_t(j * c.k + kk)] : b.q[size_t(kk * c.n + j)]);
            const double sb = b_trans ? b.scale[size_t((j / bs) * nkb + s)] : b.scale[size_t(s * nnb + j / bs)];
            const double t = double(dot) * a.scale[size_t((i / bs) * nkb + s)] * sb;
            sum += t;
            mag += std::fabs(t);
          }
          sum += bias[size_t(j)];
          mag += std::fabs(bias[size_t(j)]);
          const double bound = double(nkb + 4) * std::ldexp(1.0, -24) * mag;
          ASSERT_LE(std::fabs(double(out[size_t(i * c.n + j)]) - sum), bound)
              << c.m << "x" << c.n << "x" << c.k << " block " << c.block << " at " << i << "," << j;
        }
    }
}

TEST(Int8BlockGemm, EmptyAndZeroDepthProducts) {
  // k = 0: every output is the bias (or 0); m = 0 or n = 0: nothing is touched.
  std::vector<float> bias = {1.5f, -2.0f, 0.0f}, out(6, 9.0f);
  BlockGemmArgs g;
  g.m = 2;
  g.n = 3;
  g.k = 0;
  g.bias = bias.data();
  g.out = out.data();
  int8_block_matmul(g);
  EXPECT_EQ(out, (std::vector<float>{1.5f, -2.0f, 0.0f, 1.5f, -2.0f, 0.0f}));
  g.bias = nullptr;
  int8_block_matmul(g);
  EXPECT_EQ(out, std::vector<float>(6, 0.0f));
  g.m = 0;
  g.k = 5;
  g.out = nullptr;
  EXPECT_NO_THROW(int8_block_matmul(g));
}

TEST(Int8Api, BadArgumentsThrowNamingTheArgument) {
  std::vector<float> x(16);
  std::vector<int8_t> q(16);
  std::vector<float> s(16);
  auto expect_arg = [](auto fn, const char* name) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
    }
  };
  expect_arg([&] { int8_quantize_rows(nullptr, DType::f32, 4, 4, q.data(), s.data()); }, "x");
  expect_arg([&] { int8_quantize_rows(x.data(), DType::f32, -1, 4, q.data(), s.data()); }, "rows");
  expect_arg([&] { int8_quantize_rows(x.data(), DType::f32, 4, 4, q.data(), nullptr); }, "scale");
  expect_arg([&] { int8_quantize_rows(reinterpret_cast<char*>(x.data()) + 1, DType::f32, 2, 2, q.data(), s.data()); }, "x");
  expect_arg([&] { int8_quantize_blocks(x.data(), DType::f32, 4, 4, 0, 32, q.data(), s.data()); }, "block_rows");
  expect_arg([&] { int8_outlier_columns(x.data(), DType::f32, 4, 4, 0.0f, reinterpret_cast<uint8_t*>(q.data())); }, "threshold");
  expect_arg([&] { int8_outlier_columns(x.data(), DType::f32, 4, 4, std::nanf(""), reinterpret_cast<uint8_t*>(q.data())); }, "threshold");
  expect_arg([&] { int8_gemm(q.data(), q.data(), nullptr, 2, 2, 2); }, "c");
  expect_arg([&] { int8_gemm(q.data(), q.data(), reinterpret_cast<int32_t*>(s.data()), 1, 1, 131072); }, "k");
  EpilogueArgs e;
  std::vector<int32_t> acc(16);
  e.acc = acc.data();
  e.rows = 4;
  e.cols = 4;
  e.row_scale = s.data();
  e.col_scale = s.data();
  e.out = x.data();
  e.out_dtype = DType::bf16;
  e.accumulate = true;
  expect_arg([&] { int8_dequantize_matmul(e); }, "accumulate");
  e.accumulate = false;
  e.row_group = 0;
  expect_arg([&] { int8_dequantize_matmul(e); }, "row_group");
  // The per-block product.
  std::vector<float> out(16);
  BlockGemmArgs g;
  g.a = q.data();
  g.a_scale = s.data();
  g.b = q.data();
  g.b_scale = s.data();
  g.m = 2;
  g.n = 2;
  g.k = 4;
  g.out = out.data();
  EXPECT_NO_THROW(int8_block_matmul(g));
  auto bad = [&](auto edit, const char* name) {
    BlockGemmArgs h = g;
    edit(h);
    expect_arg([&] { int8_block_matmul(h); }, name);
  };
  bad([](BlockGemmArgs& h) { h.block = 0; }, "block");
  bad([](BlockGemmArgs& h) { h.block = 65537; }, "block");
  bad([](BlockGemmArgs& h) { h.m = -1; }, "m");
  bad([](BlockGemmArgs& h) { h.k = -3; }, "k");
  bad([](BlockGemmArgs& h) { h.a = nullptr; }, "a");
  bad([](BlockGemmArgs& h) { h.b_scale = nullptr; }, "b_scale");
  bad([&](BlockGemmArgs& h) { h.bias = reinterpret_cast<const float*>(reinterpret_cast<const char*>(s.data()) + 1); }, "bias");
  bad([](BlockGemmArgs& h) { h.out = nullptr; }, "out");
  bad([](BlockGemmArgs& h) { h.out_dtype = DType(7); }, "out_dtype");
  expect_arg([&] { int8_block_matmul(g, -1); }, "threads");
}

#if ZERO8_WITH_CUDA
// f throws zero8::Error(unsupported) whose message holds `what`.
static void expect_unsupported(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "expected an error naming " << what;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// Shapes the launch grid cannot hold are refused before any CUDA call, so this runs without a GPU
// (the pointers are never read). Before, the grid size was truncated to unsigned and launched.
TEST(Int8Cuda, ShapesBeyondTheLaunchGridAreRefusedByName) {
  alignas(16) static float x[4];
  alignas(16) static int8_t q[4];
  alignas(16) static float scale[4];
  // 65536 row blocks: gridDim.y takes at most 65535.
  expect_unsupported([&] { int8_quantize_blocks_cuda(x, DType::f32, 65536, 1, 1, 1, q, scale); },
                    "int8_block_quant_cuda: rows = 65536 / block_rows = 1 gives 65536 row blocks");
  expect_unsupported([&] { int8_quantize_blocks_cuda(x, DType::f32, 65535 * 2 + 1, 4, 2, 4, q, scale); },
                    "rows = 131071 / block_rows = 2 gives 65536 row blocks");
  // One CUDA block per row: gridDim.x takes at most 2^31 - 1.
  expect_unsupported([&] { int8_quantize_rows_cuda(x, DType::f32, int64_t(1) << 31, 1, q, scale); },
                    "int8_row_quant_cuda: rows = 2147483648 exceeds the launch grid");
}

// A host pointer is named ('x'), on a machine with a GPU; without one, the launcher says there is no usable
// device with the code every CUDA entry point uses (unsupported). It said "'x': cannot query pointer
// (driver insufficient)", invalid_argument, while the codec said unsupported.
TEST(Int8Cuda, HostPointerOrNoDeviceIsReportedAsTheOtherEntryPointsDo) {
  alignas(16) static float x[8];
  alignas(16) static int8_t q[8];
  alignas(16) static float scale[2];
  int count = 0;
  const bool device = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  try {
    int8_quantize_rows_cuda(x, DType::f32, 2, 4, q, scale);
    ADD_FAILURE() << "host pointers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), device ? ErrorCode::invalid_argument : ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(device ? "'x'" : "no usable CUDA device"), std::string::npos) << e.what();
  }
}

// cuBLASLt's int8 kernels take only TN with leading dimensions that are multiples of 4 and 4-byte
// aligned pointers; the rest is refused by name before any CUDA call (so this runs without a GPU).
// Before, cublasLtMatmul failed with "cuBLASLt status 15" (n = 50257, GPT-2's vocabulary) or NN ran.
TEST(Int8Cuda, GemmShapesCublasLtCannotRunAreRefusedByName) {
  alignas(16) static int8_t a[64], b[64];
  alignas(16) static int32_t c[64];
  expect_unsupported([&] { int8_gemm_cuda(a, b, c, 2, 4, 8, false); },
                    "int8_gemm_cuda: b_trans = false (B given as k x n) is not supported");
  expect_unsupported([&] { int8_gemm_cuda(a, b, c, 2, 50257, 8); }, "int8_gemm_cuda: n = 50257 is not a multiple of 4");
  expect_unsupported([&] { int8_gemm_cuda(a, b, c, 2, 4, 6); }, "int8_gemm_cuda: k = 6 is not a multiple of 4");
  expect_unsupported([&] { int8_gemm_cuda(a + 1, b, c, 2, 4, 8); }, "int8_gemm_cuda: pointer 'a'");
  expect_unsupported([&] { int8_gemm_cuda(a, b + 2, c, 2, 4, 8); }, "int8_gemm_cuda: pointer 'b'");
}
#endif

TEST(Int8Cuda, UnsupportedWithoutCuda) {
#if ZERO8_WITH_CUDA
  GTEST_SKIP() << "built with CUDA: the CUDA kernels need a GPU to run, none on this machine (compiled only)";
#else
  int8_t a = 1;
  int32_t c = 0;
  try {
    int8_gemm_cuda(&a, &a, &c, 1, 1, 1);
    ADD_FAILURE() << "expected an unsupported error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("not built with CUDA"), std::string::npos);
  }
  try {
    int8_block_matmul_cuda(BlockGemmArgs{});
    ADD_FAILURE() << "expected an unsupported error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
  }
#endif
}
