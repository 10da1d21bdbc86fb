// The int8 layers' CUDA kernels against the CPU references on the same inputs, compared bit for bit:
// row-, column- and block-wise quantization (nearest and stochastic, float32 and bfloat16 inputs, partial
// edge tiles, masked columns, a leading dimension), block dequantization, outlier columns (NaN never
// counts), the GEMM epilogue (add, bias, accumulate), the cuBLASLt int8 product and the per-block product.
// Without a device (or a CUDA build) they skip and say why (tests/cpp/test_int8.cpp has the refusals).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "device_test_util.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/int8.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace zero8;
using namespace zero8::int8;

#if ZERO8_WITH_CUDA

using test::Dev;
using test::same_bits;

// Normal values of a few magnitudes, with some large ones (LLM.int8's outliers) and a NaN.
std::vector<float> sample(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = g(rng) * (i % 7 == 0 ? 10.0f : 1.0f);
  if (n > 11) x[11] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

// x as stored in dtype: float32 bytes, or bfloat16 halves (both as bytes).
std::vector<uint8_t> stored(const std::vector<float>& x, DType dt) {
  std::vector<uint8_t> out(x.size() * size_t(dtype_size(dt)));
  for (size_t i = 0; i < x.size(); ++i) dtype_store(out.data(), dt, int64_t(i), x[i]);
  return out;
}

// Outputs stored as dtype, element by element: the same bits, or NaN on both sides (NaN payloads are the
// hardware's: x86 keeps an operand's, a GPU writes its canonical NaN).
bool same_outputs(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType dt) {
  if (got.size() != want.size()) return false;
  const size_t es = size_t(dtype_size(dt));
  for (size_t i = 0; i < got.size() / es; ++i) {
    if (std::memcmp(got.data() + i * es, want.data() + i * es, es) == 0) continue;
    if (std::isnan(dtype_load(got.data(), dt, int64_t(i))) && std::isnan(dtype_load(want.data(), dt, int64_t(i))))
      continue;
    return false;
  }
  return true;
}

bool same_outputs(const std::vector<float>& got, const std::vector<float>& want) {
  const auto bytes = [](const std::vector<float>& v) {
    return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                reinterpret_cast<const uint8_t*>(v.data() + v.size()));
  };
  return same_outputs(bytes(got), bytes(want), DType::f32);
}

std::vector<int8_t> codes(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(-127, 127);
  std::vector<int8_t> q(static_cast<size_t>(n));
  for (int8_t& c : q) c = int8_t(d(rng));
  return q;
}

std::vector<float> scales(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(1e-3f, 0.1f);
  std::vector<float> s(static_cast<size_t>(n));
  for (float& v : s) v = d(rng);
  return s;
}

TEST(Int8CudaKernels, RowQuantEqualsTheReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 37;
  for (int64_t cols : {300, 301})  // rows in vectors of four elements, and one by one
    for (DType dt : {DType::f32, DType::bf16})
      for (bool masked : {false, true})
        for (bool stochastic : {false, true}) {
          SCOPED_TRACE(std::to_string(cols) + " columns, " + dtype_name(dt) + (masked ? " masked" : "") +
                       (stochastic ? " stochastic" : ""));
          std::vector<uint8_t> mask(size_t(cols), 0);
          for (int64_t c = 0; c < cols; c += 17) mask[size_t(c)] = 1;
          const std::vector<uint8_t> x = stored(sample(rows * cols, 1), dt);
          RowQuantArgs a;
          a.dtype = dt;
          a.rows = rows;
          a.cols = cols;
          a.stochastic = stochastic;
          a.seed = 7;
          a.index_base = 100;
          std::vector<int8_t> q(size_t(rows * cols));
          std::vector<float> s(static_cast<size_t>(rows));
          a.x = x.data();
          a.col_mask = masked ? mask.data() : nullptr;
          a.q = q.data();
          a.scale = s.data();
          int8_row_quant_ref(a);
          Dev<uint8_t> dx(x), dmask(mask);
          Dev<int8_t> dq(std::vector<int8_t>(q.size()));
          Dev<float> ds(std::vector<float>(s.size()));
          a.x = dx.p();
          a.col_mask = masked ? dmask.p() : nullptr;
          a.q = dq.p();
          a.scale = ds.p();
          int8_row_quant_cuda(a, nullptr);
          EXPECT_TRUE(same_bits(dq.get(), q));
          EXPECT_TRUE(same_outputs(ds.get(), s));
        }
}

