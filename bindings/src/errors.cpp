// zero8::Error -> Python: one exception class per ErrorCode, each also a subclass of the builtin
// exception Python code already catches for that kind of failure (ValueError, NotImplementedError,
// OSError, RuntimeError), all under zero8.Zero8Error. The instance carries .code (the ErrorCode name).
#include <exception>

#include "bind.h"
#include "zero8/error.h"

namespace zero8::bindings {
namespace {

constexpr int kNumCodes = 5;
// Created once at import and never freed: exception classes must outlive every translator call, and
// Python may still raise them during interpreter shutdown.
PyObject* g_base = nullptr;
PyObject* g_classes[kNumCodes] = {};

const char* code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::io: return "io";
    case ErrorCode::comm: return "comm";
    case ErrorCode::internal: return "internal";
  }
  return "internal";
}

PyObject* new_class(const char* name, const char* doc, PyObject* builtin) {
  PyObject* bases = builtin ? PyTuple_Pack(2, g_base, builtin) : PyTuple_Pack(1, PyExc_Exception);
  if (!bases) throw py::error_already_set();
  PyObject* cls = PyErr_NewExceptionWithDoc(name, doc, bases, nullptr);
  Py_DECREF(bases);
  if (!cls) throw py::error_already_set();
  return cls;
}

void raise_error(const Error& e) {
  const int i = int(e.code());
  PyObject* cls = g_classes[(i >= 0 && i < kNumCodes) ? i : int(ErrorCode::internal)];
  // Build the instance ourselves so it can carry the code (PyErr_SetString would not).
  PyObject* inst = PyObject_CallFunction(cls, "s", e.what());
  if (!inst) return;  // the constructor's own error is set
  PyObject* code = PyUnicode_FromString(code_name(e.code()));
  if (code) {
    PyObject_SetAttrString(inst, "code", code);
    Py_DECREF(code);
  }
  PyErr_SetObject(cls, inst);
  Py_DECREF(inst);
}

}  // namespace

Error error_from_python(const py::error_already_set& e) {
  for (int i = 0; i < kNumCodes; ++i)
    if (g_classes[i] != nullptr && e.matches(py::handle(g_classes[i])))
      return Error(ErrorCode(i), py::str(e.value()).cast<std::string>());
  ErrorCode code = ErrorCode::internal;
  if (e.matches(PyExc_ValueError) || e.matches(PyExc_KeyError) || e.matches(PyExc_TypeError)) {
    code = ErrorCode::invalid_argument;
  } else if (e.matches(PyExc_OSError)) {
    code = ErrorCode::io;
  } else if (e.matches(PyExc_NotImplementedError)) {
    code = ErrorCode::unsupported;
  }
  const std::string type = py::str(e.type().attr("__name__")).cast<std::string>();
  return Error(code, type + ": " + py::str(e.value()).cast<std::string>());
}

void init_errors(py::module_& m) {
  g_base = new_class("zero8.Zero8Error", "Base class of every error zero8's C++ library raises (see .code).", nullptr);
  g_classes[int(ErrorCode::invalid_argument)] =
      new_class("zero8.Zero8ValueError", "A bad value passed to a zero8 call (ErrorCode invalid_argument).",
                PyExc_ValueError);
  g_classes[int(ErrorCode::unsupported)] =
      new_class("zero8.Zero8NotSupportedError",
                "A valid request this build or machine cannot do, e.g. no CUDA (ErrorCode unsupported).",
                PyExc_NotImplementedError);
  g_classes[int(ErrorCode::io)] =
      new_class("zero8.Zero8IOError", "A file system or file format error (ErrorCode io).", PyExc_OSError);
  g_classes[int(ErrorCode::comm)] =
      new_class("zero8.Zero8CommError",
                "A collective failed: a peer died, a timeout passed, a transport error (ErrorCode comm). "
                "The process should exit non-zero afterwards.",
                PyExc_RuntimeError);
  g_classes[int(ErrorCode::internal)] =
      new_class("zero8.Zero8InternalError", "A broken invariant inside zero8: a bug (ErrorCode internal).",
                PyExc_RuntimeError);

  // The class knows its code too, so errors raised from Python (zero8's own modules) have .code.
  for (int i = 0; i < kNumCodes; ++i) {
    PyObject* code = PyUnicode_FromString(code_name(ErrorCode(i)));
    if (!code || PyObject_SetAttrString(g_classes[i], "code", code) != 0) {
      Py_XDECREF(code);
      throw py::error_already_set();
    }
    Py_DECREF(code);
  }

  m.attr("Zero8Error") = py::handle(g_base);
  m.attr("Zero8ValueError") = py::handle(g_classes[int(ErrorCode::invalid_argument)]);
  m.attr("Zero8NotSupportedError") = py::handle(g_classes[int(ErrorCode::unsupported)]);
  m.attr("Zero8IOError") = py::handle(g_classes[int(ErrorCode::io)]);
  m.attr("Zero8CommError") = py::handle(g_classes[int(ErrorCode::comm)]);
  m.attr("Zero8InternalError") = py::handle(g_classes[int(ErrorCode::internal)]);

  // Registered after pybind11's defaults, so it runs first for zero8::Error (a std::runtime_error).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });

  // Test hook: throw a zero8::Error with the given code name, to check the mapping of every code.
  m.def(
      "_throw",
      [](const std::string& code, const std::string& message) {
        for (int i = 0; i < kNumCodes; ++i)
          if (code == code_name(ErrorCode(i))) throw Error(ErrorCode(i), message);
        ZERO8_CHECK_ARG(false, "code", "unknown error code '" << code << "'");
      },
      py::arg("code"), py::arg("message"), "Raise the zero8 error of ErrorCode `code` (for tests).");
}

}  // namespace zero8::bindings
