// The ZeRO sharded optimizer (zero8/sharded.h) for the engine: ParamSpec, a flat ShardConfig built by
// hand or from a normalized DeepSpeed config, and the optimizer, whose working-copy, gradient and
// master buffers are handed out as zero-copy views that keep the optimizer alive: memoryviews of host
// memory (torch.frombuffer wraps them), or DLPack exporters for device memory (torch.from_dlpack(view)).
// Collective calls release the GIL.
#include <string>
#include <vector>

#include "bind.h"
#include "zero8/config.h"
#include "zero8/error.h"
#include "zero8/sharded.h"

namespace zero8::bindings {
namespace {

using shard::Group;
using shard::ParamSpec;
using shard::ShardConfig;
using shard::ShardedOptimizer;

// A device buffer of the optimizer for torch.from_dlpack: `bytes` uint8 at `ptr` on CUDA device `device`
// (-1: host memory, which only the tests' views use), keeping `owner` (the optimizer) alive. DLPack rather
// than __cuda_array_interface__, which torch reads through NumPy's C API: zero8 does not need NumPy.
struct DeviceView {
  py::object owner;
  std::uintptr_t ptr = 0;
  int64_t bytes = 0;
  int device = -1;
};

// The DLPack C ABI (the DLPack specification, dlpack.h of github.com/dmlc/dlpack, version 0.8 and 1.x alike
// for these unversioned structs), as far as a 1-d uint8 buffer needs it.
namespace dlpack {
constexpr int32_t kCPU = 1, kCUDA = 2;  // DLDeviceType
constexpr uint8_t kUInt = 1;            // DLDataTypeCode
struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};

// The exported tensor with what it points into: its shape, and a reference to the view's owner, dropped
// by the consumer's deleter call (from whatever thread frees the tensor: it takes the GIL).
struct Export {
  ManagedTensor managed{};
  int64_t shape = 0;
  PyObject* owner = nullptr;
};

void release(ManagedTensor* m) {
  auto* e = static_cast<Export*>(m->manager_ctx);
  if (Py_IsInitialized()) {
    const PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF(e->owner);
    PyGILState_Release(gil);
  }
  delete e;
}

// A capsule nobody consumed (still named "dltensor") releases its tensor; a consumer renames it
// "used_dltensor" and calls the deleter itself.
void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* m = static_cast<ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr) m->deleter(m);
}

py::object export_view(const DeviceView& v) {
  auto* e = new Export;
  e->shape = v.bytes;
  e->owner = v.owner.ptr();
  Py_XINCREF(e->owner);
  Tensor& t = e->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(v.ptr);
  t.device = v.device >= 0 ? Device{kCUDA, v.device} : Device{kCPU, 0};
  t.ndim = 1;
  t.dtype = DataType{kUInt, 8, 1};
  t.shape = &e->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = release;
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    release(&e->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}
}  // namespace dlpack

ShardedOptimizer::Part part_arg(const std::string& name) {
  using Part = ShardedOptimizer::Part;
  for (Part p : {Part::working, Part::master, Part::codes1, Part::absmax1, Part::codes2, Part::absmax2, Part::state1,
                 Part::state2, Part::residual})
    if (name == ShardedOptimizer::part_name(p)) return p;
  ZERO8_CHECK_ARG(false, "part",
                  "unknown part '" << name << "' (working, master, codes1, absmax1, codes2, absmax2, state1, state2, "
                                      "residual)");
  return Part::working;
}

// Host memoryviews of a device optimizer's buffers would point at device memory.
void check_host_buffers(const ShardedOptimizer& o, const char* method) {
  ZERO8_CHECK_ARG(o.config().memory == MemSpace::host, "group",
                  method << ": this optimizer's buffers are device memory (memory = \"device\"); use "
                            "device_buffer(name, group) for a zero-copy view, or copy_to_host(group, part)");
}

Group group_arg(int g) {
  ZERO8_CHECK_ARG(g >= 0 && g < shard::kNumGroups, "group",
                  "must be 0 (8-bit states) or 1 (fp32 states), got " << g);
  return Group(g);
}

