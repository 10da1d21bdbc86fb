// DeepSpeed JSON config (zero8/config.h) for the engine: parse and validate in C++ (errors carry the
// key path), hand Python the typed result (zero8._C.Config, read-only, as the engine reads it) and the
// normalized JSON, and evaluate DeepSpeed's LR/momentum schedules from it. Calls taking a normalized
// config re-parse it; world_size 0 derives the data-parallel size from its batch triple
// (train_batch_size / (micro batch * accumulation steps)).
#include <optional>
#include <string>
#include <vector>

#include <pybind11/operators.h>

#include "bind.h"
#include "zero8/config.h"
#include "zero8/error.h"

namespace zero8::bindings {
namespace {

using config::Config;
using config::SchedulerConfig;

// The data-parallel size a normalized config was resolved with (its triple is complete).
int world_of(const std::string& config_json) {
  py::object d = py::module_::import("json").attr("loads")(config_json);
  auto get = [&](const char* key) -> int64_t {
    ZERO8_CHECK_ARG(py::isinstance<py::dict>(d) && d.contains(key), "config_json",
                    "not a normalized config (no '" << key << "'); pass world_size explicitly");
    return d[key].cast<int64_t>();
  };
  const int64_t tb = get("train_batch_size"), mb = get("train_micro_batch_size_per_gpu"),
                gas = get("gradient_accumulation_steps");
  ZERO8_CHECK_ARG(mb > 0 && gas > 0 && tb > 0 && tb % (mb * gas) == 0, "config_json",
                  "batch triple " << tb << " / (" << mb << " * " << gas << ") is not a whole world size");
  return int(tb / (mb * gas));
}

Config parse_normalized(const std::string& config_json, int world_size) {
  return config::parse_string(config_json, world_size > 0 ? world_size : world_of(config_json), "<normalized config>");
}

py::tuple parsed(const Config& c) {
  return py::make_tuple(config::to_json(c), c.warnings);
}

// What config_info reports (the optimizer and precision a config resolves to).
py::dict info_of(const Config& c) {
  py::dict d;
  d["world_size"] = c.world_size;
  d["optimizer_present"] = c.optimizer.present;
  d["optimizer_name"] = config::optimizer_display_name(c);
  d["algo"] = config::optimizer_algo(c.optimizer);
  d["state_bits"] = config::optimizer_state_bits(c);
  d["working_dtype"] = config::working_dtype(c);
  d["zero8_enabled"] = c.zero8.enabled;
  return d;
}

// A scheduler built from a (normalized) config: DeepSpeed's schedule as a pure function of the step.
struct Scheduler {
  SchedulerConfig s;
  double lr_at(int64_t i) const { return config::lr_at(s, i); }
  double momentum_at(int64_t i) const { return config::momentum_at(s, i); }
};

Scheduler make_scheduler_of(const SchedulerConfig& s, std::optional<double> base_lr) {
  Scheduler sch{s};
  if (base_lr) config::scheduler_set_base_lr(sch.s, *base_lr);
  return sch;
}

Scheduler make_scheduler(const std::string& config_json, std::optional<double> base_lr, int world_size) {
  return make_scheduler_of(parse_normalized(config_json, world_size).scheduler, base_lr);
}

// The typed config's classes: every field read-only, under its C++ name (DeepSpeed's key where the
// JSON has one); nested sections come back by reference and keep their Config alive. Enums are bound
// with the spellings of the JSON values in lower case (the scheduler types in snake case).
void init_config_types(py::module_& m) {
  using namespace config;
  py::enum_<SchedulerType>(m, "SchedulerType", "\"scheduler\": {\"type\"}; none: no scheduler section")
      .value("none", SchedulerType::none)
      .value("warmup_lr", SchedulerType::warmup_lr)
      .value("warmup_decay_lr", SchedulerType::warmup_decay_lr)
      .value("warmup_cosine_lr", SchedulerType::warmup_cosine_lr)
      .value("one_cycle", SchedulerType::one_cycle)
      .value("lr_range_test", SchedulerType::lr_range_test);
  py::enum_<WarmupType>(m, "WarmupType", "scheduler.params.warmup_type")
      .value("log", WarmupType::log)
      .value("linear", WarmupType::linear);
  py::enum_<CommDataType>(m, "CommDataType", "a dtype by DeepSpeed's names (communication_data_type, data_types); unset: not given")
      .value("unset", CommDataType::unset)
      .value("fp32", CommDataType::fp32)
      .value("fp16", CommDataType::fp16)
      .value("bf16", CommDataType::bf16);
  py::enum_<TagValidation>(m, "TagValidation", "checkpoint.tag_validation (DeepSpeed's Warn, Ignore, Fail)")
      .value("warn", TagValidation::warn)
      .value("ignore", TagValidation::ignore)
      .value("fail", TagValidation::fail);
  py::enum_<CommBackend>(m, "CommBackend", "zero8.comm_backend")
      .value("auto", CommBackend::automatic)
      .value("mpi", CommBackend::mpi)
      .value("single", CommBackend::single)
      .value("nccl", CommBackend::nccl)
      .value("tcp", CommBackend::tcp);

  py::class_<BatchConfig>(m, "ConfigBatch", "The batch triple, resolved for the data-parallel size.")
      .def_readonly("train_batch_size", &BatchConfig::train_batch_size)
      .def_readonly("train_micro_batch_size_per_gpu", &BatchConfig::train_micro_batch_size_per_gpu)
      .def_readonly("gradient_accumulation_steps", &BatchConfig::gradient_accumulation_steps);
  py::class_<OptimizerConfig>(m, "ConfigOptimizer", "\"optimizer\" with the defaults of its type; present: "
                                                    "the config has the section.")
      .def_readonly("present", &OptimizerConfig::present)
      .def_readonly("type", &OptimizerConfig::type, "the algorithm the type names (Adam stays adam; Config.algo "
                                                    "resolves adam_w_mode)")
      .def(
          "get",
          [](const OptimizerConfig& o, const std::string& key) -> py::object {
            const double v = o.get(key);  // throws for a key the row does not have
            const optim::AlgoSpec& r = optim::algo_spec(o.type);
            for (int i = 0; i < r.num_hyper; ++i) {
              const optim::HyperSpec& e = r.hyper[i];
              const bool named = key == e.key || (e.deepspeed != nullptr && key == e.deepspeed);
              if (named && e.type == optim::HyperType::flag) return py::bool_(v != 0.0);
            }
            return py::float_(v);
          },
          py::arg("key"),
           "the value of one entry of the type's table row, by zero8's key (\"betas[1]\") or DeepSpeed's "
           "(\"max_coeff\")")
      .def_property_readonly(
          "params",
          [](const OptimizerConfig& o) {
            const optim::AlgoSpec& r = optim::algo_spec(o.type);
            py::dict d;
            for (int i = 0; i < r.num_hyper; ++i) {
              const optim::HyperSpec& e = r.hyper[i];
              d[py::str(e.key)] = e.type == optim::HyperType::flag ? py::object(py::bool_(o.values[size_t(i)] != 0.0))
                                                                   : py::object(py::float_(o.values[size_t(i)]));
            }
            return d;
          },
          "every entry of the type's table row by zero8's key, resolved (defaults filled in)");
  py::class_<SchedulerConfig>(m, "ConfigScheduler", "\"scheduler\" with DeepSpeed's defaults; type none: no "
                                                    "section. Scheduler(config.scheduler) evaluates it.")
      .def_readonly("type", &SchedulerConfig::type)
      .def_readonly("base_lr", &SchedulerConfig::base_lr)
      .def_readonly("warmup_min_lr", &SchedulerConfig::warmup_min_lr)
      .def_readonly("warmup_max_lr", &SchedulerConfig::warmup_max_lr)
      .def_readonly("warmup_num_steps", &SchedulerConfig::warmup_num_steps)
      .def_readonly("warmup_type", &SchedulerConfig::warmup_type)
      .def_readonly("total_num_steps", &SchedulerConfig::total_num_steps)
      .def_readonly("warmup_min_ratio", &SchedulerConfig::warmup_min_ratio)
      .def_readonly("cos_min_ratio", &SchedulerConfig::cos_min_ratio)
      .def_readonly("cycle_min_lr", &SchedulerConfig::cycle_min_lr)
      .def_readonly("cycle_max_lr", &SchedulerConfig::cycle_max_lr)
      .def_readonly("decay_lr_rate", &SchedulerConfig::decay_lr_rate)
      .def_readonly("cycle_first_step_size", &SchedulerConfig::cycle_first_step_size)
      .def_readonly("cycle_second_step_size", &SchedulerConfig::cycle_second_step_size)
      .def_readonly("cycle_first_stair_count", &SchedulerConfig::cycle_first_stair_count)
      .def_readonly("cycle_second_stair_count", &SchedulerConfig::cycle_second_stair_count)
      .def_readonly("decay_step_size", &SchedulerConfig::decay_step_size)
      .def_readonly("cycle_momentum", &SchedulerConfig::cycle_momentum)
      .def_readonly("cycle_min_mom", &SchedulerConfig::cycle_min_mom)
      .def_readonly("cycle_max_mom", &SchedulerConfig::cycle_max_mom)
      .def_readonly("decay_mom_rate", &SchedulerConfig::decay_mom_rate)
      .def_readonly("momentum_cycled", &SchedulerConfig::momentum_cycled)
      .def_readonly("lr_range_test_min_lr", &SchedulerConfig::lr_range_test_min_lr)
      .def_readonly("lr_range_test_step_size", &SchedulerConfig::lr_range_test_step_size)
      .def_readonly("lr_range_test_step_rate", &SchedulerConfig::lr_range_test_step_rate)
      .def_readonly("lr_range_test_staircase", &SchedulerConfig::lr_range_test_staircase);
  py::class_<Fp16Config>(m, "ConfigFp16", "\"fp16\"; loss_scale 0: dynamic scaling.")
      .def_readonly("enabled", &Fp16Config::enabled)
      .def_readonly("loss_scale", &Fp16Config::loss_scale)
      .def_readonly("initial_scale_power", &Fp16Config::initial_scale_power)
      .def_readonly("loss_scale_window", &Fp16Config::loss_scale_window)
      .def_readonly("hysteresis", &Fp16Config::hysteresis)
      .def_readonly("consecutive_hysteresis", &Fp16Config::consecutive_hysteresis)
      .def_readonly("min_loss_scale", &Fp16Config::min_loss_scale)
      .def_readonly("auto_cast", &Fp16Config::auto_cast);
  py::class_<Bf16Config>(m, "ConfigBf16", "\"bf16\" (or \"bfloat16\").")
      .def_readonly("enabled", &Bf16Config::enabled)
      .def_readonly("immediate_grad_update", &Bf16Config::immediate_grad_update)
      .def_readonly("check_grad_overflow", &Bf16Config::check_grad_overflow);
  py::class_<ZeroConfig>(m, "ConfigZero", "\"zero_optimization\" (bucket sizes in elements).")
      .def_readonly("stage", &ZeroConfig::stage)
      .def_readonly("reduce_bucket_size", &ZeroConfig::reduce_bucket_size)
      .def_readonly("allgather_bucket_size", &ZeroConfig::allgather_bucket_size)
      .def_readonly("overlap_comm", &ZeroConfig::overlap_comm)
      .def_readonly("contiguous_gradients", &ZeroConfig::contiguous_gradients)
      .def_readonly("reduce_scatter", &ZeroConfig::reduce_scatter)
      .def_readonly("allgather_partitions", &ZeroConfig::allgather_partitions)
      .def_readonly("round_robin_gradients", &ZeroConfig::round_robin_gradients)
      .def_readonly("load_from_fp32_weights", &ZeroConfig::load_from_fp32_weights)
      .def_readonly("ignore_unused_parameters", &ZeroConfig::ignore_unused_parameters)
      .def_readonly("parameter_alignment", &ZeroConfig::parameter_alignment, "accepted, no effect")
      .def_readonly("compute_grad_norm", &ZeroConfig::compute_grad_norm, "false: get_global_grad_norm() is None");
  py::class_<DataTypesConfig>(m, "ConfigDataTypes", "\"data_types\": how the engine casts the module under fp16/bf16.")
      .def_readonly("grad_accum_dtype", &DataTypesConfig::grad_accum_dtype, "accepted, no effect")
      .def_readonly("param_dtype", &DataTypesConfig::param_dtype, "unset, or the training dtype")
      .def_readonly("buffer_dtype", &DataTypesConfig::buffer_dtype, "unset: the buffers keep their dtype")
      .def_property_readonly(
          "keep_in_fp32_modules",
          [](const DataTypesConfig& d) -> py::object {
            return d.keep_in_fp32_modules ? py::cast(*d.keep_in_fp32_modules) : py::str("auto");
          },
          "\"auto\" (the model's transformers lists) or the name patterns of the buffers kept in fp32");
  py::class_<CheckpointConfig>(m, "ConfigCheckpoint", "\"checkpoint\" (DeepSpeed's keys zero8 uses).")
      .def_readonly("tag_validation", &CheckpointConfig::tag_validation)
      .def_readonly("load_universal", &CheckpointConfig::load_universal)
      .def_readonly("use_node_local_storage", &CheckpointConfig::use_node_local_storage);
  py::class_<MonitorOutputConfig>(m, "ConfigMonitorOutput",
                                  "\"tensorboard\" or \"csv_monitor\": rank 0 writes under output_path/job_name.")
      .def_readonly("enabled", &MonitorOutputConfig::enabled)
      .def_readonly("output_path", &MonitorOutputConfig::output_path)
      .def_readonly("job_name", &MonitorOutputConfig::job_name);
  py::class_<WandbConfig>(m, "ConfigWandb", "\"wandb\": rank 0's wandb.init(project, group, entity=team).")
      .def_readonly("enabled", &WandbConfig::enabled)
      .def_readonly("group", &WandbConfig::group, "None: wandb's default")
      .def_readonly("team", &WandbConfig::team, "None: wandb's default entity")
      .def_readonly("project", &WandbConfig::project);
  py::class_<Zero8Config>(m, "ConfigZero8", "\"zero8\"; enabled: the section is present and not disabled.")
      .def_readonly("enabled", &Zero8Config::enabled)
      .def_readonly("state_block_size", &Zero8Config::state_block_size)
      .def_readonly("wire_block_size", &Zero8Config::wire_block_size)
      .def_readonly("int8_gradients", &Zero8Config::int8_gradients)
      .def_readonly("int8_params", &Zero8Config::int8_params)
      .def_readonly("int8_activations", &Zero8Config::int8_activations,
                    "pipeline engine: activations and activation gradients between stages as int8 blocks")
      .def_readonly("queued_stage_messages", &Zero8Config::queued_stage_messages,
                    "pipeline engine over NCCL: stage messages queued on the stream, the host not waiting for each")
      .def_readonly("error_feedback", &Zero8Config::error_feedback)
      .def_readonly("release_gradients", &Zero8Config::release_gradients)
      .def_readonly("overlap_param_gather", &Zero8Config::overlap_param_gather)
      .def_readonly("min_8bit_size", &Zero8Config::min_8bit_size)
      .def_readonly("optim_bits", &Zero8Config::optim_bits)
      .def_readonly("stochastic_rounding", &Zero8Config::stochastic_rounding)
      .def_readonly("seed", &Zero8Config::seed)
      .def_readonly("comm_backend", &Zero8Config::comm_backend)
      .def_readonly("comm_timeout_s", &Zero8Config::comm_timeout_s)
      .def_readonly("checkpoint_keep_last", &Zero8Config::checkpoint_keep_last, "\"checkpoint\": {\"keep_last\"}")
      .def_readonly("checkpoint_allow_pickle", &Zero8Config::checkpoint_allow_pickle,
                    "\"checkpoint\": {\"allow_pickle\"}");

  py::class_<Config>(m, "Config",
                     "A parsed and validated DeepSpeed config for a data-parallel size, every value resolved "
                     "(read-only). Config(json_text, world_size, source) and Config.from_file(path, world_size) "
                     "raise as config_parse does; to_json() is the normalized JSON.")
      .def(py::init([](const std::string& json_text, int world_size, const std::string& source) {
             return config::parse_string(json_text, world_size, source);
           }),
           py::arg("json_text"), py::arg("world_size") = 1, py::arg("source") = "<string>")
      .def_static("from_file", &config::parse_file, py::arg("path"), py::arg("world_size") = 1,
                  "Parse a file (comments allowed); Zero8IOError when it cannot be read.")
      .def_static("from_normalized", &parse_normalized, py::arg("config_json"), py::arg("world_size") = 0,
                  "A normalized config (to_json()) back; world_size 0: from its batch triple.")
      .def_readonly("world_size", &Config::world_size, "The data-parallel size the batch triple was resolved with.")
      .def_readonly("batch", &Config::batch)
      .def_readonly("optimizer", &Config::optimizer)
      .def_readonly("scheduler", &Config::scheduler)
      .def_readonly("fp16", &Config::fp16)
      .def_readonly("bf16", &Config::bf16)
      .def_readonly("gradient_clipping", &Config::gradient_clipping, "Max global gradient norm; 0: off.")
      .def_readonly("steps_per_print", &Config::steps_per_print)
      .def_readonly("wall_clock_breakdown", &Config::wall_clock_breakdown)
      .def_readonly("managed_gradient_accumulation", &Config::managed_gradient_accumulation)
      .def_readonly("prescale_gradients", &Config::prescale_gradients)
      .def_readonly("gradient_predivide_factor", &Config::gradient_predivide_factor)
      .def_readonly("zero_allow_untested_optimizer", &Config::zero_allow_untested_optimizer)
      .def_readonly("communication_data_type", &Config::communication_data_type)
      .def_readonly("data_types", &Config::data_types)
      .def_readonly("zero", &Config::zero, "\"zero_optimization\"")
      .def_readonly("checkpoint", &Config::checkpoint)
      .def_readonly("tensorboard", &Config::tensorboard)
      .def_readonly("csv_monitor", &Config::csv_monitor)
      .def_readonly("wandb", &Config::wandb)
      .def_readonly("zero8", &Config::zero8)
      .def_readonly("source", &Config::source, "Where the config came from (a path, '<config dict>', ...).")
      .def_readonly("warnings", &Config::warnings, "The parse's messages: '<source>: <key path>: <message>'.")
      .def_property_readonly("optimizer_name", &config::optimizer_display_name, "e.g. 'AdamW8bit', 'Lamb' (32-bit)")
      .def_property_readonly(
          "algo", [](const Config& c) { return config::optimizer_algo(c.optimizer); },
          "The optimizer section's algorithm (Adam with adam_w_mode: adamw, as DeepSpeed).")
      .def_property_readonly("state_bits", &config::optimizer_state_bits, "zero8 enabled: zero8.optim_bits; else 32")
      .def_property_readonly("working_dtype", &config::working_dtype, "f16, bf16 or f32")
      .def("to_json", &config::to_json, py::arg("indent") = 2, "The normalized config as JSON text.")
      .def(py::pickle(  // so that copy, deepcopy and pickle work, as on the Python objects that hold it
          [](const Config& c) { return py::make_tuple(config::to_json(c), c.world_size, c.source, c.warnings); },
          [](const py::tuple& t) {
            Config c = parse_normalized(t[0].cast<std::string>(), t[1].cast<int>());
            c.source = t[2].cast<std::string>();
            c.warnings = t[3].cast<std::vector<std::string>>();
            return c;
          }))
      .def(py::self == py::self)
      .def("__repr__", [](const Config& c) {
        return "zero8._C.Config(source=" + py::repr(py::str(c.source)).cast<std::string>() +
               ", world_size=" + std::to_string(c.world_size) + ")";
      });
}

}  // namespace

void init_config(py::module_& m) {
  init_config_types(m);
  m.def(
      "config_parse",
      [](const std::string& json_text, int world_size, const std::string& source) {
        return parsed(config::parse_string(json_text, world_size, source));
      },
      py::arg("json_text"), py::arg("world_size") = 1, py::arg("source") = "<string>",
      "Parse and validate a DeepSpeed JSON config for a data-parallel size: (normalized JSON text, warnings). "
      "Errors raise Zero8ValueError (bad value), Zero8NotSupportedError (a DeepSpeed feature zero8 lacks) "
      "with '<source>: <key path>: ...'.");
  m.def("config_plain_json", &config::plain_json, py::arg("json_text"), py::arg("source") = "<string>",
        "The JSON text with its comments removed (Zero8ValueError when it is malformed).");
  m.def(
      "config_parse_file",
      [](const std::string& path, int world_size) { return parsed(config::parse_file(path, world_size)); },
      py::arg("path"), py::arg("world_size") = 1,
      "config_parse of a file (comments allowed); Zero8IOError when it cannot be read.");
  m.def(
      "config_info",
      [](const std::string& config_json, int world_size) { return info_of(parse_normalized(config_json, world_size)); },
      py::arg("config_json"), py::arg("world_size") = 0,
      "What a normalized config resolves to: dict(world_size, optimizer_present, optimizer_name (e.g. "
      "'AdamW8bit'), algo (Adam with adam_w_mode -> adamw, as DeepSpeed), state_bits, working_dtype, "
      "zero8_enabled).");
  m.def("config_info", &info_of, py::arg("config"), "config_info of a typed Config.");

  py::class_<Scheduler>(m, "Scheduler",
                        "DeepSpeed's LR schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) "
                        "from a normalized config. lr_at(i) is the lr when the scheduler's last_batch_iteration is "
                        "i (-1: at construction); the engine's applied optimizer step n runs with lr_at(n - 2). "
                        "Without a scheduler: the optimizer's lr.")
      .def(py::init(&make_scheduler), py::arg("config_json"), py::arg("base_lr") = py::none(),
           py::arg("world_size") = 0)
      .def(py::init(&make_scheduler_of), py::arg("scheduler"), py::arg("base_lr") = py::none(),
           "From a typed config's section (Config.scheduler).")
      .def("lr_at", &Scheduler::lr_at, py::arg("last_batch_iteration"))
      .def("momentum_at", &Scheduler::momentum_at, py::arg("last_batch_iteration"),
           "OneCycle's beta1 (needs momentum_cycled; beta2 is then 0.99).")
      .def(
          "set_base_lr", [](Scheduler& s, double lr) { config::scheduler_set_base_lr(s.s, lr); }, py::arg("lr"),
          "The client optimizer's lr, for a config without an optimizer section (no effect once set).")
      .def_property_readonly("type", [](const Scheduler& s) { return std::string(config::scheduler_type_name(s.s.type)); })
      .def_property_readonly("base_lr", [](const Scheduler& s) { return s.s.base_lr; })
      .def_property_readonly("momentum_cycled", [](const Scheduler& s) { return s.s.momentum_cycled; });

  m.def(
      "lr_at",
      [](const std::string& config_json, int64_t i, std::optional<double> base_lr, int world_size) {
        return make_scheduler(config_json, base_lr, world_size).lr_at(i);
      },
      py::arg("config_json"), py::arg("last_batch_iteration"), py::arg("base_lr") = py::none(),
      py::arg("world_size") = 0, "Scheduler(config_json, base_lr).lr_at(last_batch_iteration).");
  m.def(
      "momentum_at",
      [](const std::string& config_json, int64_t i, std::optional<double> base_lr, int world_size) {
        return make_scheduler(config_json, base_lr, world_size).momentum_at(i);
      },
      py::arg("config_json"), py::arg("last_batch_iteration"), py::arg("base_lr") = py::none(),
      py::arg("world_size") = 0, "Scheduler(config_json, base_lr).momentum_at(last_batch_iteration).");
}

}  // namespace zero8::bindings