TEST(Int8CudaKernels, ColQuantEqualsTheReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t cols = 70;
  for (int64_t rows : {37, 600})  // one chunk of rows, and three (the column maxima meet across them)
    for (int64_t ld : {int64_t(0), int64_t(80)})
      for (bool stochastic : {false, true}) {
        SCOPED_TRACE(std::to_string(rows) + " rows, ld " + std::to_string(ld) + (stochastic ? " stochastic" : ""));
        const int64_t stride = ld > 0 ? ld : cols;
        const std::vector<uint8_t> x = stored(sample(rows * stride, 2), DType::bf16);
        ColQuantArgs a;
        a.dtype = DType::bf16;
        a.rows = rows;
        a.cols = cols;
        a.ld = ld;
        a.stochastic = stochastic;
        a.seed = 3;
        std::vector<int8_t> q(size_t(rows * stride), 0);
        std::vector<float> s(static_cast<size_t>(cols));
        a.x = x.data();
        a.q = q.data();
        a.scale = s.data();
        int8_col_quant_ref(a);
        Dev<uint8_t> dx(x);
        Dev<int8_t> dq(std::vector<int8_t>(q.size(), 0));
        Dev<float> ds(std::vector<float>(s.size()));
        a.x = dx.p();
        a.q = dq.p();
        a.scale = ds.p();
        int8_col_quant_cuda(a, nullptr);
        EXPECT_TRUE(same_bits(dq.get(), q));
        EXPECT_TRUE(same_outputs(ds.get(), s));
      }
}

TEST(Int8CudaKernels, BlockQuantAndDequantEqualTheReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 70, cols = 100;
  // Blocks of 32 x 32 and 64 x 16, and blocks of 64 x 10, whose dequantization goes one column at a time.
  for (auto [br, bc] : {std::pair<int32_t, int32_t>{32, 32}, {64, 16}, {64, 10}})
    for (bool stochastic : {false, true}) {
      SCOPED_TRACE(std::to_string(br) + "x" + std::to_string(bc) + (stochastic ? " stochastic" : ""));
      const std::vector<uint8_t> x = stored(sample(rows * cols, 4), DType::f32);
      const int64_t nb = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
      BlockQuantArgs a;
      a.rows = rows;
      a.cols = cols;
      a.block_rows = br;
      a.block_cols = bc;
      a.stochastic = stochastic;
      a.seed = 5;
      std::vector<int8_t> q(size_t(rows * cols));
      std::vector<float> s(static_cast<size_t>(nb));
      a.x = x.data();
      a.q = q.data();
      a.scale = s.data();
      int8_block_quant_ref(a);
      Dev<uint8_t> dx(x);
      Dev<int8_t> dq(std::vector<int8_t>(q.size()));
      Dev<float> ds(std::vector<float>(s.size()));
      a.x = dx.p();
      a.q = dq.p();
      a.scale = ds.p();
      int8_block_quant_cuda(a, nullptr);
      ASSERT_TRUE(same_bits(dq.get(), q));
      ASSERT_TRUE(same_outputs(ds.get(), s));
      for (DType dt : {DType::f32, DType::bf16}) {
        BlockDequantArgs d;
        d.rows = rows;
        d.cols = cols;
        d.block_rows = br;
        d.block_cols = bc;
        d.dtype = dt;
        std::vector<uint8_t> y(size_t(rows * cols * dtype_size(dt)));
        d.q = q.data();
        d.scale = s.data();
        d.y = y.data();
        int8_block_dequant_ref(d);
        Dev<uint8_t> dy(std::vector<uint8_t>(y.size()));
        d.q = dq.p();
        d.scale = ds.p();
        d.y = dy.p();
        int8_block_dequant_cuda(d, nullptr);
        EXPECT_TRUE(same_outputs(dy.get(), y, dt)) << dtype_name(dt);
      }
    }
}

TEST(Int8CudaKernels, OutlierColumnsEqualTheReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 50, cols = 200;
  std::vector<float> xf = sample(rows * cols, 6);
  for (float& v : xf) v = v * 0.1f;  // below the threshold, but for these:
  for (int64_t c : {5, 77, 150, 199}) xf[size_t((c % rows) * cols + c)] = c % 2 ? -8.0f : 6.0f;
  xf[size_t(3 * cols + 40)] = std::numeric_limits<float>::quiet_NaN();  // NaN never counts
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::vector<uint8_t> x = stored(xf, dt);
    OutlierArgs a;
    a.dtype = dt;
    a.rows = rows;
    a.cols = cols;
    a.threshold = 6.0f;
    std::vector<uint8_t> mask(size_t(cols), 9);
    a.x = x.data();
    a.mask = mask.data();
    const int64_t count = int8_col_outliers_ref(a);
    ASSERT_EQ(count, 4);
    Dev<uint8_t> dx(x), dm(std::vector<uint8_t>(size_t(cols), 9));
    a.x = dx.p();
    a.mask = dm.p();
    int8_col_outliers_cuda(a, nullptr);
    EXPECT_TRUE(same_bits(dm.get(), mask));
  }
}