// DeepSpeed config -> ShardConfig. zero8 off: fp32 gradients and parameters on the wire, 32-bit
// states (config::optimizer_state_bits). ZeRO stage 0 (DeepSpeed: no partitioning) runs as stage 1,
// which is the same arithmetic (averaged gradients, one update) with the states partitioned.
ShardConfig shard_config_from_json(const std::string& config_json, int world) {
  const config::Config c = config::parse_string(config_json, world, "<normalized config>");
  ShardConfig s;
  s.layout = config::layout_config(c);
  s.algo = config::optimizer_algo(c.optimizer);
  s.hyper = config::optimizer_hyper(c.optimizer);
  s.bits = config::optimizer_state_bits(c);
  s.initial_accumulator = s.hyper.initial_accumulator;
  s.stage = c.zero.stage == 0 ? 1 : c.zero.stage;
  s.working_dtype = config::working_dtype(c);
  s.int8_grads = c.zero8.enabled && c.zero8.int8_gradients;
  // Unquantized gradients travel in communication_data_type; unset: bf16 when training in bf16 (as
  // DeepSpeed), else fp32. There is no fp16 wire format: fp16 is sent as fp32 (the parser warns).
  s.bf16_grads = c.communication_data_type == config::CommDataType::bf16 ||
                 (c.communication_data_type == config::CommDataType::unset && s.working_dtype == DType::bf16);
  s.stochastic_wire = c.zero8.enabled && c.zero8.stochastic_rounding;
  s.wire_seed = c.zero8.seed;
  s.int8_params = c.zero8.enabled && c.zero8.int8_params;
  s.error_feedback = c.zero8.enabled && c.zero8.error_feedback;
  s.release_grads = c.zero8.enabled && c.zero8.release_gradients;
  s.reduce_bucket_size = c.zero.reduce_bucket_size;
  s.allgather_bucket_size = c.zero.allgather_bucket_size;
  s.overlap = c.zero.overlap_comm;
  s.gradient_clipping = c.gradient_clipping;
  s.fp16 = c.fp16.enabled;
  s.loss_scaler = config::loss_scaler_config(c);
  return s;
}

py::dict step_info_dict(const shard::StepInfo& i) {
  py::dict d;
  d["skipped"] = i.skipped;
  d["grad_norm"] = i.grad_norm;
  d["clip_coef"] = i.clip_coef;
  d["loss_scale"] = i.loss_scale;
  d["step"] = i.step;
  return d;
}

}  // namespace

