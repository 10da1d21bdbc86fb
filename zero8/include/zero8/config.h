// DeepSpeed JSON configuration: parsed, validated and resolved once, at the API entry. A real DeepSpeed
// config works as is; a "zero8" section turns on the 8-bit optimizer states and int8 communication.
// Every key, type and default is documented in docs/CONFIG.md. JSON stays inside config.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"
#include "zero8/layout.h"
#include "zero8/loss_scaler.h"

namespace zero8::config {

// The three batch sizes, resolved by DeepSpeed's rule
//   train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size
// (world_size: the data-parallel size given to the parser).
struct BatchConfig {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  auto tie() const { return std::tie(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps); }
};

// "optimizer": {"type": ..., "params": {...}}: the row of the algorithm table (zero8/kernels/optim_table.h)
// that the type names, and a value for each of its entries, read from params under the entry's DeepSpeed
// key with the default of the optimizer DeepSpeed builds for the type (FusedAdam, FusedLamb, FusedLion,
// torch.optim.SGD/RMSprop/Adagrad); each type reads only its own parameters.
struct OptimizerConfig {
  bool present = false;  // false: no "optimizer" section (the caller brings its own optimizer)
  // The row "type" names: "Adam" is adam even when adam_w_mode makes it run as adamw (optimizer_algo).
  optim::Algo type = optim::Algo::adamw;
  // values[i]: entry i of the row (flags as 0 or 1); fixed and ignored entries keep their default.
  std::array<double, optim::kMaxHyper> values{};

  OptimizerConfig() : OptimizerConfig(optim::Algo::adamw) {}
  explicit OptimizerConfig(optim::Algo type);  // the row's DeepSpeed defaults, present = false
  // The value of the entry named `key` (zero8's key such as "betas[1]", or DeepSpeed's such as "max_coeff");
  // throws invalid_argument when the row has no such entry.
  double get(const std::string& key) const;
  auto tie() const { return std::tie(present, type, values); }
};

enum class SchedulerType : uint8_t { none, warmup_lr, warmup_decay_lr, warmup_cosine_lr, one_cycle, lr_range_test };
const char* scheduler_type_name(SchedulerType t);  // "WarmupLR", ... ("" for none)
enum class WarmupType : uint8_t { log, linear };

// "scheduler": {"type": ..., "params": {...}}, with deepspeed/runtime/lr_schedules.py's defaults.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::none;
  // The optimizer's lr (optimizer.params.lr): WarmupCosineLR scales it, WarmupLR defaults
  // warmup_max_lr to it, no scheduler keeps it. Unset when the config has no optimizer section: the
  // caller then sets it with scheduler_set_base_lr from its own optimizer, as DeepSpeed reads the
  // client optimizer's lr.
  std::optional<double> base_lr;
  // WarmupLR, WarmupDecayLR
  double warmup_min_lr = 0.0;
  std::optional<double> warmup_max_lr;  // WarmupLR: base_lr when not given; WarmupDecayLR: 0.001
  // Whether the config gave warmup_max_lr: WarmupLR without one ramps each param group to its own lr
  // (DeepSpeed's), so the normalized config leaves it out and lr_schedules.py builds one per group.
  bool warmup_max_lr_given = false;
  int64_t warmup_num_steps = 1000;      // as given; the formulas use max(2, warmup_num_steps)
  WarmupType warmup_type = WarmupType::log;
  int64_t total_num_steps = 0;          // WarmupDecayLR, WarmupCosineLR (required there)
  // WarmupCosineLR
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle (cycle_min_lr and cycle_max_lr are required)
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  int64_t cycle_second_step_size = 2000;   // resolved: cycle_first_step_size when not given
  int64_t cycle_first_stair_count = 0;     // <= 0: continuous
  int64_t cycle_second_stair_count = 0;    // resolved: cycle_first_stair_count when not given
  int64_t decay_step_size = 0;             // 0: no decay after the cycle
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // Resolved: OneCycle cycles beta1 only when cycle_momentum is set and the optimizer has betas
  // (optimizer_has_betas); DeepSpeed then also pins beta2 to kOneCycleBeta2.
  bool momentum_cycled = false;
  // LRRangeTest
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
  auto tie() const {
    return std::tie(type, base_lr, warmup_min_lr, warmup_max_lr, warmup_max_lr_given, warmup_num_steps, warmup_type, total_num_steps,
                    warmup_min_ratio, cos_min_ratio, cycle_min_lr, cycle_max_lr, decay_lr_rate,
                    cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                    cycle_second_stair_count, decay_step_size, cycle_momentum, cycle_min_mom, cycle_max_mom,
                    decay_mom_rate, momentum_cycled, lr_range_test_min_lr, lr_range_test_step_size,
                    lr_range_test_step_rate, lr_range_test_staircase);
  }
};
constexpr double kOneCycleBeta2 = 0.99;  // DeepSpeed's OneCycle sets betas = (momentum, 0.99)