TEST(Int8CudaKernels, EpilogueEqualsTheReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 45;
  // Columns one by one (70) and in vectors of four (72), with a scale per column or per group of 8 (one
  // K-slice of a per-block product).
  for (int64_t cols : {70, 72})
    for (int64_t col_group : {1, 8}) {
      std::mt19937_64 rng(8);
      std::uniform_int_distribution<int32_t> d(-2000000, 2000000);
      std::vector<int32_t> acc(size_t(rows * cols));
      for (int32_t& v : acc) v = d(rng);
      const std::vector<float> rs = scales(rows, 9), cs = scales(cols, 10), add = sample(rows * cols, 11),
                               bias = sample(cols, 12), prev = sample(rows * cols, 13);
      for (DType dt : {DType::f32, DType::bf16})
        for (bool extras : {false, true})
          for (bool accumulate : {false, true}) {
            if (accumulate && dt != DType::f32) continue;  // accumulating needs a float32 output
            SCOPED_TRACE(std::to_string(cols) + " columns, groups of " + std::to_string(col_group) + ", " +
                         dtype_name(dt) + (extras ? " add+bias" : "") + (accumulate ? " accumulate" : ""));
            EpilogueArgs a;
            a.rows = rows;
            a.cols = cols;
            a.col_group = col_group;
            a.out_dtype = dt;
            a.accumulate = accumulate;
            std::vector<uint8_t> out =
                accumulate ? stored(prev, DType::f32) : std::vector<uint8_t>(size_t(rows * cols * dtype_size(dt)));
            a.acc = acc.data();
            a.row_scale = rs.data();
            a.col_scale = cs.data();
            a.add = extras ? add.data() : nullptr;
            a.bias = extras ? bias.data() : nullptr;
            Dev<uint8_t> dout(out);
            a.out = out.data();
            int8_epilogue_ref(a);
            Dev<int32_t> dacc(acc);
            Dev<float> drs(rs), dcs(cs), dadd(add), dbias(bias);
            a.acc = dacc.p();
            a.row_scale = drs.p();
            a.col_scale = dcs.p();
            a.add = extras ? dadd.p() : nullptr;
            a.bias = extras ? dbias.p() : nullptr;
            a.out = dout.p();
            int8_epilogue_cuda(a, nullptr);
            EXPECT_TRUE(same_outputs(dout.get(), out, dt));
          }
    }
}

// cuBLASLt's m x n x k product (b transposed) of seeded codes on the current device, bit for bit against
// the reference.
void expect_cublaslt_product(int64_t m, int64_t n, int64_t k, int seed_a, int seed_b) {
  const std::vector<int8_t> a = codes(m * k, seed_a), b = codes(n * k, seed_b);
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.b_trans = true;
  std::vector<int32_t> c(size_t(m * n));
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  int8_gemm_ref(g);
  Dev<int8_t> da(a), db(b);
  Dev<int32_t> dc(std::vector<int32_t>(c.size(), -1));
  g.a = da.p();
  g.b = db.p();
  g.c = dc.p();
  int8_gemm_cublaslt(g, nullptr);
  EXPECT_TRUE(same_bits(dc.get(), c));
}

TEST(Int8CudaKernels, CublasLtProductEqualsTheReference) {
  SKIP_WITHOUT_CUDA();
  expect_cublaslt_product(33, 64, 96, 14, 15);
}

// A cuBLASLt handle belongs to the device current when it was made: the product runs on each device through
// that device's own (one process-wide handle, made on the first device, was used on every other). Needs two
// devices: ctest runs it on the simulator's two as test_int8_cuda_two_devices (tests/CMakeLists.txt), where a
// handle used on another device is refused.
TEST(Int8CudaKernels, CublasLtProductOnEachDevice) {
  SKIP_WITHOUT_CUDA();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices, found " << count;
  for (int dev : {0, 1, 0, 1}) {
    SCOPED_TRACE("device " + std::to_string(dev));
    device::DeviceGuard guard(dev, "CublasLtProductOnEachDevice");
    expect_cublaslt_product(20, 8, 12, 21, 22);
  }
}