void init_sharded(py::module_& m) {
  m.attr("NUM_GROUPS") = shard::kNumGroups;
  m.attr("GROUP_8BIT") = int(Group::q8);
  m.attr("GROUP_FP32") = int(Group::fp32);

  py::class_<ParamSpec>(m, "ParamSpec", "One model parameter, in model order.")
      .def(py::init([](std::string name, std::vector<int64_t> shape, bool fp32_state, int hyper_group) {
             return ParamSpec{std::move(name), std::move(shape), fp32_state, hyper_group};
           }),
           py::arg("name"), py::arg("shape"), py::arg("fp32_state") = false, py::arg("hyper_group") = 0)
      .def_readwrite("name", &ParamSpec::name)
      .def_readwrite("shape", &ParamSpec::shape)
      .def_readwrite("fp32_state", &ParamSpec::fp32_state, "force 32-bit optimizer state (StableEmbedding)")
      .def_readwrite("hyper_group", &ParamSpec::hyper_group, "the hyperparameter set (param group) that steps it")
      .def("numel", &ParamSpec::numel)
      .def("__repr__",
           [](py::handle self) { return repr_fields(self, "ParamSpec", {"name", "shape", "fp32_state", "hyper_group"}); });

  py::class_<ShardConfig>(m, "ShardConfig",
                          "Configuration of the sharded optimizer (flat: layout and loss-scaler fields included). "
                          "ShardConfig(**fields) starts from the C++ defaults; shard_config_from_json builds one "
                          "from a normalized DeepSpeed config.")
      .def(py::init<>())
      .def(py::init(&from_kwargs<ShardConfig>))
      .def_property(
          "state_block", [](const ShardConfig& c) { return c.layout.state_block; },
          [](ShardConfig& c, int32_t v) { c.layout.state_block = v; }, "8-bit state block")
      .def_property(
          "wire_block", [](const ShardConfig& c) { return c.layout.wire_block; },
          [](ShardConfig& c, int32_t v) { c.layout.wire_block = v; }, "int8 communication block")
      .def_property(
          "min_8bit_size", [](const ShardConfig& c) { return c.layout.min_8bit_size; },
          [](ShardConfig& c, int64_t v) { c.layout.min_8bit_size = v; },
          "parameters with fewer elements keep fp32 states (decided per whole parameter)")
      .def_readwrite("algo", &ShardConfig::algo)
      .def_readwrite("hyper", &ShardConfig::hyper, "hyper.step is managed by the optimizer")
      .def_readwrite("group_hypers", &ShardConfig::group_hypers,
                     "one Hyper per hyper group (ParamSpec.hyper_group); empty: every group starts from hyper")
      .def_readwrite("bits", &ShardConfig::bits, "state bits of the 8-bit group (8 or 32)")
      .def_readwrite("initial_accumulator", &ShardConfig::initial_accumulator)
      .def_readwrite("stage", &ShardConfig::stage, "1: reduce at the accumulation boundary; 2: per bucket in backward")
      .def_readwrite("working_dtype", &ShardConfig::working_dtype)
      .def_readwrite("int8_grads", &ShardConfig::int8_grads)
      .def_readwrite("bf16_grads", &ShardConfig::bf16_grads, "unquantized gradient reduction in bf16 (else fp32)")
      .def_readwrite("stochastic_wire", &ShardConfig::stochastic_wire,
                     "int8 blocks on the wire round stochastically (zero8.stochastic_rounding)")
      .def_readwrite("wire_seed", &ShardConfig::wire_seed, "seed of the stochastic wire rounding (zero8.seed)")
      .def_readwrite("int8_params", &ShardConfig::int8_params)
      .def_readwrite("error_feedback", &ShardConfig::error_feedback)
      .def_readwrite("release_grads", &ShardConfig::release_grads,
                     "reduced gradient buckets' memory goes back to the OS instead of being kept for the next ones")
      .def_readwrite("reduce_bucket_size", &ShardConfig::reduce_bucket_size, "elements per gradient bucket")
      .def_readwrite("allgather_bucket_size", &ShardConfig::allgather_bucket_size,
                     "elements per piece of the parameter all-gather, over all ranks")
      .def_readwrite("overlap", &ShardConfig::overlap,
                     "stage 2 reductions (and on the host the step's all-gather) on a thread of the optimizer "
                     "(several ranks): zero_optimization.overlap_comm")
      .def_readwrite("gradient_clipping", &ShardConfig::gradient_clipping)
      .def_readwrite("fp16", &ShardConfig::fp16, "dynamic loss scaling applies")
      .def_property(
          "initial_scale_power", [](const ShardConfig& c) { return c.loss_scaler.initial_scale_power; },
          [](ShardConfig& c, int v) { c.loss_scaler.initial_scale_power = v; })
      .def_property(
          "loss_scale_window", [](const ShardConfig& c) { return c.loss_scaler.scale_window; },
          [](ShardConfig& c, int64_t v) { c.loss_scaler.scale_window = v; })
      .def_property(
          "hysteresis", [](const ShardConfig& c) { return c.loss_scaler.hysteresis; },
          [](ShardConfig& c, int v) { c.loss_scaler.hysteresis = v; })
      .def_property(
          "consecutive_hysteresis", [](const ShardConfig& c) { return c.loss_scaler.consecutive_hysteresis; },
          [](ShardConfig& c, bool v) { c.loss_scaler.consecutive_hysteresis = v; })
      .def_property(
          "min_loss_scale", [](const ShardConfig& c) { return c.loss_scaler.min_scale; },
          [](ShardConfig& c, double v) { c.loss_scaler.min_scale = v; })
      .def_property(
          "dynamic_loss_scale", [](const ShardConfig& c) { return c.loss_scaler.dynamic; },
          [](ShardConfig& c, bool v) { c.loss_scaler.dynamic = v; })
      .def_property(
          "static_loss_scale", [](const ShardConfig& c) { return c.loss_scaler.static_scale; },
          [](ShardConfig& c, double v) { c.loss_scaler.static_scale = v; })
      .def_property(
          "raise_error_at_min_scale", [](const ShardConfig& c) { return c.loss_scaler.raise_error_at_min_scale; },
          [](ShardConfig& c, bool v) { c.loss_scaler.raise_error_at_min_scale = v; })
      .def_readwrite("threads", &ShardConfig::threads, "OpenMP threads of the kernels (0: default)")
      .def_property(
          "memory", [](const ShardConfig& c) { return std::string(mem_space_name(c.memory)); },
          [](ShardConfig& c, const std::string& v) {
            ZERO8_CHECK_ARG(v == "host" || v == "device", "memory", "must be \"host\" or \"device\", got \"" << v << "\"");
            c.memory = v == "device" ? MemSpace::device : MemSpace::host;
          },
          "where the buffers live: \"host\" or \"device\" (the CUDA device current at construction)")
      .def_property(
          "stream", [](const ShardConfig& c) { return reinterpret_cast<Ptr>(c.stream); },
          [](ShardConfig& c, Ptr v) { c.stream = as_ptr<void>(v); },
          "device memory: the caller's CUDA stream as an int (torch.cuda.current_stream().cuda_stream); 0: the "
          "legacy default stream")
      .def("__copy__", [](const ShardConfig& c) { return c; })
      .def("__deepcopy__", [](const ShardConfig& c, py::dict) { return c; }, py::arg("memo"))
      .def("__repr__", [](py::handle self) {
        return repr_fields(self, "ShardConfig",
                           {"algo", "bits", "stage", "working_dtype", "state_block", "wire_block", "min_8bit_size",
                            "int8_grads", "bf16_grads", "int8_params", "error_feedback", "stochastic_wire", "wire_seed",
                            "release_grads", "reduce_bucket_size", "allgather_bucket_size", "overlap",
                            "gradient_clipping", "fp16", "memory", "stream", "hyper"});
      });

  m.def("shard_config_from_json", &shard_config_from_json, py::arg("config_json"), py::arg("world"),
        "ShardConfig of a normalized DeepSpeed config for a data-parallel size `world` (zero8 section off: "
        "fp32 wire and 32-bit states; ZeRO stage 0 runs as stage 1).");

  py::class_<DeviceView>(m, "DeviceBufferView",
                         "A zero-copy view of a device optimizer's buffer: torch.from_dlpack(view) wraps it as a "
                         "1-d uint8 tensor on its device, which keeps the optimizer alive.")
      .def_property_readonly("nbytes", [](const DeviceView& v) { return v.bytes; })
      .def_property_readonly("ptr", [](const DeviceView& v) { return v.ptr; })
      .def_property_readonly("device", [](const DeviceView& v) { return v.device; })
      // The consumer's stream is not waited on: the engine orders its use of the buffers itself (StreamOrder).
      .def("__dlpack__", [](const DeviceView& v, const py::kwargs&) { return dlpack::export_view(v); })
      .def("__dlpack_device__", [](const DeviceView& v) -> py::tuple {
        if (v.device >= 0) return py::make_tuple(int(dlpack::kCUDA), v.device);
        return py::make_tuple(int(dlpack::kCPU), 0);
      });
  m.def(
      "_host_buffer_view",
      [](py::object owner, std::uintptr_t ptr, int64_t nbytes) {
        ZERO8_CHECK_ARG(nbytes >= 0, "nbytes", "must be >= 0, got " << nbytes);
        return DeviceView{std::move(owner), ptr, nbytes, -1};
      },
      py::arg("owner"), py::arg("ptr"), py::arg("nbytes"),
      "For tests of DeviceBufferView's DLPack export where no GPU is: a view of `nbytes` of host memory at `ptr`, "
      "which `owner` keeps valid.");

  py::class_<ShardedOptimizer>(
      m, "ShardedOptimizer",
      "ZeRO stage 1/2 optimizer over a communicator (collective: every rank builds it with the same params "
      "and config; it keeps a reference to comm). Buffers are zero-copy memoryviews of C++ memory, valid while "
      "any view exists. Groups: 0 = 8-bit states, 1 = fp32 states.")
      .def(py::init<const std::vector<ParamSpec>&, const ShardConfig&, comm::Communicator&>(), py::arg("params"),
           py::arg("cfg"), py::arg("comm"), py::keep_alive<1, 4>())
      .def(
          "working_buffer",
          [](py::object self, int g) {
            ShardedOptimizer& o = self.cast<ShardedOptimizer&>();
            const Group gr = group_arg(g);
            check_host_buffers(o, "working_buffer");
            const int64_t bytes = o.layout().group(gr).padded() * dtype_size(o.config().working_dtype);
            return buffer_view(self, o.working(gr), bytes);
          },
          py::arg("group"),
          "The working copy of a group (padded, working_dtype) as a writable memoryview of bytes.")
      .def(
          "grad_buffer",
          [](py::object self, int g) {
            ShardedOptimizer& o = self.cast<ShardedOptimizer&>();
            const Group gr = group_arg(g);
            check_host_buffers(o, "grad_buffer");
            return buffer_view(self, o.grad_input(gr), o.layout().group(gr).padded() * int64_t(sizeof(float)));
          },
          py::arg("group"),
          "The full fp32 gradient input of a group (padded) as a writable memoryview of bytes. Stage 2 makes it on "
          "the first call (4 bytes per parameter kept from then on); grad_add keeps only the buckets in flight.")
      .def(
          "master_values",
          [](py::object self, int g) {
            ShardedOptimizer& o = self.cast<ShardedOptimizer&>();
            const Group gr = group_arg(g);
            check_host_buffers(o, "master_values");
            const int64_t valid = o.layout().group(gr).part_valid(o.rank());
            return buffer_view(self, o.master(gr), valid * int64_t(sizeof(float)));
          },
          py::arg("group"),
          "This rank's fp32 master of a group (part_range(group) elements) as a memoryview of float32 bytes.")
      .def(
          "device_buffer",
          [](py::object self, const std::string& name, int g) {
            ShardedOptimizer& o = self.cast<ShardedOptimizer&>();
            const Group gr = group_arg(g);
            ZERO8_CHECK_ARG(o.config().memory == MemSpace::device, "name",
                            "device_buffer is for a device optimizer (memory = \"device\"); this one's buffers are "
                            "host memory: use working_buffer, grad_buffer or master_values");
            const shard::GroupLayout& gl = o.layout().group(gr);
            DeviceView v{self, 0, 0, o.device()};
            if (name == "working") {
              v.ptr = reinterpret_cast<Ptr>(o.working(gr));
              v.bytes = gl.padded() * dtype_size(o.config().working_dtype);
            } else if (name == "grad") {
              v.ptr = reinterpret_cast<Ptr>(o.grad_input(gr));
              v.bytes = gl.padded() * int64_t(sizeof(float));
            } else if (name == "master") {
              v.ptr = reinterpret_cast<Ptr>(o.master(gr));
              v.bytes = gl.part_valid(o.rank()) * int64_t(sizeof(float));
            } else {
              ZERO8_CHECK_ARG(false, "name", "unknown device buffer '" << name << "' (working, grad or master)");
            }
            return v;
          },
          py::arg("name"), py::arg("group"),
          "A device optimizer's working copy (\"working\": padded, working_dtype), gradient input (\"grad\": padded "
          "float32) or this rank's master (\"master\": part_range elements of float32) as a DeviceBufferView.")
      .def(
          "part_bytes",
          [](const ShardedOptimizer& o, int g, const std::string& part) { return o.part_bytes(group_arg(g), part_arg(part)); },
          py::arg("group"), py::arg("part"),
          "Bytes of a part of this rank's buffers (working, master, codes1, absmax1, codes2, absmax2, state1, state2, "
          "residual); 0 when not held.")
      .def(
          "copy_to_host",
          [](ShardedOptimizer& o, int g, const std::string& part) {
            const Group gr = group_arg(g);
            const ShardedOptimizer::Part p = part_arg(part);
            std::string out(size_t(o.part_bytes(gr, p)), '\0');
            {
              py::gil_scoped_release release;
              o.copy_to_host(gr, p, out.data());
            }
            return py::bytes(out);
          },
          py::arg("group"), py::arg("part"), "A part of this rank's buffers as bytes (host or device optimizer).")
      .def(
          "copy_from_host",
          [](ShardedOptimizer& o, int g, const std::string& part, const py::bytes& data) {
            const Group gr = group_arg(g);
            const ShardedOptimizer::Part p = part_arg(part);
            const std::string buf = data;
            ZERO8_CHECK_ARG(int64_t(buf.size()) == o.part_bytes(gr, p), "data",
                            buf.size() << " bytes for " << part << ", which has " << o.part_bytes(gr, p));
            py::gil_scoped_release release;
            o.copy_from_host(gr, p, buf.data());
          },
          py::arg("group"), py::arg("part"), py::arg("data"),
          "Overwrite a part of this rank's buffers from bytes (part_bytes of them).")
      .def(
          "state_values",
          [](ShardedOptimizer& o, int g, int which) {
            optim::State* s = o.state(group_arg(g));
            ZERO8_CHECK_ARG(which == 1 || which == 2, "which", "must be 1 or 2, got " << which);
            ZERO8_CHECK_ARG(which <= s->layout().num_states, "which",
                            optim::algo_name(s->layout().algo) << " has " << s->layout().num_states << " state(s)");
            return s->values(which);
          },
          py::arg("group"), py::arg("which"), "This rank's optimizer state `which` of a group as floats (dequantized).")
      .def(
          "param_slot",
          [](const ShardedOptimizer& o, int i) {
            ZERO8_CHECK_ARG(i >= 0 && size_t(i) < o.layout().slots.size(), "param",
                            "index " << i << " out of range (" << o.layout().slots.size() << " parameters)");
            const shard::ParamSlot& s = o.layout().slots[size_t(i)];
            return py::make_tuple(int(s.group), s.offset, s.numel);
          },
          py::arg("param"), "(group, offset, numel) of parameter i in its group's flat buffers.")
      .def_property_readonly("num_params", [](const ShardedOptimizer& o) { return o.layout().params.size(); })
      .def_property_readonly("params", [](const ShardedOptimizer& o) { return o.layout().params; })
      .def(
          "group_padded", [](const ShardedOptimizer& o, int g) { return o.layout().group(group_arg(g)).padded(); },
          py::arg("group"), "Elements of a group's flat buffers (parameters + padding).")
      .def(
          "group_numel", [](const ShardedOptimizer& o, int g) { return o.layout().group(group_arg(g)).numel; },
          py::arg("group"), "Elements of a group's parameters.")
      .def(
          "part_range",
          [](const ShardedOptimizer& o, int g) {
            const shard::GroupLayout& gl = o.layout().group(group_arg(g));
            return py::make_tuple(gl.part_begin(o.rank()), gl.part_valid(o.rank()));
          },
          py::arg("group"), "(begin, valid): this rank's partition of a group in flat coordinates.")
      .def("init", &ShardedOptimizer::init, py::arg("root") = 0, py::call_guard<py::gil_scoped_release>(),
           "Collective: root's working copy becomes everyone's, and the masters are set from it.")
      .def(
          "grad_add",
          [](ShardedOptimizer& o, int param, Ptr grad, DType dtype) {
            o.grad_add(param, as_ptr<const void>(grad), dtype);
          },
          py::arg("param"), py::arg("grad_ptr"), py::arg("dtype"), py::call_guard<py::gil_scoped_release>(),
          "Add parameter i's gradient (numel contiguous values of dtype f32/bf16/f16 at grad_ptr, in this optimizer's "
          "memory) to this micro-batch's, in the bucket that carries it: stage 2 keeps no full gradient buffer.")
      .def("grad_ready", &ShardedOptimizer::grad_ready, py::arg("param"), py::call_guard<py::gil_scoped_release>(),
           "Parameter i's gradient of this micro-batch is complete (stage 2 reduces the buckets it completes,\n"
           "in one order of all buckets that every rank follows).")
      .def("param_reduced", &ShardedOptimizer::param_reduced, py::arg("param"),
           "Whether a bucket holding parameter i was reduced this micro-batch (a later addition to its gradient\n"
           "would be lost).")
      .def("backward_end", &ShardedOptimizer::backward_end, py::arg("boundary"),
           py::call_guard<py::gil_scoped_release>(),
           "Collective end of a micro-batch's backward; boundary: the last micro-batch of the accumulation.")
      .def("end_accumulation", &ShardedOptimizer::end_accumulation, py::call_guard<py::gil_scoped_release>(),
           "Collective end of an accumulation whose last micro-batch ended with backward_end(False): stage 1\n"
           "reduces the accumulated gradients, stage 2 has reduced them already.")
      .def(
          "step",
          [](ShardedOptimizer& o, bool defer_gather) {
            shard::StepInfo info;
            {
              py::gil_scoped_release release;
              info = o.step(defer_gather);
            }
            return step_info_dict(info);
          },
          py::arg("defer_gather") = false,
          "Collective optimizer step: dict(skipped, grad_norm, clip_coef, loss_scale, step). defer_gather (where\n"
          "defers_gather): return before the parameter all-gather is done; read a parameter's working copy\n"
          "only after wait_param(i), write it only after wait_gather().")
      .def("wait_param", &ShardedOptimizer::wait_param, py::arg("param"), py::call_guard<py::gil_scoped_release>(),
           "Deferred all-gather: block until parameter i's working copy holds the last step's update (device\n"
           "memory: for the work queued on the optimizer's stream from now on).")
      .def("wait_gather", &ShardedOptimizer::wait_gather, py::call_guard<py::gil_scoped_release>(),
           "Block until the whole deferred all-gather is done (at once when none is pending).")
      .def_property_readonly("defers_gather", &ShardedOptimizer::defers_gather,
                             "step(True) returns before the parameter all-gather is done (the overlap "
                             "thread, not the int8 sync with stochastic rounding).")
      .def_property_readonly("gather_pending", &ShardedOptimizer::gather_pending,
                             "A deferred all-gather is pending (wait_gather() ends it).")
      .def("set_lr", [](ShardedOptimizer& o, float lr) { o.hyper().lr = lr; }, py::arg("lr"))
      .def_property(
          "lr", [](ShardedOptimizer& o) { return o.hyper().lr; },
          [](ShardedOptimizer& o, float lr) { o.hyper().lr = lr; })
      .def_property(
          "hyper",
          py::cpp_function([](ShardedOptimizer& o) -> optim::Hyper& { return o.hyper(); },
                           py::return_value_policy::reference_internal),
          [](ShardedOptimizer& o, const optim::Hyper& h) { o.hyper() = h; },
          "The hyperparameters of the next steps of hyper group 0, by reference (opt.hyper.lr = x changes them; "
          "step is managed).")
      .def_property_readonly("num_hyper_groups", &ShardedOptimizer::num_hyper_groups)
      .def(
          "group_hyper", [](ShardedOptimizer& o, int g) -> optim::Hyper& { return o.hyper(g); },
          py::arg("hyper_group"), py::return_value_policy::reference_internal,
          "The hyperparameters of one hyper group, by reference (validated at every step).")
      .def(
          "set_group_hyper", [](ShardedOptimizer& o, int g, const optim::Hyper& h) { o.hyper(g) = h; },
          py::arg("hyper_group"), py::arg("hyper"))
      .def("set_step_group", &ShardedOptimizer::set_step_group, py::arg("outer").none(true), py::keep_alive<1, 2>(),
           "Also reduce the step's overflow flag and squared gradient norm over `outer` (the pipeline group: every\n"
           "stage skips together and clips by the whole model's norm); None turns it off.")
      .def_property_readonly("loss_scale", &ShardedOptimizer::loss_scale)
      .def_property_readonly(
          "loss_scaler_state",
          [](ShardedOptimizer& o) {
            const LossScalerState& s = o.scaler().state();
            py::dict d;
            d["scale"] = s.scale;
            d["cur_iter"] = s.cur_iter;
            d["last_overflow_iter"] = s.last_overflow_iter;
            d["cur_hysteresis"] = s.cur_hysteresis;
            return d;
          },
          "The loss scaler's state: dict(scale, cur_iter, last_overflow_iter, cur_hysteresis).")
      .def_property("steps", &ShardedOptimizer::steps, &ShardedOptimizer::set_steps)
      .def_property_readonly("rank", &ShardedOptimizer::rank)
      .def_property_readonly("world", &ShardedOptimizer::world)
      .def_property_readonly(
          "wire",
          [](const ShardedOptimizer& o) {
            const shard::WirePlan& w = o.wire();
            py::dict d;
            d["gradients"] = comm::wire_format_name(w.grads);
            d["int8_params"] = w.int8_params;
            d["error_feedback"] = w.error_feedback;
            return d;
          },
          "What the collectives carry over this optimizer's ranks: dict(gradients: \"int8\", \"bf16\" or \"f32\", "
          "int8_params, error_feedback). The config's wire options, except at one rank, which sends nothing and "
          "so quantizes nothing (f32, False, False): its gradients and parameters stay exact.")
      .def_property_readonly("config", &ShardedOptimizer::config,
                             "A copy of the config, with the hyperparameters of now (hyper: group 0's; group_hypers: "
                             "every group's).")
      .def(
          "memory",
          [](const ShardedOptimizer& o) {
            const shard::MemoryStats s = o.memory();
            py::dict d;
            d["working"] = s.working;
            d["grads"] = s.grads;
            d["master"] = s.master;
            d["state"] = s.state;
            d["buffers"] = s.buffers;
            d["grads_peak"] = s.grads_peak;
            return d;
          },
          "Bytes held by this rank: dict(working, grads, master, state, buffers), and grads_peak (the most grads "
          "has been).")
      .def(
          "overlap_stats",
          [](const ShardedOptimizer& o) {
            const shard::OverlapStats s = o.overlap_stats();
            py::dict d;
            d["threaded"] = s.threaded;
            d["reductions"] = s.reductions;
            d["reduce_seconds"] = s.reduce_seconds;
            d["reduce_wait_seconds"] = s.reduce_wait_seconds;
            d["gathers"] = s.gathers;
            d["gather_seconds"] = s.gather_seconds;
            d["gather_wait_seconds"] = s.gather_wait_seconds;
            return d;
          },
          "Time of the collectives since construction and the time the caller waited for them: dict(threaded, "
          "reductions, reduce_seconds, reduce_wait_seconds, gathers, gather_seconds, gather_wait_seconds).")
      .def("refresh_masters", &ShardedOptimizer::refresh_masters,
           "This rank's fp32 masters from its working copy (not collective), after the weights were changed in place.")
      .def("sync_working_from_master", &ShardedOptimizer::sync_working_from_master,
           py::call_guard<py::gil_scoped_release>(),
           "Collective: recompute the working copy from the masters (after loading a checkpoint).");
}

}  // namespace zero8::bindings
