// The validated int8 API (zero8/int8.h): checks every argument once, then runs the int8 kernels (the
// active CPU variant with OpenMP, or the CUDA kernels), and the int8 GEMM through oneDNN's matmul
// primitive (primitives cached by shape) when zero8 was built with oneDNN, and the per-block product.
#include "zero8/int8.h"

#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "arg_checks.h"
#include "zero8/error.h"
#include "zero8/kernels/dispatch.h"

#if ZERO8_WITH_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace zero8::int8 {
namespace {

void check_shape(int64_t rows, int64_t cols) {
  ZERO8_CHECK_ARG(rows >= 0, "rows", "must be >= 0, got " << rows);
  ZERO8_CHECK_ARG(cols >= 0, "cols", "must be >= 0, got " << cols);
}

// A quantization block's side (or a per-block product's block): 1..65536.
void check_block(int32_t block, const char* name) {
  ZERO8_CHECK_ARG(block >= 1 && block <= 65536, name, "must be in 1..65536, got " << block);
}

void check_blocks(int32_t block_rows, int32_t block_cols) {
  check_block(block_rows, "block_rows");
  check_block(block_cols, "block_cols");
}

// x (rows x cols of dtype) in, q (rows x cols int8) out.
void check_quant_io(const void* x, DType dtype, int64_t rows, int64_t cols, const int8_t* q) {
  check_shape(rows, cols);
  check_dtype(dtype, "dtype");
  check_ptr(x, "x", rows * cols, dtype_size(dtype));
  check_ptr(q, "q", rows * cols, 1);
}

template <class Args>
void set_quant_options(Args& a, const Int8QuantOptions& opt) {
  a.stochastic = opt.stochastic;
  a.seed = opt.seed;
  a.index_base = opt.index_base;
}

RowQuantArgs row_args(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                      const uint8_t* col_mask, const Int8QuantOptions& opt) {
  check_quant_io(x, dtype, rows, cols, q);
  check_ptr(scale, "scale", rows, 4);
  check_threads(opt.threads);
  RowQuantArgs a;
  a.x = x;
  a.dtype = dtype;
  a.rows = rows;
  a.cols = cols;
  a.col_mask = col_mask;
  a.q = q;
  a.scale = scale;
  set_quant_options(a, opt);
  return a;
}

BlockQuantArgs block_args(const void* x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows,
                          int32_t block_cols, int8_t* q, float* scale, const Int8QuantOptions& opt) {
  check_quant_io(x, dtype, rows, cols, q);
  check_blocks(block_rows, block_cols);
  check_ptr(scale, "scale", int8_block_count(rows, cols, block_rows, block_cols), 4);
  check_threads(opt.threads);
  BlockQuantArgs a;
  a.x = x;
  a.dtype = dtype;
  a.rows = rows;
  a.cols = cols;
  a.block_rows = block_rows;
  a.block_cols = block_cols;
  a.q = q;
  a.scale = scale;
  set_quant_options(a, opt);
  return a;
}

ColQuantArgs col_args(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                      const Int8QuantOptions& opt) {
  check_quant_io(x, dtype, rows, cols, q);
  check_ptr(scale, "scale", cols, 4);
  check_threads(opt.threads);
  ColQuantArgs a;
  a.x = x;
  a.dtype = dtype;
  a.rows = rows;
  a.cols = cols;
  a.q = q;
  a.scale = scale;
  set_quant_options(a, opt);
  return a;
}

BlockDequantArgs block_dequant_args(const int8_t* q, const float* scale, int64_t rows, int64_t cols,
                                    int32_t block_rows, int32_t block_cols, void* y, DType dtype, int threads) {
  check_shape(rows, cols);
  check_dtype(dtype, "dtype");
  check_blocks(block_rows, block_cols);
  check_ptr(q, "q", rows * cols, 1);
  check_ptr(scale, "scale", int8_block_count(rows, cols, block_rows, block_cols), 4);
  check_ptr(y, "y", rows * cols, dtype_size(dtype));
  check_threads(threads);
  BlockDequantArgs a;
  a.q = q;
  a.scale = scale;
  a.rows = rows;
  a.cols = cols;
  a.block_rows = block_rows;
  a.block_cols = block_cols;
  a.y = y;
  a.dtype = dtype;
  return a;
}

OutlierArgs outlier_args(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold, uint8_t* mask) {
  check_shape(rows, cols);
  check_dtype(dtype, "dtype");
  ZERO8_CHECK_ARG(threshold > 0.0f, "threshold", "must be > 0 (or +inf for no outliers), got " << threshold);
  check_ptr(x, "x", rows * cols, dtype_size(dtype));
  check_ptr(mask, "mask", cols, 1);
  OutlierArgs a;
  a.x = x;
  a.dtype = dtype;
  a.rows = rows;
  a.cols = cols;
  a.threshold = threshold;
  a.mask = mask;
  return a;
}

void check_epilogue(const EpilogueArgs& a) {
  check_shape(a.rows, a.cols);
  check_dtype(a.out_dtype, "out_dtype");
  ZERO8_CHECK_ARG(a.row_group >= 1, "row_group", "must be >= 1, got " << a.row_group);
  ZERO8_CHECK_ARG(a.col_group >= 1, "col_group", "must be >= 1, got " << a.col_group);
  ZERO8_CHECK_ARG(a.row_stride >= 1, "row_stride", "must be >= 1, got " << a.row_stride);
  ZERO8_CHECK_ARG(a.col_stride >= 1, "col_stride", "must be >= 1, got " << a.col_stride);
  check_ptr(a.acc, "acc", a.rows * a.cols, 4);
  const int64_t nrs = a.rows > 0 ? ((a.rows - 1) / a.row_group) * a.row_stride + 1 : 0;
  const int64_t ncs = a.cols > 0 ? ((a.cols - 1) / a.col_group) * a.col_stride + 1 : 0;
  check_ptr(a.row_scale, "row_scale", a.rows > 0 && a.cols > 0 ? nrs : 0, 4);
  check_ptr(a.col_scale, "col_scale", a.rows > 0 && a.cols > 0 ? ncs : 0, 4);
  check_ptr(a.add, "add", 0, 4);
  check_ptr(a.bias, "bias", 0, 4);
  check_ptr(a.out, "out", a.rows * a.cols, dtype_size(a.out_dtype));
  ZERO8_CHECK_ARG(!a.accumulate || a.out_dtype == DType::f32, "accumulate",
                  "needs a float32 output, got " << dtype_name(a.out_dtype));
}

void check_gemm(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k) {
  ZERO8_CHECK_ARG(m >= 0, "m", "must be >= 0, got " << m);
  ZERO8_CHECK_ARG(n >= 0, "n", "must be >= 0, got " << n);
  ZERO8_CHECK_ARG(k >= 0 && k <= 131071, "k", "must be in 0..131071 (int32 accumulation), got " << k);
  check_ptr(a, "a", m * k, 1);
  check_ptr(b, "b", k * n, 1);
  check_ptr(c, "c", m * n, 4);
}

void check_block_gemm(const BlockGemmArgs& g) {
  ZERO8_CHECK_ARG(g.m >= 0, "m", "must be >= 0, got " << g.m);
  ZERO8_CHECK_ARG(g.n >= 0, "n", "must be >= 0, got " << g.n);
  ZERO8_CHECK_ARG(g.k >= 0, "k", "must be >= 0, got " << g.k);
  check_block(g.block, "block");
  check_dtype(g.out_dtype, "out_dtype");
  const int64_t bs = g.block, nmb = (g.m + bs - 1) / bs, nnb = (g.n + bs - 1) / bs, nkb = (g.k + bs - 1) / bs;
  const bool used = g.m > 0 && g.n > 0;  // an empty output reads nothing
  check_ptr(g.a, "a", used ? g.m * g.k : 0, 1);
  check_ptr(g.a_scale, "a_scale", used ? nmb * nkb : 0, 4);
  check_ptr(g.b, "b", used ? g.k * g.n : 0, 1);
  check_ptr(g.b_scale, "b_scale", used ? nkb * nnb : 0, 4);
  check_ptr(g.bias, "bias", 0, 4);
  check_ptr(g.out, "out", g.m * g.n, dtype_size(g.out_dtype));
}

#if !ZERO8_WITH_CUDA
[[noreturn]] void cuda_unsupported() { ZERO8_THROW(unsupported, "zero8 was not built with CUDA"); }
#endif

#if ZERO8_WITH_DNNL
// One oneDNN matmul primitive per (m, n, k, b_trans), created once: creation costs far more than a
// small GEMM. Bounded, like the codec's table cache: a caller cycling through many shapes rebuilds.
struct DnnlMatmul {
  dnnl::memory::desc a, b, c;
  dnnl::matmul prim;
};

dnnl::engine& dnnl_cpu_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

std::shared_ptr<const DnnlMatmul> dnnl_matmul_for(int64_t m, int64_t n, int64_t k, bool b_trans) {
  using dnnl::memory;
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::shared_ptr<const DnnlMatmul>> cache;
  const auto key = std::make_tuple(m, n, k, b_trans);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto p = std::make_shared<DnnlMatmul>();
  p->a = memory::desc({m, k}, memory::data_type::s8, memory::dims{k, 1});
  p->b = b_trans ? memory::desc({k, n}, memory::data_type::s8, memory::dims{1, k})
                 : memory::desc({k, n}, memory::data_type::s8, memory::dims{n, 1});
  p->c = memory::desc({m, n}, memory::data_type::s32, memory::dims{n, 1});
  p->prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(p->a, p->b, p->c), dnnl_cpu_engine()));
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 64) cache.clear();
  cache.emplace(key, p);
  return p;
}

