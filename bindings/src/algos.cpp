// The optimizer-algorithm table (zero8/kernels/optim_table.h) for the Python package: zero8.optim builds its
// classes, argument checks and state-dict names from it, and the engine translates client optimizers and
// param groups with it (zero8/optim/_algos.py). Read-only views of the static rows.
#include "bind.h"
#include "zero8/kernels/optim.h"

namespace zero8::bindings {
namespace {

using optim::AlgoSpec;
using optim::HyperSpec;

py::object str_or_none(const char* s) { return s ? py::object(py::str(s)) : py::object(py::none()); }

const char* role_name(optim::HyperRole r) {
  switch (r) {
    case optim::HyperRole::value: return "value";
    case optim::HyperRole::init: return "init";
    case optim::HyperRole::decouple: return "decouple";
    case optim::HyperRole::fixed: return "fixed";
    case optim::HyperRole::ignored: return "ignored";
    case optim::HyperRole::bnb_const: return "bnb_const";
  }
  return "";
}

const char* py_arg_name(optim::PyArg a) {
  switch (a) {
    case optim::PyArg::none: return "none";
    case optim::PyArg::positional: return "positional";
    case optim::PyArg::keyword: return "keyword";
    case optim::PyArg::keyword_last: return "keyword_last";
  }
  return "";
}

// A default as Python sees it: a bool for flags.
py::object typed(const HyperSpec& e, double v) {
  if (e.type == optim::HyperType::flag) return py::bool_(v != 0.0);
  return py::float_(v);
}

}  // namespace

void init_algos(py::module_& m) {
  py::class_<HyperSpec>(m, "HyperSpec",
                        "One argument of an algorithm in the table: its key in zero8 (zero8.optim, engine param "
                        "groups), DeepSpeed configs, torch.optim and bitsandbytes (None: that library has none; "
                        "'betas[1]': element 1 of betas), its role, the Hyper field it goes to, its defaults and "
                        "valid range.")
      .def_property_readonly("key", [](const HyperSpec& e) { return std::string(e.key); })
      .def_property_readonly("deepspeed", [](const HyperSpec& e) { return str_or_none(e.deepspeed); })
      .def_property_readonly("torch", [](const HyperSpec& e) { return str_or_none(e.torch); })
      .def_property_readonly("bnb", [](const HyperSpec& e) { return str_or_none(e.bnb); })
      .def_property_readonly("role", [](const HyperSpec& e) { return std::string(role_name(e.role)); },
                             "value, init, decouple, fixed, ignored or bnb_const (optim_table.h, HyperRole)")
      .def_property_readonly(
          "field",
          [](const HyperSpec& e) {
            return e.field == optim::HyperField::none ? py::object(py::none())
                                                      : py::object(py::str(optim::hyper_field_name(e.field)));
          },
          "the Hyper attribute the value goes to, or None")
      .def_property_readonly("is_flag", [](const HyperSpec& e) { return e.type == optim::HyperType::flag; })
      .def_property_readonly("ds_default", [](const HyperSpec& e) { return typed(e, e.ds_default); })
      .def_property_readonly("torch_default", [](const HyperSpec& e) { return typed(e, e.torch_default); })
      .def_property_readonly("py_default", [](const HyperSpec& e) { return typed(e, e.py_default); })
      .def_property_readonly(
          "range", [](const HyperSpec& e) { return py::make_tuple(e.range.lo, e.range.hi, e.range.lo_open, e.range.hi_open); },
          "(lo, hi, lo_open, hi_open) of a real entry")
      .def_property_readonly("zero_off", [](const HyperSpec& e) { return e.range.zero_off; },
                             "0 turns the feature off (a config, in DeepSpeed's terms, needs > 0)")
      .def_property_readonly("py_arg", [](const HyperSpec& e) { return std::string(py_arg_name(e.py)); },
                             "none, positional, keyword (after min_8bit_size) or keyword_last (after block_size)")
      .def_property_readonly("why", [](const HyperSpec& e) { return str_or_none(e.why); })
      .def("__repr__", [](const HyperSpec& e) {
        return std::string("zero8._C.HyperSpec(") + e.key + ", " + role_name(e.role) + ")";
      });

  py::class_<AlgoSpec>(m, "AlgoSpec",
                       "One row of the optimizer-algorithm table: names (canonical, class, DeepSpeed type, "
                       "torch.optim class, bitsandbytes classes), states, trust ratio and hyperparameters.")
      .def_property_readonly("algo", [](const AlgoSpec& r) { return r.algo; })
      .def_property_readonly("name", [](const AlgoSpec& r) { return std::string(r.name); })
      .def_property_readonly("class_name", [](const AlgoSpec& r) { return std::string(r.class_name); })
      .def_property_readonly("deepspeed", [](const AlgoSpec& r) { return str_or_none(r.deepspeed); })
      .def_property_readonly("torch", [](const AlgoSpec& r) { return str_or_none(r.torch); })
      .def_property_readonly("bnb",
                             [](const AlgoSpec& r) {
                               py::list l;
                               for (const char* n : r.bnb)
                                 if (n) l.append(py::str(n));
                               return py::tuple(l);
                             })
      .def_property_readonly("decoupled", [](const AlgoSpec& r) { return r.decoupled; },
                             "the algorithm a true decouple entry selects (itself when none)")
      .def_property_readonly("loads_from", [](const AlgoSpec& r) { return r.loads_from; },
                             "another algorithm whose state dicts this one continues (itself when none)")
      .def_property_readonly("num_states", [](const AlgoSpec& r) { return r.num_states; })
      .def_property_readonly("state_maps",
                             [](const AlgoSpec& r) {
                               py::list l;
                               for (int i = 0; i < r.num_states; ++i) l.append(r.state_map[i]);
                               return py::tuple(l);
                             })
      .def_property_readonly("torch_states",
                             [](const AlgoSpec& r) {
                               py::list l;
                               for (int i = 0; i < r.num_states; ++i) l.append(str_or_none(r.torch_state[i]));
                               return py::tuple(l);
                             })
      .def_property_readonly("trust_ratio", [](const AlgoSpec& r) { return r.trust_ratio; })
      .def_property_readonly("torch_flags", [](const AlgoSpec& r) { return r.torch_flags; })
      .def_property_readonly(
          "hyper",
          [](const AlgoSpec& r) {
            py::list l;
            for (int i = 0; i < r.num_hyper; ++i)
              l.append(py::cast(&r.hyper[i], py::return_value_policy::reference));
            return py::tuple(l);
          },
          "the HyperSpec entries, in zero8.optim's argument order")
      .def("__repr__", [](const AlgoSpec& r) { return std::string("zero8._C.AlgoSpec(") + r.name + ")"; });

  m.def(
      "algo_table",
      [] {
        py::list l;
        for (const AlgoSpec& r : optim::kAlgos) l.append(py::cast(&r, py::return_value_policy::reference));
        return py::tuple(l);
      },
      "The rows of the optimizer-algorithm table, in Algo order.");
  m.def(
      "algo_spec",
      [](optim::Algo a) -> const AlgoSpec& {
        ZERO8_CHECK_ARG(optim::algo_valid(a), "algo", "unknown algorithm " << int(a));
        return optim::algo_spec(a);
      },
      py::arg("algo"), py::return_value_policy::reference, "The table row of one algorithm.");
}

}  // namespace zero8::bindings