// "fp16" (DeepSpeedFP16Config). loss_scale 0 selects dynamic scaling.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;  // 0: no floor
  bool auto_cast = false;       // accepted; the caller decides how inputs are cast
  auto tie() const {
    return std::tie(enabled, loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis,
                    min_loss_scale, auto_cast);
  }
};

// "bf16" (or the old name "bfloat16").
struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
  bool check_grad_overflow = true;  // DeepSpeed 0.19.8's default; zero8 skips non-finite steps either way
  auto tie() const { return std::tie(enabled, immediate_grad_update, check_grad_overflow); }
};

// A dtype by DeepSpeed's names: "communication_data_type" and the dtypes of "data_types"; unset: not given.
enum class CommDataType : uint8_t { unset, fp32, fp16, bf16 };

// "data_types": how DeepSpeed's engine casts the module under fp16/bf16. The engine casts the parameters
// only; buffers keep their dtype unless buffer_dtype names one, and the buffers keep_in_fp32_modules
// names stay fp32 (engine/precision.py). param_dtype, when given, must be the training dtype (checked).
struct DataTypesConfig {
  CommDataType grad_accum_dtype = CommDataType::unset;  // accepted, no effect: zero8 accumulates in fp32
  CommDataType param_dtype = CommDataType::unset;
  CommDataType buffer_dtype = CommDataType::unset;
  std::optional<std::vector<std::string>> keep_in_fp32_modules;  // nullopt: "auto" (the model's own lists)
  auto tie() const { return std::tie(grad_accum_dtype, param_dtype, buffer_dtype, keep_in_fp32_modules); }
};

// zero8's default gradient bucket (DeepSpeed's: 5e8, one bucket for most models): 2^22 elements, 16 MiB
// of fp32, so that stage 2's reductions overlap backward and its gradient memory is the buckets in flight
// (torch DDP's default bucket is 25 MB). Also ShardConfig's default (sharded.h).
inline constexpr int64_t kDefaultReduceBucket = int64_t(1) << 22;

// "zero_optimization": stages 0..2 (3 is rejected), bucket sizes in elements.
struct ZeroConfig {
  int stage = 0;
  int64_t reduce_bucket_size = kDefaultReduceBucket;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = true;  // zero8's default; DeepSpeed's is true only for stage 3
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  bool allgather_partitions = true;
  bool round_robin_gradients = false;
  bool load_from_fp32_weights = true;
  bool ignore_unused_parameters = true;
  bool parameter_alignment = false;  // accepted, no effect (zero8 lays out its own partitions)
  bool compute_grad_norm = true;     // false: get_global_grad_norm() is None; needs gradient_clipping 0
  auto tie() const {
    return std::tie(stage, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients,
                    reduce_scatter, allgather_partitions, round_robin_gradients, load_from_fp32_weights,
                    ignore_unused_parameters, parameter_alignment, compute_grad_norm);
  }
};

enum class TagValidation : uint8_t { warn, ignore, fail };

// "checkpoint" (DeepSpeed's keys zero8 uses).
struct CheckpointConfig {
  TagValidation tag_validation = TagValidation::warn;
  bool load_universal = false;
  bool use_node_local_storage = false;
  auto tie() const { return std::tie(tag_validation, load_universal, use_node_local_storage); }
};

