// Maps and the block-wise codec (zero8/quant.h) for zero8.functional: raw-pointer quantize/dequantize
// over a standard map or a custom 256-value code table, with the GIL released while they run, on host
// memory or (the *_cuda entries) on device memory queued on the caller's stream, and the general
// dynamic-map construction behind create_dynamic_map's non-default arguments.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "bind.h"
#include "zero8/error.h"
#include "zero8/quant.h"

namespace zero8::bindings {
namespace {

using quant::MapKind;
using quant::QuantTable;

// Tables of custom code tables, built once per distinct map (table_build sorts out the thresholds
// and the search accelerator: microseconds we do not want on every call). Bounded: a caller cycling
// through many maps just rebuilds; holders keep their table alive through the shared_ptr.
std::shared_ptr<const QuantTable> table_for_values(const std::vector<float>& values) {
  ZERO8_CHECK_ARG(values.size() == 256, "values", "a code table has 256 values, got " << values.size());
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const QuantTable>> cache;
  std::string key(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto t = std::make_shared<const QuantTable>(quant::table_build(values));
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 32) cache.clear();
  cache.emplace(std::move(key), t);
  return t;
}

}  // namespace

void init_codec(py::module_& m) {
  m.def("map_values", &quant::map_values, py::arg("kind"),
        "The 256 sorted float32 values of a standard map (dynamic maps: bit-identical to the reference table of bitsandbytes' construction; current bitsandbytes builds differ by <= 2 ulp in some entries).");
  m.def("map_kind_name", [](MapKind k) { return std::string(quant::map_kind_name(k)); }, py::arg("kind"));
  m.def("map_dynamic_values", &quant::map_dynamic_values, py::arg("signed") = true, py::arg("max_exponent_bits") = 7,
        py::arg("total_bits") = 8,
        "bitsandbytes' create_dynamic_map construction for any arguments (256 values, zero-padded, sorted).");
  m.def("quant_num_blocks", &quant::quant_num_blocks, py::arg("n"), py::arg("block"),
        "Number of blocks (= scales) for n elements: ceil(n / block).");
  m.def("quant_bytes", &quant::quant_bytes, py::arg("n"), py::arg("block"),
        "Bytes of the quantized form: n codes + 4 bytes per block.");

  m.def(
      "quantize_blockwise",
      [](Ptr x, DType dtype, int64_t n, int32_t block, MapKind kind, Ptr codes, Ptr absmax, bool stochastic,
         uint64_t seed, uint64_t index_base, int threads) {
        const auto opt = rounding_options<quant::QuantizeOptions>(stochastic, seed, index_base, threads);
        quant::quantize_blockwise(as_ptr<const void>(x), dtype, n, block, kind, as_ptr<uint8_t>(codes),
                                  as_ptr<float>(absmax), opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("kind"), py::arg("codes_ptr"),
      py::arg("absmax_ptr"), py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Quantize n elements at x_ptr (dtype) in blocks of `block`: n codes at codes_ptr, ceil(n/block) float32 "
      "signed scales at absmax_ptr. Releases the GIL.");
  m.def(
      "quantize_blockwise_values",
      [](Ptr x, DType dtype, int64_t n, int32_t block, const std::vector<float>& values, Ptr codes, Ptr absmax,
         bool stochastic, uint64_t seed, uint64_t index_base, int threads) {
        const auto table = table_for_values(values);
        const auto opt = rounding_options<quant::QuantizeOptions>(stochastic, seed, index_base, threads);
        quant::quantize_blockwise(as_ptr<const void>(x), dtype, n, block, *table, as_ptr<uint8_t>(codes),
                                  as_ptr<float>(absmax), opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("values"), py::arg("codes_ptr"),
      py::arg("absmax_ptr"), py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "quantize_blockwise over a custom map: `values` are 256 sorted floats in [-1, 1]. Releases the GIL.");
  m.def(
      "dequantize_blockwise",
      [](Ptr codes, Ptr absmax, int64_t n, int32_t block, MapKind kind, Ptr y, DType dtype, bool accumulate,
         int threads) {
        quant::dequantize_blockwise(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), n, block, kind,
                                    as_ptr<void>(y), dtype, accumulate, threads);
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("n"), py::arg("block"), py::arg("kind"), py::arg("y_ptr"),
      py::arg("dtype"), py::arg("accumulate") = false, py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "y = values[code] * absmax (y += ... with accumulate, float32 y only), written as dtype. Releases the GIL.");
  m.def(
      "dequantize_blockwise_values",
      [](Ptr codes, Ptr absmax, int64_t n, int32_t block, const std::vector<float>& values, Ptr y, DType dtype,
         bool accumulate, int threads) {
        const auto table = table_for_values(values);
        quant::dequantize_blockwise(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), n, block, *table,
                                    as_ptr<void>(y), dtype, accumulate, threads);
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("n"), py::arg("block"), py::arg("values"),
      py::arg("y_ptr"), py::arg("dtype"), py::arg("accumulate") = false, py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(), "dequantize_blockwise over a custom 256-value map. Releases the GIL.");

  m.def(
      "quantize_blockwise_rows",
      [](Ptr x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind kind, Ptr codes, Ptr absmax,
         int threads) {
        const auto opt = rounding_options<quant::QuantizeOptions>(false, 0, 0, threads);
        quant::quantize_blockwise_rows(as_ptr<const void>(x), dtype, rows, row, block, kind, as_ptr<uint8_t>(codes),
                                       as_ptr<float>(absmax), opt);
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("row"), py::arg("block"), py::arg("kind"),
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "quantize_blockwise of `rows` rows of `row` elements, each row blocked on its own (row r's scales from "
      "r * ceil(row / block) on). Releases the GIL.");
  m.def(
      "dequantize_blockwise_rows",
      [](Ptr codes, Ptr absmax, int64_t rows, int64_t row, int32_t block, MapKind kind, Ptr y, DType dtype, bool sum,
         bool accumulate, int threads) {
        quant::dequantize_blockwise_rows(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), rows, row, block,
                                         kind, as_ptr<void>(y), dtype, sum, accumulate, threads);
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("rows"), py::arg("row"), py::arg("block"), py::arg("kind"),
      py::arg("y_ptr"), py::arg("dtype"), py::arg("sum") = false, py::arg("accumulate") = false,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "The rows' decodes (rows x row values of dtype), or with sum the rows' float32 decodes added in row order "
      "into `row` values (after y with accumulate). Releases the GIL.");

  // CUDA: device pointers; the kernels are queued on `stream` (a cudaStream_t as an int: Python passes
  // torch.cuda.current_stream(device).cuda_stream) and the call returns without waiting. The current
  // device must be the tensors' (standard maps are uploaded once per device). A build without CUDA raises
  // Zero8NotSupportedError. pointers_checked: see POINTERS_CHECKED (bind.h).
  m.def("quant_table_bytes",
        [](const std::vector<float>& values) {
          const auto table = table_for_values(values);
          return py::bytes(reinterpret_cast<const char*>(table.get()), sizeof(QuantTable));
        },
        py::arg("values"),
        "The codec's table of a custom 256-value map, as bytes: copied to device memory (64-byte aligned), it is "
        "the table_ptr of the *_table_cuda entries.");
  m.def(
      "quantize_blockwise_cuda",
      [](Ptr x, DType dtype, int64_t n, int32_t block, MapKind kind, Ptr codes, Ptr absmax, bool stochastic,
         uint64_t seed, uint64_t index_base, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        const auto opt = rounding_options<quant::QuantizeOptions>(stochastic, seed, index_base, 0);
        quant::quantize_blockwise_cuda(as_ptr<const void>(x), dtype, n, block, kind, as_ptr<uint8_t>(codes),
                                       as_ptr<float>(absmax), opt, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("kind"), py::arg("codes_ptr"),
      py::arg("absmax_ptr"), py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("stream") = 0, py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "quantize_blockwise on device pointers, queued on `stream`: the same codes and scales as the CPU.");
  m.def(
      "quantize_blockwise_table_cuda",
      [](Ptr x, DType dtype, int64_t n, int32_t block, Ptr table, Ptr codes, Ptr absmax, bool stochastic,
         uint64_t seed, uint64_t index_base, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        const auto opt = rounding_options<quant::QuantizeOptions>(stochastic, seed, index_base, 0);
        quant::quantize_blockwise_cuda(as_ptr<const void>(x), dtype, n, block, as_ptr<const QuantTable>(table),
                                       as_ptr<uint8_t>(codes), as_ptr<float>(absmax), opt, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("table_ptr"), py::arg("codes_ptr"),
      py::arg("absmax_ptr"), py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index_base") = 0,
      py::arg("stream") = 0, py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "quantize_blockwise_cuda over a custom map: table_ptr is device memory holding quant_table_bytes(values).");
  m.def(
      "dequantize_blockwise_cuda",
      [](Ptr codes, Ptr absmax, int64_t n, int32_t block, MapKind kind, Ptr y, DType dtype, bool accumulate,
         Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        quant::dequantize_blockwise_cuda(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), n, block, kind,
                                         as_ptr<void>(y), dtype, accumulate, as_ptr<void>(stream));
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("n"), py::arg("block"), py::arg("kind"), py::arg("y_ptr"),
      py::arg("dtype"), py::arg("accumulate") = false, py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "dequantize_blockwise on device pointers, queued on `stream`.");
  m.def(
      "dequantize_blockwise_table_cuda",
      [](Ptr codes, Ptr absmax, int64_t n, int32_t block, Ptr table, Ptr y, DType dtype, bool accumulate, Ptr stream,
         bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        quant::dequantize_blockwise_cuda(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), n, block,
                                         as_ptr<const QuantTable>(table), as_ptr<void>(y), dtype, accumulate,
                                         as_ptr<void>(stream));
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("n"), py::arg("block"), py::arg("table_ptr"),
      py::arg("y_ptr"), py::arg("dtype"), py::arg("accumulate") = false, py::arg("stream") = 0,
      py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(), "dequantize_blockwise_cuda over a custom map (see quant_table_bytes).");
  m.def(
      "quantize_blockwise_rows_cuda",
      [](Ptr x, DType dtype, int64_t rows, int64_t row, int32_t block, MapKind kind, Ptr codes, Ptr absmax,
         Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        quant::quantize_blockwise_rows_cuda(as_ptr<const void>(x), dtype, rows, row, block, kind,
                                            as_ptr<uint8_t>(codes), as_ptr<float>(absmax), {}, as_ptr<void>(stream));
      },
      py::arg("x_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("row"), py::arg("block"), py::arg("kind"),
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("stream") = 0,
      py::arg("pointers_checked") = false, py::call_guard<py::gil_scoped_release>(),
      "quantize_blockwise_rows on device pointers, one launch queued on `stream`.");
  m.def(
      "dequantize_blockwise_rows_cuda",
      [](Ptr codes, Ptr absmax, int64_t rows, int64_t row, int32_t block, MapKind kind, Ptr y, DType dtype, bool sum,
         bool accumulate, Ptr stream, bool pointers_checked) {
        const device::VouchedPointers vouched(pointers_checked);
        quant::dequantize_blockwise_rows_cuda(as_ptr<const uint8_t>(codes), as_ptr<const float>(absmax), rows, row,
                                              block, kind, as_ptr<void>(y), dtype, sum, accumulate,
                                              as_ptr<void>(stream));
      },
      py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("rows"), py::arg("row"), py::arg("block"), py::arg("kind"),
      py::arg("y_ptr"), py::arg("dtype"), py::arg("sum") = false, py::arg("accumulate") = false, py::arg("stream") = 0,
      py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(), "dequantize_blockwise_rows on device pointers, one launch queued on "
      "`stream`.");
}

}  // namespace zero8::bindings
