// zero8._C entry point: build information, CPU dispatch, the enums every area shares (DType, MapKind,
// Isa), zero-copy buffer views, and the calls into each area's init_<area>. The Python package
// (bindings/python/zero8) is the public surface; this module is its raw-pointer layer.
#include <pybind11/pybind11.h>

#include <string>

#include "bind.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/quant_map.h"
#include "zero8/version.h"

namespace zero8::bindings {
namespace {

// The exporter behind buffer_view's memoryviews: holds the owner of the memory.
struct BufferRef {
  py::object owner;
  void* data = nullptr;
  int64_t bytes = 0;
  bool readonly = false;
};

}  // namespace

py::memoryview buffer_view(py::object owner, void* data, int64_t bytes, bool readonly) {
  // An empty std::vector has no storage; a memoryview still needs a non-null address.
  static unsigned char empty = 0;
  if (data == nullptr) data = &empty;
  py::object ref = py::cast(BufferRef{std::move(owner), data, bytes, readonly});
  return py::memoryview(py::reinterpret_borrow<py::buffer>(ref));
}

std::string repr_fields(py::handle obj, const char* type_name, std::initializer_list<const char*> fields) {
  std::string s = std::string("zero8._C.") + type_name + "(";
  bool first = true;
  for (const char* f : fields) {
    if (!first) s += ", ";
    first = false;
    s += f;
    s += "=";
    s += py::repr(obj.attr(f)).cast<std::string>();
  }
  return s + ")";
}

}  // namespace zero8::bindings

namespace zb = zero8::bindings;

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "zero8._C: raw-pointer bindings of the zero8 C++ library (8-bit block-wise optimizers, ZeRO "
      "sharding, int8 communication). Use the zero8 package; tensors cross this layer as "
      "tensor.data_ptr() ints plus DType codes (see zero8/_tensors.py).";

  py::class_<zb::BufferRef>(m, "_BufferRef", py::buffer_protocol(),
                            "Exporter of a zero-copy view of C++-owned memory (keeps its owner alive).")
      .def_buffer([](zb::BufferRef& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(b.bytes)},
                               {py::ssize_t(1)}, b.readonly);
      })
      .def_readonly("owner", &zb::BufferRef::owner, "The object whose memory this is.");

  py::enum_<zero8::DType>(m, "DType", "Element type of a tensor crossing the kernel boundary.")
      .value("f32", zero8::DType::f32)
      .value("bf16", zero8::DType::bf16)
      .value("f16", zero8::DType::f16);
  py::enum_<zero8::quant::MapKind>(m, "MapKind", "The standard 8-bit quantization maps.")
      .value("dynamic_signed", zero8::quant::MapKind::dynamic_signed)
      .value("dynamic_unsigned", zero8::quant::MapKind::dynamic_unsigned)
      .value("linear_signed", zero8::quant::MapKind::linear_signed)
      .value("linear_unsigned", zero8::quant::MapKind::linear_unsigned);
  py::enum_<zero8::Isa>(m, "Isa", "CPU instruction set variants of the kernels.")
      .value("scalar", zero8::Isa::scalar)
      .value("avx2", zero8::Isa::avx2)
      .value("avx512", zero8::Isa::avx512);

  m.def("version", [] { return std::string(zero8::version()); }, "zero8 version of this build.");
  m.def(
      "build_info",
      [] {
        const zero8::BuildInfo b = zero8::build_info();
        py::dict d;
        d["cuda"] = b.cuda;
        d["nccl"] = b.nccl;
        d["mpi"] = b.mpi;
        d["x86_simd"] = b.x86_simd;
        return d;
      },
      "What this build contains: dict(cuda, nccl, mpi, x86_simd) of bools.");
  m.def("isa_active", &zero8::isa_active, "The CPU variant the kernels run (ZERO8_ISA forces one).");
  m.def("isa_supported", &zero8::isa_supported, py::arg("isa"), "Whether this CPU and build can run `isa`.");
  m.def("isa_best", &zero8::isa_best, "The best supported CPU variant, ignoring ZERO8_ISA.");
  m.def(
      "cuda_quant_kernels", [] { return zero8::cuda_quant_kernels_name(zero8::cuda_quant_kernels()); },
      "The form of the CUDA 8-bit kernels, 'block' or 'warp' (ZERO8_CUDA_QUANT_KERNELS sets it at the start).");
  m.def(
      "set_cuda_quant_kernels",
      [](const std::string& name) {
        zero8::set_cuda_quant_kernels(zero8::cuda_quant_kernels_parse(name.c_str(), "set_cuda_quant_kernels: name"));
      },
      py::arg("name"),
      "Sets the form of the CUDA 8-bit kernels for this process, 'block' or 'warp': for benchmarks that time "
      "both (they give the same bits).");

  zb::init_errors(m);
  zb::init_codec(m);
  zb::init_optim(m);
  zb::init_algos(m);
  zb::init_comm(m);
  zb::init_config(m);
  zb::init_sharded(m);
  zb::init_checkpoint(m);
  zb::init_int8(m);
}
