// Int8 linear layers (zero8/int8.h) for zero8.nn.Linear8bitLt and zero8.nn.Int8Linear: raw-pointer
// row / column / block quantization, outlier columns, the GEMM epilogue, the library int8 GEMM and the
// fused per-block product, each validated in C++ and run with the GIL released; the *_cuda entries take
// device pointers and queue the kernels on the caller's stream.
#include "bind.h"
#include "zero8/int8.h"

namespace zero8::bindings {
void init_int8(py::module_& m) {
  m.def(
      "int8_quantize_rows",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, Ptr q, Ptr scale, Ptr col_mask, bool stochastic, uint64_t seed,
         uint64_t index_base, int threads) {
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, threads);
        int8::int8_quantize_rows(as_ptr<const void>(x), dtype, rows, cols, as_ptr<int8_t>(q), as_ptr<float>(scale),
                                 as_ptr<const uint8_t>(col_mask), opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("q_ptr"), py::arg("scale_ptr"),
      py::arg("col_mask_ptr") = 0, py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Row-wise absmax int8: scale[r] = max|x[r]| / 127 over columns not in col_mask, q = round(x / scale) "
      "(ties to even; stochastic: floor(x / scale + u)); masked columns get 0. Releases the GIL.");
  m.def(
      "int8_quantize_cols",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, Ptr q, Ptr scale, bool stochastic, uint64_t seed,
         uint64_t index_base, int threads) {
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, threads);
        int8::int8_quantize_cols(as_ptr<const void>(x), dtype, rows, cols, as_ptr<int8_t>(q), as_ptr<float>(scale),
                                 opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("q_ptr"), py::arg("scale_ptr"),
      py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0, py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(), "Column-wise absmax int8 (one scale per column). Releases the GIL.");
  m.def(
      "int8_quantize_blocks",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols, Ptr q, Ptr scale,
         bool stochastic, uint64_t seed, uint64_t index_base, int threads) {
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, threads);
        int8::int8_quantize_blocks(as_ptr<const void>(x), dtype, rows, cols, block_rows, block_cols, as_ptr<int8_t>(q),
                                   as_ptr<float>(scale), opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("block_rows"),
      py::arg("block_cols"), py::arg("q_ptr"), py::arg("scale_ptr"), py::arg("stochastic") = false,
      py::arg("seed") = 0, py::arg("index_base") = 0, py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Per-block absmax int8 (Jetfire): one scale per block_rows x block_cols tile, row-major "
      "(int8_block_count scales). Releases the GIL.");
  m.def("int8_block_count", &int8::int8_block_count, py::arg("rows"), py::arg("cols"), py::arg("block_rows"),
        py::arg("block_cols"), "Number of per-block scales: ceil(rows/block_rows) * ceil(cols/block_cols).");
  m.def(
      "int8_dequantize_blocks",
      [](Ptr q, Ptr scale, int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols, Ptr y, DType dtype,
         int threads) {
        int8::int8_dequantize_blocks(as_ptr<const int8_t>(q), as_ptr<const float>(scale), rows, cols, block_rows,
                                     block_cols, as_ptr<void>(y), dtype, threads);
      },
      py::arg("q_ptr"), py::arg("scale_ptr"), py::arg("rows"), py::arg("cols"), py::arg("block_rows"),
      py::arg("block_cols"), py::arg("y_ptr"), py::arg("dtype"), py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(), "y = q * scale of its block, written as dtype. Releases the GIL.");
  m.def(
      "int8_outlier_columns",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, float threshold, Ptr mask, int threads) {
        return int8::int8_outlier_columns(as_ptr<const void>(x), dtype, rows, cols, threshold, as_ptr<uint8_t>(mask),
                                          threads);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("threshold"), py::arg("mask_ptr"),
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "mask[c] = 1 where any |x[r][c]| >= threshold; returns the number of such columns. Releases the GIL.");
  m.def(
      "int8_dequantize_matmul",
      [](Ptr acc, int64_t rows, int64_t cols, Ptr row_scale, int64_t row_group, int64_t row_stride, Ptr col_scale,
         int64_t col_group, int64_t col_stride, Ptr add, Ptr bias, Ptr out, DType out_dtype, bool accumulate,
         int threads) {
        int8::EpilogueArgs a;
        a.acc = as_ptr<const int32_t>(acc);
        a.rows = rows;
        a.cols = cols;
        a.row_scale = as_ptr<const float>(row_scale);
        a.row_group = row_group;
        a.row_stride = row_stride;
        a.col_scale = as_ptr<const float>(col_scale);
        a.col_group = col_group;
        a.col_stride = col_stride;
        a.add = as_ptr<const float>(add);
        a.bias = as_ptr<const float>(bias);
        a.out = as_ptr<void>(out);
        a.out_dtype = out_dtype;
        a.accumulate = accumulate;
        int8::int8_dequantize_matmul(a, threads);
      },
      py::arg("acc_ptr"), py::arg("rows"), py::arg("cols"), py::arg("row_scale_ptr"), py::arg("row_group") = 1,
      py::arg("row_stride") = 1, py::arg("col_scale_ptr") = 0, py::arg("col_group") = 1, py::arg("col_stride") = 1,
      py::arg("add_ptr") = 0, py::arg("bias_ptr") = 0, py::arg("out_ptr") = 0, py::arg("out_dtype") = DType::f32,
      py::arg("accumulate") = false, py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "out = float(acc) * (row_scale[(i/row_group)*row_stride] * col_scale[(j/col_group)*col_stride]) (+ add) "
      "(+ bias) (+ out when accumulate, float32 only), written as out_dtype. Releases the GIL.");
  m.def(
      "int8_gemm",
      [](Ptr a, Ptr b, Ptr c, int64_t m, int64_t n, int64_t k, bool b_trans) {
        int8::int8_gemm(as_ptr<const int8_t>(a), as_ptr<const int8_t>(b), as_ptr<int32_t>(c), m, n, k, b_trans);
      },
      py::arg("a_ptr"), py::arg("b_ptr"), py::arg("c_ptr"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("b_trans") = true, py::call_guard<py::gil_scoped_release>(),
      "C (m x n int32) = A (m x k int8) * B (n x k if b_trans else k x n), row-major, through the library int8 "
      "GEMM (int8_gemm_backend()). Releases the GIL.");
  m.def("int8_gemm_backend", &int8::int8_gemm_backend, "What int8_gemm runs: 'onednn <version>' or 'reference'.");
  m.def(
      "int8_block_matmul",
      [](Ptr a, Ptr a_scale, bool a_trans, Ptr b, Ptr b_scale, bool b_trans, int64_t m, int64_t n, int64_t k,
         int32_t block, Ptr bias, Ptr out, DType out_dtype, int threads) {
        int8::BlockGemmArgs g;
        g.a = as_ptr<const int8_t>(a);
        g.a_scale = as_ptr<const float>(a_scale);
        g.a_trans = a_trans;
        g.b = as_ptr<const int8_t>(b);
        g.b_scale = as_ptr<const float>(b_scale);
        g.b_trans = b_trans;
        g.m = m;
        g.n = n;
        g.k = k;
        g.block = block;
        g.bias = as_ptr<const float>(bias);
        g.out = as_ptr<void>(out);
        g.out_dtype = out_dtype;
        int8::int8_block_matmul(g, threads);
      },
      py::arg("a_ptr"), py::arg("a_scale_ptr"), py::arg("a_trans"), py::arg("b_ptr"), py::arg("b_scale_ptr"),
      py::arg("b_trans"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("block"), py::arg("bias_ptr") = 0,
      py::arg("out_ptr") = 0, py::arg("out_dtype") = DType::f32, py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Per-block (Jetfire) int8 product: out (m x n) = sum over block-wide slices s of k of float(int32 dot) * "
      "(sA[i/block, s] * sB[s, j/block]) in float32, + bias, written as out_dtype. A is m x k (stored k x m "
      "when a_trans), B is k x n (stored n x k when b_trans); each scale matrix is as int8_quantize_blocks "
      "made it for the operand as stored. Releases the GIL.");
  m.def("int8_block_matmul_backend", &int8::int8_block_matmul_backend,
        "What int8_block_matmul runs: 'avx512-vnni' or 'reference'.");
  m.def("int8_block_matmul_cuda_backend", &int8::int8_block_matmul_cuda_backend, py::arg("block"),
        "What int8_block_matmul_cuda runs for this block: 'wmma' (tensor cores; blocks that are multiples of 16) "
        "or 'tiled'. Raises when zero8 was built without CUDA.");

  // CUDA: device pointers, the same arguments as the CPU entries (no thread count) plus `stream`, a
  // cudaStream_t as an int (torch.cuda.current_stream(device).cuda_stream); the kernels are queued on it
  // and the calls return without waiting. A build without CUDA raises Zero8NotSupportedError.
  // pointers_checked: see POINTERS_CHECKED (bind.h).
  m.def(
      "int8_quantize_rows_cuda",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, Ptr q, Ptr scale, Ptr col_mask, bool stochastic, uint64_t seed,
         uint64_t index_base, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, 0);
        int8::int8_quantize_rows_cuda(as_ptr<const void>(x), dtype, rows, cols, as_ptr<int8_t>(q),
                                      as_ptr<float>(scale), as_ptr<const uint8_t>(col_mask), opt, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("q_ptr"), py::arg("scale_ptr"),
      py::arg("col_mask_ptr") = 0, py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "int8_quantize_rows on device pointers.");
  m.def(
      "int8_quantize_cols_cuda",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, Ptr q, Ptr scale, bool stochastic, uint64_t seed,
         uint64_t index_base, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, 0);
        int8::int8_quantize_cols_cuda(as_ptr<const void>(x), dtype, rows, cols, as_ptr<int8_t>(q),
                                      as_ptr<float>(scale), opt, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("q_ptr"), py::arg("scale_ptr"),
      py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0, py::arg("stream") = 0,
      py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(), "int8_quantize_cols on device pointers.");
  m.def(
      "int8_quantize_blocks_cuda",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols, Ptr q, Ptr scale,
         bool stochastic, uint64_t seed, uint64_t index_base, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        const auto opt = rounding_options<int8::Int8QuantOptions>(stochastic, seed, index_base, 0);
        int8::int8_quantize_blocks_cuda(as_ptr<const void>(x), dtype, rows, cols, block_rows, block_cols,
                                        as_ptr<int8_t>(q), as_ptr<float>(scale), opt, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("block_rows"),
      py::arg("block_cols"), py::arg("q_ptr"), py::arg("scale_ptr"), py::arg("stochastic") = false,
      py::arg("seed") = 0, py::arg("index_base") = 0, py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "int8_quantize_blocks on device pointers.");
  m.def(
      "int8_dequantize_blocks_cuda",
      [](Ptr q, Ptr scale, int64_t rows, int64_t cols, int32_t block_rows, int32_t block_cols, Ptr y, DType dtype,
         Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        int8::int8_dequantize_blocks_cuda(as_ptr<const int8_t>(q), as_ptr<const float>(scale), rows, cols, block_rows,
                                          block_cols, as_ptr<void>(y), dtype, as_ptr<void>(stream));
      },
      py::arg("q_ptr"), py::arg("scale_ptr"), py::arg("rows"), py::arg("cols"), py::arg("block_rows"),
      py::arg("block_cols"), py::arg("y_ptr"), py::arg("dtype"), py::arg("stream") = 0,
      py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(), "int8_dequantize_blocks on device pointers.");
  m.def(
      "int8_outlier_columns_cuda",
      [](Ptr x, DType dtype, int64_t rows, int64_t cols, float threshold, Ptr mask, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        int8::int8_outlier_columns_cuda(as_ptr<const void>(x), dtype, rows, cols, threshold, as_ptr<uint8_t>(mask),
                                        as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("threshold"), py::arg("mask_ptr"),
      py::arg("stream") = 0, py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "int8_outlier_columns on device pointers: writes the mask only (count it on the device, mask.sum()).");
  m.def(
      "int8_dequantize_matmul_cuda",
      [](Ptr acc, int64_t rows, int64_t cols, Ptr row_scale, int64_t row_group, int64_t row_stride, Ptr col_scale,
         int64_t col_group, int64_t col_stride, Ptr add, Ptr bias, Ptr out, DType out_dtype, bool accumulate,
         Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        int8::EpilogueArgs a;
        a.acc = as_ptr<const int32_t>(acc);
        a.rows = rows;
        a.cols = cols;
        a.row_scale = as_ptr<const float>(row_scale);
        a.row_group = row_group;
        a.row_stride = row_stride;
        a.col_scale = as_ptr<const float>(col_scale);
        a.col_group = col_group;
        a.col_stride = col_stride;
        a.add = as_ptr<const float>(add);
        a.bias = as_ptr<const float>(bias);
        a.out = as_ptr<void>(out);
        a.out_dtype = out_dtype;
        a.accumulate = accumulate;
        int8::int8_dequantize_matmul_cuda(a, as_ptr<void>(stream));
      },
      py::arg("acc_ptr"), py::arg("rows"), py::arg("cols"), py::arg("row_scale_ptr"), py::arg("row_group") = 1,
      py::arg("row_stride") = 1, py::arg("col_scale_ptr") = 0, py::arg("col_group") = 1, py::arg("col_stride") = 1,
      py::arg("add_ptr") = 0, py::arg("bias_ptr") = 0, py::arg("out_ptr") = 0, py::arg("out_dtype") = DType::f32,
      py::arg("accumulate") = false, py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "int8_dequantize_matmul on device pointers.");
  m.def(
      "int8_gemm_cuda",
      [](Ptr a, Ptr b, Ptr c, int64_t m, int64_t n, int64_t k, bool b_trans, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        int8::int8_gemm_cuda(as_ptr<const int8_t>(a), as_ptr<const int8_t>(b), as_ptr<int32_t>(c), m, n, k, b_trans,
                             as_ptr<void>(stream));
      },
      py::arg("a_ptr"), py::arg("b_ptr"), py::arg("c_ptr"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("b_trans") = true, py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "int8_gemm on device pointers through cuBLASLt: b_trans = true only, k and n multiples of 4, 4-byte aligned "
      "operands (cuBLASLt's int8 kernels); anything else raises naming the argument.");
  m.def(
      "int8_block_matmul_cuda",
      [](Ptr a, Ptr a_scale, bool a_trans, Ptr b, Ptr b_scale, bool b_trans, int64_t m, int64_t n, int64_t k,
         int32_t block, Ptr bias, Ptr out, DType out_dtype, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        int8::BlockGemmArgs g;
        g.a = as_ptr<const int8_t>(a);
        g.a_scale = as_ptr<const float>(a_scale);
        g.a_trans = a_trans;
        g.b = as_ptr<const int8_t>(b);
        g.b_scale = as_ptr<const float>(b_scale);
        g.b_trans = b_trans;
        g.m = m;
        g.n = n;
        g.k = k;
        g.block = block;
        g.bias = as_ptr<const float>(bias);
        g.out = as_ptr<void>(out);
        g.out_dtype = out_dtype;
        int8::int8_block_matmul_cuda(g, as_ptr<void>(stream));
      },
      py::arg("a_ptr"), py::arg("a_scale_ptr"), py::arg("a_trans"), py::arg("b_ptr"), py::arg("b_scale_ptr"),
      py::arg("b_trans"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("block"), py::arg("bias_ptr") = 0,
      py::arg("out_ptr") = 0, py::arg("out_dtype") = DType::f32, py::arg("stream") = 0,
      py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(), "int8_block_matmul on device pointers: the same bits.");
}

}  // namespace zero8::bindings