// "tensorboard" and "csv_monitor" (DeepSpeed's monitor/config.py): the engine's rank 0 writes the training
// events under output_path/job_name (output_path "" is the working directory, as in DeepSpeed).
struct MonitorOutputConfig {
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
  auto tie() const { return std::tie(enabled, output_path, job_name); }
};

// "wandb": the arguments of rank 0's wandb.init (team is its entity); unset group and team are wandb's own.
struct WandbConfig {
  bool enabled = false;
  std::optional<std::string> group;
  std::optional<std::string> team;
  std::string project = "deepspeed";
  auto tie() const { return std::tie(enabled, group, team, project); }
};

enum class CommBackend : uint8_t { automatic, mpi, single, nccl, tcp };  // "auto" | "mpi" | "single" | "nccl" | "tcp"

// "zero8": the 8-bit states and int8 communication. Present => enabled unless "enabled": false.
struct Zero8Config {
  bool enabled = false;
  int32_t state_block_size = 256;   // power of two in [64, 4096]
  int32_t wire_block_size = 2048;   // power of two in [64, 4096]
  bool int8_gradients = true;       // quantized reduce-scatter of gradients
  bool int8_params = true;          // quantized all-gather of parameter updates (int8 blocks of the delta)
  bool int8_activations = false;    // pipeline: activations and their gradients between stages as int8 blocks
  bool queued_stage_messages = false;  // pipeline over NCCL: stage messages queued on the stream (send_queued)
  bool error_feedback = false;      // carry the gradient quantization error to the next step
  bool release_gradients = false;   // stage 2: hand reduced gradient buckets' memory back to the OS
  bool overlap_param_gather = true;  // with overlap_comm: the step's all-gather runs during the next forward
  int64_t min_8bit_size = 4096;     // parameters with fewer elements keep fp32 states
  int optim_bits = 8;               // 8 or 32
  bool stochastic_rounding = false;
  uint64_t seed = 0;                // stochastic rounding stream
  CommBackend comm_backend = CommBackend::automatic;
  double comm_timeout_s = 600.0;    // torch's NCCL default (10 min), see comm_env.cpp
  int64_t checkpoint_keep_last = 0; // "checkpoint": {"keep_last": N}; 0 keeps all
  // "checkpoint": {"allow_pickle": true}: load_checkpoint may unpickle any object in the model-states
  // file (client_state as DeepSpeed pickles it), which can run code; else only tensors and plain values
  bool checkpoint_allow_pickle = false;
  auto tie() const {
    return std::tie(enabled, state_block_size, wire_block_size, int8_gradients, int8_params, int8_activations,
                    queued_stage_messages, error_feedback, release_gradients, overlap_param_gather, min_8bit_size, optim_bits, stochastic_rounding, seed, comm_backend, comm_timeout_s,
                    checkpoint_keep_last, checkpoint_allow_pickle);
  }
};

struct Config {
  int world_size = 1;  // the data-parallel size the batch triple was resolved with
  BatchConfig batch;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  double gradient_clipping = 1.0;  // max global gradient norm; 0: off (DeepSpeed's default, config.cpp)
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // DeepSpeed's: false makes step() the accumulation boundary (backwards only accumulate), see ENGINE.md.
  bool managed_gradient_accumulation = true;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  bool zero_allow_untested_optimizer = false;
  CommDataType communication_data_type = CommDataType::unset;
  DataTypesConfig data_types;
  ZeroConfig zero;
  CheckpointConfig checkpoint;
  MonitorOutputConfig tensorboard;
  MonitorOutputConfig csv_monitor;
  WandbConfig wandb;
  Zero8Config zero8;

  // Not part of the configuration (ignored by ==): where it came from, and the warnings the parse
  // produced ("<source>: <key path>: <message>") for the caller to print once, e.g. on rank 0.
  std::string source;
  std::vector<std::string> warnings;

  auto tie() const {
    return std::tie(world_size, batch, optimizer, scheduler, fp16, bf16, gradient_clipping, steps_per_print,
                    wall_clock_breakdown, managed_gradient_accumulation, prescale_gradients, gradient_predivide_factor,
                    zero_allow_untested_optimizer, communication_data_type, data_types, zero, checkpoint, tensorboard,
                    csv_monitor, wandb, zero8);
  }
};