void dnnl_matmul_run(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans) {
  try {
    const auto mm = dnnl_matmul_for(m, n, k, b_trans);
    dnnl::engine& eng = dnnl_cpu_engine();
    dnnl::stream s(eng);
    dnnl::memory am(mm->a, eng, const_cast<int8_t*>(a)), bm(mm->b, eng, const_cast<int8_t*>(b)), cm(mm->c, eng, c);
    mm->prim.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    s.wait();
  } catch (const dnnl::error& e) {
    ZERO8_THROW(internal, "oneDNN int8 matmul (" << m << " x " << k << " x " << n << ") failed: " << e.what());
  }
}

// Whether oneDNN's int8 matmul is exact for any s8 operands on the ISA it runs. Without VNNI its kernels
// multiply with vpmaddubsw, whose pairwise int16 sums saturate (oneDNN's guide, "Nuances of int8
// Computations"): on an AVX2-only AMD EPYC (Zen 3) every entry of a random 33 x 1024 x 65 product was wrong.
// Only the VNNI ISAs of oneDNN 2.x (vpdpbusd: exact int32 sums) are trusted; any other, including ISAs
// a later oneDNN adds, takes the split product below, which is exact everywhere. DNNL_MAX_CPU_ISA caps
// the effective ISA, so it also selects the split (the tests use it to cover that path on VNNI machines).
bool dnnl_s8_matmul_exact() {
  static const bool exact = [] {
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx2_vnni || isa == dnnl::cpu_isa::avx512_core_vnni ||
           isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
  }();
  return exact;
}

