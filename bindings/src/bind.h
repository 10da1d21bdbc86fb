// Shared pieces of the zero8._C binding files: the per-area init functions, raw-pointer arguments
// (Python passes tensor.data_ptr() as an int), zero-copy buffer views of C++-owned memory, and the
// keyword constructor used by the plain-struct classes.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "zero8/error.h"
#include "zero8/kernels/device.h"

namespace py = pybind11;

namespace zero8::bindings {

// One per binding file (module.cpp calls them in this order: enums first, their users after).
void init_errors(py::module_& m);
void init_codec(py::module_& m);
void init_optim(py::module_& m);
void init_algos(py::module_& m);
void init_comm(py::module_& m);
void init_config(py::module_& m);
void init_sharded(py::module_& m);
void init_checkpoint(py::module_& m);
void init_int8(py::module_& m);

// A Python exception raised in a callback C++ called, as the zero8::Error of the same kind (a Zero8*
// error keeps its code; ValueError/KeyError/TypeError -> invalid_argument, OSError -> io,
// NotImplementedError -> unsupported, anything else -> internal). Call with the GIL held.
Error error_from_python(const py::error_already_set& e);

// A pointer argument: Python passes an address as a non-negative int (0 for none).
using Ptr = std::uintptr_t;

// POINTERS_CHECKED: every *_cuda entry takes pointers_checked (default false). True: the caller vouches that
// each pointer is device memory of the current device (zero8's Python side passes it for the data of CUDA
// tensors it has checked), so the entry makes no per-pointer query (device::VouchedPointers); the other
// argument checks still run.
template <class T> T* as_ptr(Ptr p) { return reinterpret_cast<T*>(p); }

// A writable memoryview of `bytes` bytes at `data` (format "B") that keeps `owner` alive for as long
// as the view, or anything made from it (torch.frombuffer), exists. The memory must stay where it is
// for the owner's lifetime (the sharded optimizer never reallocates its buffers).
py::memoryview buffer_view(py::object owner, void* data, int64_t bytes, bool readonly = false);

// __init__(**kwargs) for a default-constructible bound struct: start from the C++ defaults, then
// set each keyword as an attribute (an unknown name raises AttributeError naming it).
template <class T> T from_kwargs(const py::kwargs& kw) {
  py::object obj = py::cast(T{});
  for (auto item : kw) py::setattr(obj, item.first, item.second);
  return obj.cast<T>();
}

// The rounding options of the codec (quant::QuantizeOptions) and of the int8 quantizers
// (int8::Int8QuantOptions), which share these four fields, from the Python keyword arguments.
template <class Options> Options rounding_options(bool stochastic, uint64_t seed, uint64_t index_base, int threads) {
  Options o;
  o.stochastic = stochastic;
  o.seed = seed;
  o.index_base = index_base;
  o.threads = threads;
  return o;
}

// "name=value, ..." of the listed attributes, for __repr__.
std::string repr_fields(py::handle obj, const char* type_name, std::initializer_list<const char*> fields);

}  // namespace zero8::bindings
