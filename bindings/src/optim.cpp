// The fused optimizer kernels (zero8/optim.h) for zero8.optim: Hyper, a StepArgs whose pointers are
// ints (tensor.data_ptr()) and whose maps are MapKinds looked up here, and the validated step entries,
// each releasing the GIL. step_tensor runs both phases of LAMB/LARS as zero8::optim::step does;
// step_tensor_cuda the same on device memory, queued on the caller's stream.
#include <optional>
#include <vector>

#include "bind.h"
#include "zero8/error.h"
#include "zero8/optim.h"
#include "zero8/quant.h"

namespace zero8::bindings {
namespace {

using optim::Algo;
using optim::Hyper;
using optim::NormSums;
using quant::MapKind;

// optim::StepArgs as Python sees it. The segment vectors live here, so the raw struct made by raw()
// points into this object (which must outlive the call: it does, the call holds a reference).
struct PyStepArgs {
  Algo algo = Algo::adamw;
  Hyper h;
  int64_t n = 0;
  Ptr param = 0;
  DType param_dtype = DType::f32;
  Ptr master = 0;
  Ptr grad = 0;
  DType grad_dtype = DType::f32;
  int bits = 8;
  int32_t block = 256;
  Ptr code1 = 0, absmax1 = 0;
  MapKind map1 = MapKind::dynamic_signed;
  Ptr code2 = 0, absmax2 = 0;
  MapKind map2 = MapKind::dynamic_unsigned;
  Ptr state1 = 0, state2 = 0;
  std::vector<int64_t> seg_offsets;  // nseg + 1 entries (0 ... n), or empty: one segment
  std::vector<float> seg_trust;      // nseg entries (1 when seg_offsets is empty), or empty: none

  optim::StepArgs raw() const {
    optim::StepArgs a;
    a.algo = algo;
    a.h = h;
    a.n = n;
    a.param = as_ptr<void>(param);
    a.param_dtype = param_dtype;
    a.master = as_ptr<float>(master);
    a.grad = as_ptr<const void>(grad);
    a.grad_dtype = grad_dtype;
    a.bits = bits;
    a.block = block;
    a.code1 = as_ptr<uint8_t>(code1);
    a.absmax1 = as_ptr<float>(absmax1);
    a.map1 = &quant::table_get(map1);
    a.code2 = as_ptr<uint8_t>(code2);
    a.absmax2 = as_ptr<float>(absmax2);
    a.map2 = &quant::table_get(map2);
    a.state1 = as_ptr<float>(state1);
    a.state2 = as_ptr<float>(state2);
    a.nseg = seg_offsets.empty() ? 0 : int64_t(seg_offsets.size()) - 1;
    a.seg_offsets = seg_offsets.empty() ? nullptr : seg_offsets.data();
    a.seg_trust = seg_trust.empty() ? nullptr : seg_trust.data();
    return a;
  }