const char* dnnl_isa_name() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

// The weights b (n x k, or k x n when !b_trans) as b = 64 hi + lo with hi = b >> 6 in [-2, 1] and
// lo = b & 63 in [0, 63]. With weights of 7 bits a saturating kernel's pair sums stay within int16
// (|255 * 64 * 2| < 32767 with the source shifted to u8), so both products are exact, and so is
// 64 c_hi + c_lo: it is computed modulo 2^32, and the true product fits in int32 (k <= 131071).
void dnnl_gemm_split(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans) {
  const size_t nb = size_t(n * k), nc = size_t(m * n);
  std::vector<int8_t> hi(nb), lo(nb);
  for (size_t i = 0; i < nb; ++i) {
    hi[i] = int8_t(b[i] >> 6);
    lo[i] = int8_t(b[i] & 63);
  }
  std::vector<int32_t> c_lo(nc);
  dnnl_matmul_run(a, hi.data(), c, m, n, k, b_trans);
  dnnl_matmul_run(a, lo.data(), c_lo.data(), m, n, k, b_trans);
  for (size_t i = 0; i < nc; ++i) c[i] = int32_t(uint32_t(c[i]) * 64u + uint32_t(c_lo[i]));
}

void dnnl_gemm(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans) {
  if (dnnl_s8_matmul_exact())
    dnnl_matmul_run(a, b, c, m, n, k, b_trans);
  else
    dnnl_gemm_split(a, b, c, m, n, k, b_trans);
}
#endif

}  // namespace

