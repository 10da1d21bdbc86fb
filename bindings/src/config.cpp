// DeepSpeed JSON config (zero8/config.h) for the engine: parse and validate in C++ (errors carry the
// key path), hand Python the normalized JSON, and evaluate DeepSpeed's LR/momentum schedules from it.
// Calls taking a normalized config re-parse it; world_size 0 derives the data-parallel size from its
// batch triple (train_batch_size / (micro batch * accumulation steps)).
#include <optional>
#include <string>
#include <vector>

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

// A scheduler built from a (normalized) config: DeepSpeed's schedule as a pure function of the step.
struct Scheduler {
  SchedulerConfig s;
  double lr_at(int64_t i) const { return config::lr_at(s, i); }
  double momentum_at(int64_t i) const { return config::momentum_at(s, i); }
};

Scheduler make_scheduler(const std::string& config_json, std::optional<double> base_lr, int world_size) {
  Scheduler sch{parse_normalized(config_json, world_size).scheduler};
  if (base_lr) config::scheduler_set_base_lr(sch.s, *base_lr);
  return sch;
}

}  // namespace

void init_config(py::module_& m) {
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
      [](const std::string& config_json, int world_size) {
        const Config c = parse_normalized(config_json, world_size);
        py::dict d;
        d["world_size"] = c.world_size;
        d["optimizer_present"] = c.optimizer.present;
        d["optimizer_name"] = config::optimizer_display_name(c);
        d["algo"] = config::optimizer_algo(c.optimizer);
        d["state_bits"] = config::optimizer_state_bits(c);
        d["working_dtype"] = config::working_dtype(c);
        d["zero8_enabled"] = c.zero8.enabled;
        return d;
      },
      py::arg("config_json"), py::arg("world_size") = 0,
      "What a normalized config resolves to: dict(world_size, optimizer_present, optimizer_name (e.g. "
      "'AdamW8bit'), algo (Adam with adam_w_mode -> adamw, as DeepSpeed), state_bits, working_dtype, "
      "zero8_enabled).");

  py::class_<Scheduler>(m, "Scheduler",
                        "DeepSpeed's LR schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) "
                        "from a normalized config. lr_at(i) is the lr when the scheduler's last_batch_iteration is "
                        "i (-1: at construction); the engine's applied optimizer step n runs with lr_at(n - 2). "
                        "Without a scheduler: the optimizer's lr.")
      .def(py::init(&make_scheduler), py::arg("config_json"), py::arg("base_lr") = py::none(),
           py::arg("world_size") = 0)
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