  void set_segments(const std::vector<int64_t>& offsets, const std::optional<std::vector<float>>& trust) {
    ZERO8_CHECK_ARG(offsets.empty() || offsets.size() >= 2, "offsets",
                    "needs nseg + 1 >= 2 entries (0, ..., n) or none, got " << offsets.size());
    const size_t nt = offsets.empty() ? 1 : offsets.size() - 1;
    if (trust) {
      ZERO8_CHECK_ARG(trust->size() == nt, "trust",
                      "needs one ratio per segment (" << nt << "), got " << trust->size());
    }
    seg_offsets = offsets;
    seg_trust = trust ? *trust : std::vector<float>{};
  }
};

std::vector<NormSums> norms(const optim::StepArgs& a, int threads) {
  std::vector<NormSums> out(size_t(a.nseg > 0 ? a.nseg : 1));
  optim::norms_range(a, out.data(), threads);
  return out;
}

Algo valid_algo(Algo a) {
  ZERO8_CHECK_ARG(optim::algo_valid(a), "algo", "unknown algorithm " << int(a));
  return a;
}

py::list norms_list(const std::vector<NormSums>& s) {
  py::list l;
  for (const NormSums& x : s) l.append(py::make_tuple(x.w_sq, x.u_sq));
  return l;
}

}  // namespace

void init_optim(py::module_& m) {
  py::enum_<Algo> algo(m, "Algo", "Optimizer algorithms of the fused kernels (the rows of algo_table()).");
  for (const optim::AlgoSpec& r : optim::kAlgos) algo.value(r.name, r.algo);

  py::class_<Hyper>(m, "Hyper",
                    "Hyperparameters of one step (torch.optim names; unused ones are ignored by an algorithm). "
                    "Hyper(**fields) starts from the C++ defaults.")
      .def(py::init<>())
      .def(py::init(&from_kwargs<Hyper>))
      .def_readwrite("lr", &Hyper::lr)
      .def_readwrite("beta1", &Hyper::beta1, "adam/adamw/lamb/lion beta1; sgd/lars momentum")
      .def_readwrite("beta2", &Hyper::beta2, "adam/adamw/lamb/lion beta2; rmsprop alpha")
      .def_readwrite("eps", &Hyper::eps)
      .def_readwrite("weight_decay", &Hyper::weight_decay,
                     "decoupled for adamw, lion, lamb; L2 (added to the gradient) otherwise")
      .def_readwrite("dampening", &Hyper::dampening)
      .def_readwrite("nesterov", &Hyper::nesterov)
      .def_readwrite("bias_correction", &Hyper::bias_correction)
      .def_readwrite("lr_decay", &Hyper::lr_decay)
      .def_readwrite("initial_accumulator", &Hyper::initial_accumulator)
      .def_readwrite("trust_coefficient", &Hyper::trust_coefficient)
      .def_readwrite("max_trust_ratio", &Hyper::max_trust_ratio)
      .def_readwrite("min_trust_ratio", &Hyper::min_trust_ratio, "lower clip of the trust ratio (0: none)")
      .def_readwrite("step", &Hyper::step, "1-based number of this step (after increment), for bias correction")
      .def_readwrite("grad_scale", &Hyper::grad_scale, "the gradient is multiplied by this first")
      .def("__copy__", [](const Hyper& h) { return h; })
      .def("__deepcopy__", [](const Hyper& h, py::dict) { return h; }, py::arg("memo"))
      .def("__repr__", [](py::handle self) {
        return repr_fields(self, "Hyper",
                           {"lr", "beta1", "beta2", "eps", "weight_decay", "dampening", "nesterov", "bias_correction",
                            "lr_decay", "initial_accumulator", "trust_coefficient", "max_trust_ratio", "min_trust_ratio", "step",
                            "grad_scale"});
      });

  py::class_<PyStepArgs>(m, "StepArgs",
                         "Arguments of one fused step over a contiguous range. Pointers are ints (tensor.data_ptr(), "
                         "0 for none); map1/map2 name standard maps. StepArgs(**fields) starts from the defaults.")
      .def(py::init<>())
      .def(py::init(&from_kwargs<PyStepArgs>))
      .def_readwrite("algo", &PyStepArgs::algo)
      .def_readwrite("h", &PyStepArgs::h)
      .def_readwrite("n", &PyStepArgs::n)
      .def_readwrite("param", &PyStepArgs::param, "n elements of param_dtype (written)")
      .def_readwrite("param_dtype", &PyStepArgs::param_dtype)
      .def_readwrite("master", &PyStepArgs::master, "fp32 master: required for a 16-bit param, else 0")
      .def_readwrite("grad", &PyStepArgs::grad)
      .def_readwrite("grad_dtype", &PyStepArgs::grad_dtype)
      .def_readwrite("bits", &PyStepArgs::bits, "8: codes + block scales; 32: fp32 states")
      .def_readwrite("block", &PyStepArgs::block, "state block (8-bit)")
      .def_readwrite("code1", &PyStepArgs::code1)
      .def_readwrite("absmax1", &PyStepArgs::absmax1)
      .def_readwrite("map1", &PyStepArgs::map1)
      .def_readwrite("code2", &PyStepArgs::code2)
      .def_readwrite("absmax2", &PyStepArgs::absmax2)
      .def_readwrite("map2", &PyStepArgs::map2)
      .def_readwrite("state1", &PyStepArgs::state1, "32-bit state 1")
      .def_readwrite("state2", &PyStepArgs::state2, "32-bit state 2")
      .def("set_segments", &PyStepArgs::set_segments, py::arg("offsets"), py::arg("trust") = py::none(),
           "Split the range into tensors: offsets = [0, ..., n] (nseg + 1 entries; [] for one segment) and, for "
           "step_range of LAMB/LARS, one trust ratio per segment (1 entry when offsets is []).")
      .def("clear_segments", [](PyStepArgs& a) { a.set_segments({}, std::nullopt); })
      .def_property_readonly("seg_offsets", [](const PyStepArgs& a) { return a.seg_offsets; })
      .def_property_readonly("seg_trust", [](const PyStepArgs& a) { return a.seg_trust; })
      .def("__copy__", [](const PyStepArgs& a) { return a; })
      .def("__repr__", [](py::handle self) {
        return repr_fields(self, "StepArgs",
                           {"algo", "n", "param", "param_dtype", "master", "grad", "grad_dtype", "bits", "block",
                            "seg_offsets", "seg_trust"});
      });

  m.def(
      "step_range", [](const PyStepArgs& args, int threads) { optim::step_range(args.raw(), threads); },
      py::arg("args"), py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "The fused step over args' range (phase 2 of LAMB/LARS: needs the segment trust ratios). Validated; "
      "releases the GIL. threads = 0: OpenMP default.");
  m.def(
      "norms_range",
      [](const PyStepArgs& args, int threads) {
        std::vector<NormSums> s;
        {
          py::gil_scoped_release release;
          s = norms(args.raw(), threads);
        }
        return norms_list(s);
      },
      py::arg("args"), py::arg("threads") = 0,
      "Phase 1 of LAMB/LARS: [(w_sq, u_sq)] per segment (one entry without segments). Releases the GIL.");
  m.def(
      "trust_ratio",
      [](Algo algo, const Hyper& h, double w_sq, double u_sq) {
        return optim::optim_trust_ratio(algo, h, NormSums{w_sq, u_sq});
      },
      py::arg("algo"), py::arg("hyper"), py::arg("w_sq"), py::arg("u_sq"),
      "LAMB/LARS trust ratio from the (reduced) squared norms, clipped to [hyper.min_trust_ratio, hyper.max_trust_ratio].");
  m.def(
      "step_tensor",
      [](const PyStepArgs& args, int threads) { optim::step_tensor(args.raw(), threads); },
      py::arg("args"), py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "One whole tensor (or each segment as its own tensor): LAMB/LARS run norms -> trust ratio -> step, the "
      "others the step. Validated; releases the GIL.");
  m.def(
      "step_tensor_cuda",
      [](const PyStepArgs& args, Ptr stream, bool pointers_checked) {
        optim::StepArgs a = args.raw();
        // Device copies of the maps the step reads (on the current device, which must be the tensors').
        const bool q8 = a.bits == 8;
        a.map1 = q8 && optim::optim_uses_state(a.algo, a.h, 1) ? quant::table_get_device(args.map1) : nullptr;
        a.map2 = q8 && optim::optim_uses_state(a.algo, a.h, 2) ? quant::table_get_device(args.map2) : nullptr;
        const device::VouchedPointers vouched(pointers_checked);
        optim::step_tensor_cuda(a, as_ptr<void>(stream));
      },
      py::arg("args"), py::arg("stream") = 0, py::arg("pointers_checked") = false,
      py::call_guard<py::gil_scoped_release>(),
      "step_tensor on device pointers (one tensor: no segments), queued on `stream` (a cudaStream_t as an int, "
      "torch.cuda.current_stream(device).cuda_stream) with no host sync; LAMB/LARS compute their trust ratio on "
      "the device. The current device must be the tensors'. Same bits as step_tensor. pointers_checked: see "
      "POINTERS_CHECKED. Releases the GIL.");
  m.def(
      "state_bytes",
      [](Algo algo, int64_t n, int bits, int32_t block) { return optim::StateLayout(algo, n, bits, block).bytes(); },
      py::arg("algo"), py::arg("n"), py::arg("bits") = 8, py::arg("block") = 256,
      "Bytes of all optimizer states of n parameters (codes and block scales, or fp32).");
  m.def("algo_num_states", [](Algo a) { return optim::algo_spec(valid_algo(a)).num_states; }, py::arg("algo"),
        "2 for adam/adamw/lamb, 1 for the others.");
  m.def("algo_name", [](Algo a) { return std::string(optim::algo_name(a)); }, py::arg("algo"));
  m.def("algo_has_trust_ratio", [](Algo a) { return optim::algo_spec(valid_algo(a)).trust_ratio; }, py::arg("algo"),
        "lamb, lars: two phases.");
  m.def("optim_uses_state", &optim::optim_uses_state, py::arg("algo"), py::arg("hyper"), py::arg("which"),
        "Whether a step reads and writes state `which` (sgd/lars without momentum leave state 1 alone).");
  m.def("hyper_validate", &optim::hyper_validate, py::arg("algo"), py::arg("hyper"),
        "Raise Zero8ValueError naming the first bad field of `hyper` for `algo`.");
}

}  // namespace zero8::bindings