int64_t int8_block_count(int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols) {
  check_shape(rows, cols);
  check_blocks(block_rows, block_cols);
  return ((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols);
}

void int8_quantize_rows(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                        const uint8_t* col_mask, const Int8QuantOptions& opt) {
  const RowQuantArgs a = row_args(x, dtype, rows, cols, q, scale, col_mask, opt);
  if (rows > 0) int8_row_quant(a, isa_active(), opt.threads);
}

void int8_quantize_cols(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                        const Int8QuantOptions& opt) {
  const ColQuantArgs a = col_args(x, dtype, rows, cols, q, scale, opt);
  if (cols > 0) int8_col_quant(a, isa_active(), opt.threads);
}

void int8_quantize_blocks(const void* x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows,
                          int32_t block_cols, int8_t* q, float* scale, const Int8QuantOptions& opt) {
  const BlockQuantArgs a = block_args(x, dtype, rows, cols, block_rows, block_cols, q, scale, opt);
  if (rows > 0 && cols > 0) int8_block_quant(a, isa_active(), opt.threads);
}

void int8_dequantize_blocks(const int8_t* q, const float* scale, int64_t rows, int64_t cols, int32_t block_rows,
                            int32_t block_cols, void* y, DType dtype, int threads) {
  const BlockDequantArgs a = block_dequant_args(q, scale, rows, cols, block_rows, block_cols, y, dtype, threads);
  if (rows > 0 && cols > 0) int8_block_dequant(a, isa_active(), threads);
}

int64_t int8_outlier_columns(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold, uint8_t* mask,
                             int threads) {
  const OutlierArgs a = outlier_args(x, dtype, rows, cols, threshold, mask);
  check_threads(threads);
  if (cols == 0) return 0;
  return int8_col_outliers(a, isa_active(), threads);
}

void int8_dequantize_matmul(const EpilogueArgs& args, int threads) {
  check_epilogue(args);
  check_threads(threads);
  if (args.rows > 0 && args.cols > 0) int8_epilogue(args, isa_active(), threads);
}

void int8_gemm(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans) {
  check_gemm(a, b, c, m, n, k);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m * n; ++i) c[i] = 0;
    return;
  }
#if ZERO8_WITH_DNNL
  dnnl_gemm(a, b, c, m, n, k, b_trans);
#else
  GemmArgs g;
  g.a = a;
  g.b = b;
  g.c = c;
  g.m = m;
  g.n = n;
  g.k = k;
  g.b_trans = b_trans;
  int8_gemm_ref(g);
#endif
}

std::string int8_gemm_backend() {
#if ZERO8_WITH_DNNL
  const dnnl_version_t* v = dnnl_version();
  std::ostringstream os;
  os << "onednn " << v->major << "." << v->minor << "." << v->patch << " (" << dnnl_isa_name();
  if (!dnnl_s8_matmul_exact()) os << ", no VNNI: weights split into two 7-bit products";
  os << ")";
  return os.str();
#else
  return "reference";
#endif
}

void int8_block_matmul(const BlockGemmArgs& args, int threads) {
  check_block_gemm(args);
  check_threads(threads);
  int8_block_gemm(args, isa_active(), threads);
}

std::string int8_block_matmul_backend() { return int8_block_gemm_variant(isa_active()); }