#define ZERO8_CONFIG_EQ(T)                                                        \
  inline bool operator==(const T& a, const T& b) { return a.tie() == b.tie(); } \
  inline bool operator!=(const T& a, const T& b) { return !(a == b); }
ZERO8_CONFIG_EQ(BatchConfig)
ZERO8_CONFIG_EQ(OptimizerConfig)
ZERO8_CONFIG_EQ(SchedulerConfig)
ZERO8_CONFIG_EQ(Fp16Config)
ZERO8_CONFIG_EQ(Bf16Config)
ZERO8_CONFIG_EQ(DataTypesConfig)
ZERO8_CONFIG_EQ(ZeroConfig)
ZERO8_CONFIG_EQ(CheckpointConfig)
ZERO8_CONFIG_EQ(MonitorOutputConfig)
ZERO8_CONFIG_EQ(WandbConfig)
ZERO8_CONFIG_EQ(Zero8Config)
ZERO8_CONFIG_EQ(Config)
#undef ZERO8_CONFIG_EQ

// Parse and validate. world_size is the data-parallel size (>= 1). Throws zero8::Error whose message
// starts with "<source>: <key path>: " (invalid_argument for a bad value, unsupported for a valid
// DeepSpeed feature zero8 does not implement, io when the file cannot be read); malformed JSON is
// reported as "<source>:<line>:<column>: ...". Comments (// and /* */) are allowed, as DeepSpeed reads
// files with hjson. Unknown keys only add to Config::warnings; nothing is printed.
Config parse_file(const std::string& path, int world_size);
Config parse_string(const std::string& json_text, int world_size, const std::string& source_name = "<string>");
// The JSON text as plain JSON (comments removed), for readers that cannot skip comments; malformed
// JSON and duplicate keys throw as parse_string does.
std::string plain_json(const std::string& json_text, const std::string& source_name = "<string>");

// The normalized config: every key zero8 reads, with resolved values, in DeepSpeed's names (for
// checkpoint manifests). parse_string(to_json(c), c.world_size) == c, without warnings.
std::string to_json(const Config& c, int indent = 2);

// The learning rate DeepSpeed's scheduler sets when its last_batch_iteration is `last_batch_iteration`
// (-1: the value set at construction, before any scheduler.step()). DeepSpeed's engine steps the
// scheduler after each applied optimizer step, so applied optimizer step n (1-based) runs with
// lr_at(s, n - 2). With no scheduler: base_lr. Throws when a needed base_lr is unset.
double lr_at(const SchedulerConfig& s, int64_t last_batch_iteration);
// OneCycle's beta1 at the same point (requires s.momentum_cycled); beta2 is then kOneCycleBeta2.
double momentum_at(const SchedulerConfig& s, int64_t last_batch_iteration);
// For a config without an optimizer section: the client optimizer's lr (fills base_lr and an unset
// WarmupLR warmup_max_lr). No effect on what was already resolved.
void scheduler_set_base_lr(SchedulerConfig& s, double lr);

// Mappings onto the layers below.
// The algorithm that runs: the row's, or its decoupled form when its decouple entry is set (adam with
// adam_w_mode -> adamw, as DeepSpeed).
optim::Algo optimizer_algo(const OptimizerConfig& o);
// Hyperparameters at step 1 with the configured lr: each value entry into its Hyper field (LAMB's max_coeff
// -> max_trust_ratio, RMSprop's alpha -> beta2, ...); the fields the row does not name keep Hyper's defaults.
optim::Hyper optimizer_hyper(const OptimizerConfig& o);
bool optimizer_has_betas(optim::Algo type);  // the row reads "betas" (OneCycle cycles beta1 then)
int optimizer_state_bits(const Config& c);        // zero8 enabled: zero8.optim_bits; else 32
std::string optimizer_display_name(const Config& c);  // e.g. "AdamW8bit", "Lamb" (32-bit)
LossScalerConfig loss_scaler_config(const Config& c);  // fp16 rules; static scale 1 for bf16/fp32
DType working_dtype(const Config& c);                   // f16, bf16 or f32
shard::LayoutConfig layout_config(const Config& c);     // world, block sizes, min_8bit_size

}  // namespace zero8::config