// int8_block_gemm_cuda against the reference for one shape and block, every storage order of A and B.
// extreme: every code of A 127, B's -127 in its first half of rows (as stored) and 127 after, so that slice
// sums reach +-127 * 127 * block.
void check_block_product(int64_t m, int64_t n, int64_t k, int32_t block, DType dt, bool with_bias, bool nan_scale,
                         bool extreme) {
  const int64_t mb = (m + block - 1) / block, nb = (n + block - 1) / block, kb = (k + block - 1) / block;
  std::vector<int8_t> a = codes(m * k, 16), b = codes(n * k, 17);
  if (extreme) {
    std::fill(a.begin(), a.end(), int8_t(127));
    for (size_t i = 0; i < b.size(); ++i) b[i] = i < b.size() / 2 ? int8_t(-127) : int8_t(127);
  }
  std::vector<float> as = scales(mb * kb, 18), bs = scales(nb * kb, 19);
  if (nan_scale) as[as.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> bias = sample(n, 20);
  for (bool a_trans : {false, true})
    for (bool b_trans : {true, false}) {
      SCOPED_TRACE(std::string(a_trans ? "A^T " : "A ") + (b_trans ? "B^T " : "B ") + dtype_name(dt));
      BlockGemmArgs g;
      g.a_trans = a_trans;
      g.b_trans = b_trans;
      g.m = m;
      g.n = n;
      g.k = k;
      g.block = block;
      g.out_dtype = dt;
      std::vector<uint8_t> out(size_t(m * n * dtype_size(dt)));
      g.a = a.data();
      g.a_scale = as.data();
      g.b = b.data();
      g.b_scale = bs.data();
      g.bias = with_bias ? bias.data() : nullptr;
      g.out = out.data();
      int8_block_gemm_ref(g);
      Dev<int8_t> da(a), db(b);
      Dev<float> das(as), dbs(bs), dbias(bias);
      Dev<uint8_t> dout(std::vector<uint8_t>(out.size()));
      g.a = da.p();
      g.a_scale = das.p();
      g.b = db.p();
      g.b_scale = dbs.p();
      g.bias = with_bias ? dbias.p() : nullptr;
      g.out = dout.p();
      int8_block_gemm_cuda(g, nullptr);
      EXPECT_TRUE(same_outputs(dout.get(), out, dt));
    }
}

TEST(Int8CudaKernels, BlockProductEqualsTheReference) {
  SKIP_WITHOUT_CUDA();
  // The tensor-core kernel (blocks that are multiples of 16): leading dimensions that take its 16-byte loads
  // and ones that do not (byte loads), more than one 128 x 128 output tile with partial edge tiles, a
  // reduction shorter than a block or ending inside one, a full and a partial group of 8 row panels, slices of 16
  // (block 48) and of 32, a NaN tile scale, no bias, slice sums at their largest with blocks of 256 (the largest whose
  // sums leave the tensor cores biased) and 320 (converted); then the tiled kernel (blocks 20 and 3).
  struct Case {
    int64_t m, n, k;
    int32_t block;
    DType dt;
    bool bias, nan_scale, extreme = false;
  };
  const Case cases[] = {
      {70, 50, 100, 32, DType::f32, true, false},         {70, 50, 100, 32, DType::bf16, true, false},
      {144, 160, 96, 32, DType::f32, true, true},         {260, 136, 64, 16, DType::f16, false, false},
      {48, 272, 192, 64, DType::f32, true, false},        {130, 129, 256, 128, DType::bf16, true, false},
      {96, 112, 144, 48, DType::f32, false, true},        {33, 17, 20, 32, DType::f32, true, false},
      {100, 70, 90, 64, DType::f32, true, false},         {20, 140, 50, 128, DType::f32, true, false},
      {64, 48, 512, 256, DType::f32, false, false, true}, {40, 150, 700, 320, DType::f32, true, false, true},
      {40, 150, 700, 320, DType::f32, true, true},        {1100, 140, 32, 32, DType::bf16, true, false},
      {70, 50, 100, 20, DType::f32, true, false},         {40, 36, 50, 3, DType::bf16, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.m) + " x " + std::to_string(c.n) + " x " + std::to_string(c.k) + ", block " +
                 std::to_string(c.block) + " (" + int8_block_gemm_cuda_variant(c.block) + ")");
    check_block_product(c.m, c.n, c.k, c.block, c.dt, c.bias, c.nan_scale, c.extreme);
  }
}

TEST(Int8CudaKernels, BlockProductUsesTensorCoresForBlocksOfSixteens) {
  for (int32_t block : {16, 32, 48, 64, 128, 256}) EXPECT_STREQ(int8_block_gemm_cuda_variant(block), "wmma") << block;
  for (int32_t block : {1, 3, 8, 20, 33}) EXPECT_STREQ(int8_block_gemm_cuda_variant(block), "tiled") << block;
}

#else  // !ZERO8_WITH_CUDA

TEST(Int8CudaKernels, NeedCuda) { GTEST_SKIP() << "not built with CUDA: the int8 CUDA kernels are not compiled"; }

#endif

}  // namespace