std::string int8_block_matmul_cuda_backend(int32_t block) {
  check_block(block, "block");  // the blocks int8_block_matmul_cuda takes (check_block_gemm)
#if ZERO8_WITH_CUDA
  return int8_block_gemm_cuda_variant(block);
#else
  cuda_unsupported();
#endif
}

// ---- CUDA ----

void int8_quantize_rows_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                             const uint8_t* col_mask, const Int8QuantOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  const RowQuantArgs a = row_args(x, dtype, rows, cols, q, scale, col_mask, opt);
  if (rows > 0) int8_row_quant_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)rows, (void)cols, (void)q, (void)scale, (void)col_mask, (void)opt, (void)stream;
  cuda_unsupported();
#endif
}

void int8_quantize_cols_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* scale,
                             const Int8QuantOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  const ColQuantArgs a = col_args(x, dtype, rows, cols, q, scale, opt);
  if (cols > 0) int8_col_quant_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)rows, (void)cols, (void)q, (void)scale, (void)opt, (void)stream;
  cuda_unsupported();
#endif
}

void int8_quantize_blocks_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows,
                               int32_t block_cols, int8_t* q, float* scale, const Int8QuantOptions& opt, void* stream) {
#if ZERO8_WITH_CUDA
  const BlockQuantArgs a = block_args(x, dtype, rows, cols, block_rows, block_cols, q, scale, opt);
  if (rows > 0 && cols > 0) int8_block_quant_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)rows, (void)cols, (void)block_rows, (void)block_cols, (void)q, (void)scale, (void)opt,
      (void)stream;
  cuda_unsupported();
#endif
}

void int8_dequantize_blocks_cuda(const int8_t* q, const float* scale, int64_t rows, int64_t cols, int32_t block_rows,
                                 int32_t block_cols, void* y, DType dtype, void* stream) {
#if ZERO8_WITH_CUDA
  const BlockDequantArgs a = block_dequant_args(q, scale, rows, cols, block_rows, block_cols, y, dtype, 0);
  if (rows > 0 && cols > 0) int8_block_dequant_cuda(a, stream);
#else
  (void)q, (void)scale, (void)rows, (void)cols, (void)block_rows, (void)block_cols, (void)y, (void)dtype, (void)stream;
  cuda_unsupported();
#endif
}

void int8_outlier_columns_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold, uint8_t* mask,
                               void* stream) {
#if ZERO8_WITH_CUDA
  const OutlierArgs a = outlier_args(x, dtype, rows, cols, threshold, mask);
  if (cols > 0) int8_col_outliers_cuda(a, stream);
#else
  (void)x, (void)dtype, (void)rows, (void)cols, (void)threshold, (void)mask, (void)stream;
  cuda_unsupported();
#endif
}

void int8_dequantize_matmul_cuda(const EpilogueArgs& args, void* stream) {
#if ZERO8_WITH_CUDA
  check_epilogue(args);
  if (args.rows > 0 && args.cols > 0) int8_epilogue_cuda(args, stream);
#else
  (void)args, (void)stream;
  cuda_unsupported();
#endif
}

void int8_block_matmul_cuda(const BlockGemmArgs& args, void* stream) {
#if ZERO8_WITH_CUDA
  check_block_gemm(args);
  if (args.m > 0 && args.n > 0) int8_block_gemm_cuda(args, stream);
#else
  (void)args, (void)stream;
  cuda_unsupported();
#endif
}

void int8_gemm_cuda(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t n, int64_t k, bool b_trans,
                    void* stream) {
#if ZERO8_WITH_CUDA
  check_gemm(a, b, c, m, n, k);
  GemmArgs g;
  g.a = a;
  g.b = b;
  g.c = c;
  g.m = m;
  g.n = n;
  g.k = k;
  g.b_trans = b_trans;
  if (m > 0 && n > 0) int8_gemm_cublaslt(g, stream);
#else
  (void)a, (void)b, (void)c, (void)m, (void)n, (void)k, (void)b_trans, (void)stream;
  cuda_unsupported();
#endif
}

}  // namespace zero8::int8
