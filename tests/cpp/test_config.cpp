// DeepSpeed JSON config: real configs parse with DeepSpeed's defaults and rules, every malformed file
// in tests/data/configs/bad fails with its key path, unknown keys fail inside the sections zero8 reads
// (with the key meant) and warn at the top level, values beyond float32 fail as written, the LR schedules match
// lr_schedules.py at hand-computed points, and to_json round-trips.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "zero8/config.h"
#include "zero8/error.h"
#include "zero8/kernels/optim.h"

namespace cfg = zero8::config;
using zero8::ErrorCode;

namespace {

const std::string kConfigs = std::string(ZERO8_TEST_DATA_DIR) + "/configs/";

cfg::Config parse(const std::string& text, int world = 1) { return cfg::parse_string(text, world, "test.json"); }

// The error a parse raises (fails the test when there is none).
zero8::Error parse_error(const std::string& text, int world = 1) {
  try {
    parse(text, world);
  } catch (const zero8::Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error for: " << text;
  return zero8::Error(ErrorCode::internal, "");
}

bool has_warning(const cfg::Config& c, const std::string& sub) {
  for (const auto& w : c.warnings)
    if (w.find(sub) != std::string::npos) return true;
  return false;
}

std::string all_warnings(const cfg::Config& c) {
  std::string s;
  for (const auto& w : c.warnings) s += w + "\n";
  return s;
}

const char* code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::io: return "io";
    case ErrorCode::comm: return "comm";
    case ErrorCode::internal: return "internal";
  }
  return "?";
}

// Schedules are plain double arithmetic in the same order as lr_schedules.py; the expected values
// below are closed forms derived by hand, so the two differ only by the rounding of a handful of
// double operations (a few ulps, 2.2e-16 each): 1e-14 relative leaves a 45-ulp margin and still
// catches any formula error, which shows at the 1e-3 level or above.
constexpr double kRel = 1e-14;
#define EXPECT_LR(actual, expected) EXPECT_NEAR((actual), (expected), kRel * std::fabs(expected) + 1e-300)

}  // namespace

// ------------------------------------------------------------------------------------------------
// Batch triple: train_batch_size = micro * gas * world, any two derive the third.

TEST(ConfigBatch, AllThreeConsistent) {
  const auto c = parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 2})", 4);
  EXPECT_EQ(c.batch.train_batch_size, 32);
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 2);
}

TEST(ConfigBatch, AnyTwoDeriveTheThird) {
  auto c = parse(R"({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4})", 3);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 4);  // 48 / (4 * 3)
  c = parse(R"({"train_batch_size": 48, "gradient_accumulation_steps": 2})", 3);
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 8);  // 48 / (2 * 3)
  c = parse(R"({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3})", 2);
  EXPECT_EQ(c.batch.train_batch_size, 30);  // 5 * 3 * 2
}

TEST(ConfigBatch, OneAloneFollowsDeepSpeed) {
  // train_batch_size alone: gas = 1, micro = tbs / world.
  auto c = parse(R"({"train_batch_size": 64})", 4);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 16);
  // micro alone: gas = 1, tbs = micro * world.
  c = parse(R"({"train_micro_batch_size_per_gpu": 6})", 4);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.batch.train_batch_size, 24);
}

TEST(ConfigBatch, ErrorsNameKeysAndValues) {
  auto e = parse_error(R"({"train_batch_size": 30})", 4);
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  EXPECT_NE(std::string(e.what()).find("test.json: train_batch_size: 30 is not divisible by world_size 4"),
            std::string::npos) << e.what();
  e = parse_error(R"({"train_batch_size": 50, "gradient_accumulation_steps": 4})", 3);
  EXPECT_NE(std::string(e.what()).find("50 is not divisible by gradient_accumulation_steps 4 * world_size 3 = 12"),
            std::string::npos) << e.what();
  e = parse_error(R"({})");
  EXPECT_NE(std::string(e.what()).find("train_batch_size: missing"), std::string::npos) << e.what();
  e = parse_error(R"({"gradient_accumulation_steps": 2})");
  EXPECT_NE(std::string(e.what()).find("gradient_accumulation_steps alone"), std::string::npos) << e.what();
  // Integral floats are integers (5e8-style values are common in DeepSpeed configs).
  EXPECT_EQ(parse(R"({"train_batch_size": 6.4e1})", 2).batch.train_micro_batch_size_per_gpu, 32);
  EXPECT_THROW(cfg::parse_string("{\"train_batch_size\": 8}", 0), zero8::Error);  // world_size must be >= 1
}

// ------------------------------------------------------------------------------------------------
// Real DeepSpeed configs.

TEST(ConfigFiles, BertFp16AdamWarmupDecay) {
  const auto c = cfg::parse_file(kConfigs + "bert_fp16_adam_warmup_decay.json", 4);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 2);  // 256 / (32 * 4)
  EXPECT_EQ(c.steps_per_print, 100);
  ASSERT_TRUE(c.optimizer.present);
  EXPECT_EQ(c.optimizer.type, zero8::optim::Algo::adam);
  EXPECT_EQ(c.optimizer.get("lr"), 4e-4);
  EXPECT_EQ(c.optimizer.get("eps"), 1e-6);
  EXPECT_FALSE(c.optimizer.get("bias_correction"));
  // "Adam" runs DeepSpeed's default adam_w_mode = true: decoupled weight decay.
  EXPECT_TRUE(c.optimizer.get("adam_w_mode"));
  EXPECT_EQ(cfg::optimizer_algo(c.optimizer), zero8::optim::Algo::adamw);
  EXPECT_EQ(c.scheduler.type, cfg::SchedulerType::warmup_decay_lr);
  EXPECT_EQ(c.scheduler.warmup_type, cfg::WarmupType::linear);
  EXPECT_EQ(c.scheduler.total_num_steps, 1000000);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.zero.stage, 1);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);  // the file
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.zero8.enabled);
  EXPECT_EQ(cfg::optimizer_state_bits(c), 32);
  EXPECT_EQ(cfg::working_dtype(c), zero8::DType::f16);
  const auto ls = cfg::loss_scaler_config(c);
  EXPECT_TRUE(ls.dynamic);
  EXPECT_EQ(ls.initial_scale_power, 16);
  EXPECT_EQ(ls.scale_window, 1000);
  EXPECT_EQ(ls.hysteresis, 2);
  EXPECT_EQ(ls.min_scale, 1.0);
}

TEST(ConfigFiles, Zero2Fp16AdamWWithCommentsAndAuto) {
  const auto c = cfg::parse_file(kConfigs + "zero2_fp16_adamw_warmup.json", 2);
  EXPECT_EQ(c.batch.train_batch_size, 64);  // 8 * 4 * 2
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.zero.reduce_bucket_size, 200000000);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_TRUE(c.zero.round_robin_gradients);
  EXPECT_EQ(c.optimizer.type, zero8::optim::Algo::adamw);
  EXPECT_EQ(c.scheduler.type, cfg::SchedulerType::warmup_lr);
  EXPECT_EQ(c.scheduler.warmup_type, cfg::WarmupType::log);  // DeepSpeed's default
  // bf16.enabled "auto": DeepSpeed's pydantic section drops it, so the default (false) applies; noted.
  EXPECT_FALSE(c.bf16.enabled);
  ASSERT_EQ(c.warnings.size(), 1u) << all_warnings(c);
  EXPECT_TRUE(has_warning(c, "zero2_fp16_adamw_warmup.json: bf16.enabled: \"auto\" is not resolved here"));
}

TEST(ConfigFiles, Bf16AdamWCosineZero2) {
  const auto c = cfg::parse_file(kConfigs + "bf16_adamw_cosine_zero2.json", 8);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 8);  // 512 / (8 * 8)
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(cfg::working_dtype(c), zero8::DType::bf16);
  EXPECT_FALSE(cfg::loss_scaler_config(c).dynamic);
  EXPECT_EQ(cfg::loss_scaler_config(c).static_scale, 1.0);
  EXPECT_EQ(c.optimizer.get("betas[1]"), 0.95);
  EXPECT_EQ(c.scheduler.type, cfg::SchedulerType::warmup_cosine_lr);
  EXPECT_EQ(c.scheduler.base_lr, 6e-4);
  EXPECT_EQ(c.scheduler.cos_min_ratio, 0.1);
  EXPECT_EQ(c.communication_data_type, cfg::CommDataType::bf16);
  EXPECT_EQ(c.checkpoint.tag_validation, cfg::TagValidation::fail);
  const auto h = cfg::optimizer_hyper(c.optimizer);
  EXPECT_EQ(h.lr, 6e-4f);
  EXPECT_EQ(h.beta2, 0.95f);
  EXPECT_EQ(h.weight_decay, 0.1f);
}

TEST(ConfigFiles, Zero8LambOneCycle) {
  const auto c = cfg::parse_file(kConfigs + "zero8_lamb_onecycle.json", 2);
  ASSERT_EQ(c.warnings.size(), 1u) << all_warnings(c);  // the stairs DeepSpeed would ignore
  EXPECT_TRUE(has_warning(c, "scheduler.params.cycle_first_stair_count: staircase applied"));
  EXPECT_TRUE(c.zero8.enabled);  // the section turns zero8 on
  EXPECT_TRUE(c.zero8.int8_params);
  EXPECT_TRUE(c.zero8.error_feedback);
  EXPECT_TRUE(c.zero8.overlap_param_gather);  // the default
  EXPECT_EQ(c.zero8.min_8bit_size, 16384);
  EXPECT_EQ(c.zero8.comm_backend, cfg::CommBackend::mpi);
  EXPECT_EQ(c.zero8.comm_timeout_s, 120.0);
  EXPECT_EQ(c.zero8.checkpoint_keep_last, 3);
  EXPECT_EQ(cfg::optimizer_state_bits(c), 8);
  EXPECT_EQ(cfg::optimizer_display_name(c), "LAMB8bit");
  EXPECT_EQ(cfg::optimizer_algo(c.optimizer), zero8::optim::Algo::lamb);
  EXPECT_EQ(cfg::optimizer_hyper(c.optimizer).max_trust_ratio, 0.3f);
  EXPECT_EQ(c.scheduler.type, cfg::SchedulerType::one_cycle);
  EXPECT_EQ(c.scheduler.cycle_second_stair_count, 500);  // defaults to the first stair count
  EXPECT_TRUE(c.scheduler.momentum_cycled);                // Lamb has betas
  const auto l = cfg::layout_config(c);
  EXPECT_EQ(l.world, 2);
  EXPECT_EQ(l.state_block, 256);
  EXPECT_EQ(l.wire_block, 2048);
  EXPECT_EQ(l.min_8bit_size, 16384);
}

TEST(ConfigFiles, Zero1SgdNesterov) {
  const auto c = cfg::parse_file(kConfigs + "zero1_sgd_nesterov.json", 8);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 128);
  EXPECT_EQ(c.optimizer.type, zero8::optim::Algo::sgd);
  EXPECT_TRUE(c.optimizer.get("nesterov"));
  const auto h = cfg::optimizer_hyper(c.optimizer);
  EXPECT_EQ(h.beta1, 0.9f);  // sgd momentum travels in beta1
  EXPECT_TRUE(h.nesterov);
  EXPECT_EQ(cfg::optimizer_display_name(c), "SGD8bit");
  // WarmupLR without warmup_max_lr ramps to the optimizer's lr (DeepSpeed reads the group lr).
  EXPECT_EQ(c.scheduler.warmup_max_lr, 0.4);
  EXPECT_FALSE(c.scheduler.warmup_max_lr_given);  // left out of the normalized config: each group its own
  EXPECT_EQ(c.zero8.state_block_size, 2048);
  EXPECT_EQ(c.zero8.wire_block_size, 4096);
  EXPECT_FALSE(c.zero8.int8_gradients);
}

TEST(ConfigFiles, MissingFileIsAnIoError) {
  try {
    cfg::parse_file(kConfigs + "does_not_exist.json", 1);
    FAIL() << "no error";
  } catch (const zero8::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("does_not_exist.json: cannot open"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------------------------
// Every malformed file fails with its code and a message carrying the key path (the table is shared
// with the Python tests).

TEST(ConfigErrors, MalformedFiles) {
  std::ifstream in(kConfigs + "bad/expected.tsv");
  ASSERT_TRUE(in) << "missing bad/expected.tsv";
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, '\t')) f.push_back(cell);
    ASSERT_EQ(f.size(), 4u) << line;
    const std::string path = kConfigs + "bad/" + f[0];
    SCOPED_TRACE(f[0]);
    ++n;
    try {
      cfg::parse_file(path, std::stoi(f[1]));
      ADD_FAILURE() << "no error";
    } catch (const zero8::Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(code_name(e.code()), f[2]) << msg;
      EXPECT_NE(msg.find(f[3]), std::string::npos) << "message: " << msg << "\nexpected to contain: " << f[3];
      EXPECT_EQ(msg.rfind(path, 0), 0u) << "the message starts with the file: " << msg;
    }
  }
  EXPECT_GE(n, 35);
}

TEST(ConfigErrors, NestedTypesAndValues) {
  auto e = parse_error(R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, "x"]}}})");
  EXPECT_STREQ(e.what(), "test.json: optimizer.params.betas[1]: expected a number in [0, 1), got \"x\"");
  e = parse_error(R"({"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "nvme"}}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_NE(std::string(e.what()).find("zero_optimization.offload_param.device"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("keeps the parameters on every rank"), std::string::npos) << e.what();
  e = parse_error(R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  EXPECT_NE(std::string(e.what()).find("8-bit states already cut optimizer memory"), std::string::npos) << e.what();
  e = parse_error(R"({"train_batch_size": 8, "checkpoint": {"use_node_local_storage": true}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_NE(std::string(e.what()).find("test.json: checkpoint.use_node_local_storage: true is not supported by zero8: "
                                       "every rank must see the same file system"),
            std::string::npos) << e.what();
  e = parse_error(R"({"train_batch_size": 8, "gradient_clipping": "auto"})");
  EXPECT_NE(std::string(e.what()).find("test.json: gradient_clipping: \"auto\" is filled in by the Hugging Face"),
            std::string::npos) << e.what();
  e = parse_error(R"({"train_batch_size": 8, "gradient_clipping": -1})");
  EXPECT_STREQ(e.what(), "test.json: gradient_clipping: expected a number >= 0, got -1");
  e = parse_error(R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": -2}})");
  EXPECT_STREQ(e.what(), "test.json: fp16.loss_scale: expected a number >= 0, got -2");
  e = parse_error(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"min_coeff": 20}}})");
  EXPECT_NE(std::string(e.what()).find("optimizer.params.min_coeff: expected <= max_coeff 10"), std::string::npos);
  e = parse_error(R"({"train_batch_size": 8, "zero_optimization": {"cpu_offload": true}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  // Several settings zero8 does not support are named in one error, in the order zero8 reads them (a
  // ported config used to fail on each in turn: fp16_master_weights_and_grads, cpu_offload, ...).
  e = parse_error(R"({"train_batch_size": 8, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true},
                      "zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}},
                      "checkpoint": {"use_node_local_storage": true}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("test.json: 4 settings zero8 does not support:\n  (1) fp16.fp16_master_weights_and_grads: ", 0),
              0u) << m;
    size_t at = 0;
    for (const char* path : {"(2) zero_optimization.offload_optimizer.device: ", "(3) zero_optimization.cpu_offload: ",
                             "(4) checkpoint.use_node_local_storage: "}) {
      const size_t p = m.find(path);
      EXPECT_NE(p, std::string::npos) << path << " in " << m;
      EXPECT_GT(p, at) << path << " in " << m;
      at = p;
    }
  }
  // A value zero8 cannot read still fails at once, before the list.
  e = parse_error(R"({"train_batch_size": 8, "zero_optimization": {"cpu_offload": true}, "gradient_clipping": -1})");
  EXPECT_STREQ(e.what(), "test.json: gradient_clipping: expected a number >= 0, got -1");
  e = parse_error(R"({"train_batch_size": 8, "elasticity": {"enabled": true}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  // torch_autocast changes the precision like amp does: refused, not warned about and trained in fp32.
  e = parse_error(R"({"train_batch_size": 8, "torch_autocast": {"enabled": true, "dtype": "bfloat16"}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_NE(std::string(e.what()).find("test.json: torch_autocast: DeepSpeed's torch.autocast mode is not supported"),
            std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("use the \"bf16\" or \"fp16\" section"), std::string::npos) << e.what();
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "torch_autocast": {"enabled": false}})").warnings.size(), 0u);
  e = parse_error(R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"amsgrad": true}}})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  e = parse_error(R"({"train_batch_size": 8, "optimizer": {"type": 3}})");
  EXPECT_STREQ(e.what(), "test.json: optimizer.type: expected a string, got 3");
}

// DeepSpeed's "sum" reduces gradients to world_size times the mean zero8 computes: refused, not ignored.
TEST(ConfigErrors, GradientAllreduceOpSumIsRefused) {
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "gradient_allreduce_op": "mean"})").warnings.size(), 0u);
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "gradient_allreduce_op": "MEAN"})").warnings.size(), 0u);
  auto e = parse_error(R"({"train_batch_size": 8, "gradient_allreduce_op": "sum"})");
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_NE(std::string(e.what()).find("test.json: gradient_allreduce_op: \"sum\" is not supported: zero8 averages "
                                       "gradients over the data-parallel ranks"),
            std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("scale the learning rate by the data-parallel world size"), std::string::npos)
      << e.what();
  e = parse_error(R"({"train_batch_size": 8, "gradient_allreduce_op": "max"})");
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  EXPECT_STREQ(e.what(), "test.json: gradient_allreduce_op: expected one of \"mean\", \"sum\" (DeepSpeed's choices), "
                         "got \"max\"");
  e = parse_error(R"({"train_batch_size": 8, "gradient_allreduce_op": 1})");
  EXPECT_STREQ(e.what(), "test.json: gradient_allreduce_op: expected a string, got 1");
}

// zero8 is data-parallel only: a sequence- or tensor-parallel degree above 1 is refused (the batch rule would
// count those ranks as data-parallel); 1 is what zero8 does and stays silent.
TEST(ConfigErrors, SequenceAndTensorParallelDegreesAboveOneAreRefused) {
  const auto one = parse(R"({"train_batch_size": 8, "sequence_parallel_size": 1,
                             "tensor_parallel": {"autotp_size": 1, "tp": {"tp_size": 1}}})", 4);
  EXPECT_EQ(one.warnings.size(), 0u) << all_warnings(one);
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {R"("sequence_parallel_size": 2)", "sequence_parallel_size"},
           {R"("tensor_parallel": {"autotp_size": 2})", "tensor_parallel.autotp_size"},
           {R"("tensor_parallel": {"tp_size": 4})", "tensor_parallel.tp_size"},
           {R"("tensor_parallel": {"tp": {"tp_size": 2}})", "tensor_parallel.tp.tp_size"}}) {
    const auto e = parse_error(R"({"train_batch_size": 8, )" + text + "}", 4);
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << text;
    EXPECT_NE(std::string(e.what()).find("test.json: " + key + ": a "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("zero8 is data-parallel only"), std::string::npos) << e.what();
  }
}

TEST(ConfigErrors, HuggingFaceAutoValuesAreListedInOneError) {
  // A Hugging Face Trainer config before the Trainer fills it in: one error names every "auto" the
  // user has to replace, not one per run. The pydantic sections' "auto" (fp16, bf16, zero_optimization)
  // are not listed: they take the default with a warning.
  const auto e = parse_error(R"({
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8, "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "zero8": {"comm_backend": "auto"}
  })");
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  const std::string m = e.what();
  EXPECT_EQ(m.rfind("test.json: train_batch_size: \"auto\" is filled in by the Hugging Face", 0), 0u) << m;
  EXPECT_NE(m.find("\"auto\" also at: optimizer.params.lr, optimizer.params.betas, optimizer.params.weight_decay, "
                   "scheduler.params.warmup_min_lr, scheduler.params.warmup_max_lr, scheduler.params.warmup_num_steps, "
                   "scheduler.params.total_num_steps, gradient_accumulation_steps, gradient_clipping, "
                   "train_micro_batch_size_per_gpu"),
            std::string::npos) << m;
  EXPECT_EQ(m.find("fp16.enabled"), std::string::npos) << m;
  EXPECT_EQ(m.find("reduce_bucket_size"), std::string::npos) << m;
  EXPECT_EQ(m.find("comm_backend"), std::string::npos) << m;  // one of its own values there
  // A single "auto" keeps the short message.
  const auto one = parse_error(R"({"train_batch_size": 8, "gradient_clipping": "auto"})");
  EXPECT_EQ(std::string(one.what()).find("also at"), std::string::npos) << one.what();
}

TEST(ConfigErrors, MalformedJsonLineAndColumn) {
  // Line 3 holds `"b": }`: the parser stops at the '}' (column 8).
  auto e = parse_error("{\n  \"a\": 1,\n  \"b\": }\n");
  EXPECT_EQ(std::string(e.what()).rfind("test.json:3:8: malformed JSON: ", 0), 0u) << e.what();
  // Unterminated input: reported at the end (line 2, after the last character).
  e = parse_error("{\"train_batch_size\": 8,\n \"x\": [1, 2");
  EXPECT_EQ(std::string(e.what()).rfind("test.json:2:12: malformed JSON: ", 0), 0u) << e.what();
  e = parse_error("");
  EXPECT_EQ(std::string(e.what()).rfind("test.json:1:1: malformed JSON: ", 0), 0u) << e.what();
  // Comments are accepted (DeepSpeed reads files with hjson).
  EXPECT_EQ(parse("/* batch */ {\"train_batch_size\": 8 // global\n}").batch.train_batch_size, 8);
}

// ------------------------------------------------------------------------------------------------
// Unknown keys: an error inside a section zero8 reads (the key meant, when one is close), a warning at
// the top level (DeepSpeed ignores those), except a near miss of a section zero8 reads.

TEST(ConfigWarnings, UnknownTopLevelKeysWarnWithPath) {
  const auto c = parse(R"({
    "train_batch_size": 8,
    "my_custom_key": 1,
    "fp16": {"enabled": true},
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9}
  })");
  EXPECT_TRUE(has_warning(c, "test.json: my_custom_key: unknown key, ignored (DeepSpeed ignores"));
  EXPECT_TRUE(has_warning(c, "test.json: zero_optimization.reduce_bucket_size: \"auto\""));
  EXPECT_EQ(c.zero.reduce_bucket_size, 4194304);
  // stage3_* keys are DeepSpeed's own and silently accepted.
  EXPECT_FALSE(has_warning(c, "stage3_max_live_parameters"));
  EXPECT_EQ(c.warnings.size(), 2u) << all_warnings(c);
}

// A misspelt key used to warn and then train with the default of the key meant: another job than the
// one written (the ZeRO stage, int8 gradients, a whole zero8 section).
TEST(ConfigErrors, UnknownKeysInKnownSectionsFailWithTheKeyMeant) {
  const struct {
    const char* config;
    const char* error;
  } cases[] = {
      {R"({"train_batch_size": 8, "zero_optimization": {"stgae": 2}})",
       "test.json: zero_optimization.stgae: unknown key; did you mean \"stage\"? (DeepSpeed rejects unknown "
       "zero_optimization keys too)"},
      {R"({"train_batch_size": 8, "zero8": {"int8_gradeints": false}})",
       "test.json: zero8.int8_gradeints: unknown key; did you mean \"int8_gradients\"?"},
      {R"({"train_batch_size": 8, "zer08": {"optim_bits": 8}})",
       "test.json: zer08: unknown top-level key; did you mean \"zero8\"?"},
      {R"({"train_batch_size": 8, "zero_optimisation": {"stage": 2}})",
       "test.json: zero_optimisation: unknown top-level key; did you mean \"zero_optimization\"?"},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scael": 128}})",
       "test.json: fp16.loss_scael: unknown key; did you mean \"loss_scale\"?"},
      {R"({"train_batch_size": 8, "bf16": {"Enabled": true}})", "test.json: bf16.Enabled: unknown key; did you mean \"enabled\"?"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "beta": [0.9, 0.95]}}})",
       "test.json: optimizer.params.beta: unknown key; did you mean \"betas\"? (DeepSpeed would pass it to the AdamW "
       "constructor, which rejects unknown arguments)"},
      // adam_w_mode belongs in params: at this level DeepSpeed would ignore it and keep the default (true).
      {R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "adam_w_mode": false, "params": {}}})",
       "test.json: optimizer.adam_w_mode: unknown key (the keys zero8 reads here: type, legacy_fusion, params)"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}})",
       "test.json: optimizer.params.betas: unknown key ("},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})",
       "test.json: scheduler.params.warmup_num_step: unknown key; did you mean \"warmup_num_steps\"?"},
      {R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "none", "pin_memroy": true}}})",
       "test.json: zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean \"pin_memory\"?"},
      {R"({"train_batch_size": 8, "checkpoint": {"tag_validaton": "Fail"}})",
       "test.json: checkpoint.tag_validaton: unknown key; did you mean \"tag_validation\"?"},
      {R"({"train_batch_size": 8, "zero8": {"checkpoint": {"keep": 2}}})",
       "test.json: zero8.checkpoint.keep: unknown key (the keys zero8 reads here: keep_last, allow_pickle)"},
      {R"({"train_batch_size": 8, "zero8": {"state_block": 128}})",
       "test.json: zero8.state_block: unknown key (the keys zero8 reads here: enabled, state_block_size, "},
  };
  for (const auto& c : cases) {
    const zero8::Error e = parse_error(c.config);
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << c.config;
    EXPECT_EQ(std::string(e.what()).rfind(c.error, 0), 0u) << e.what();
  }
  // The keys of DeepSpeed's sections that zero8 ignores are still accepted without a word.
  const auto ok = parse(R"({"train_batch_size": 8,
      "zero_optimization": {"stage": 2, "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e8,
                            "offload_param": {"device": "none", "pin_memory": true}},
      "fp16": {"enabled": true, "fused_mode": true}, "checkpoint": {"parallel_write": {}},
      "optimizer": {"type": "AdamW", "legacy_fusion": false, "params": {"lr": 0.01, "foreach": true}}})");
  EXPECT_TRUE(ok.warnings.empty()) << all_warnings(ok);
}

// A number float32 cannot hold would become inf (or 0) in the kernels: the error names the file, the key
// and the value as the file writes it (not its double or float32 rounding), and no C++ source path.
TEST(ConfigErrors, ValuesBeyondFloat32FailWithTheValueAsWritten) {
  const struct {
    const char* config;
    const char* error;
  } cases[] = {
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e39}}})",
       "test.json: optimizer.params.lr: expected a number >= 0 that float32 can hold"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"eps": 1E-50}}})",
       "test.json: optimizer.params.eps: expected a number >= 0 that float32 can hold"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"max_coeff": 4e38}}})",
       "test.json: optimizer.params.max_coeff: expected a number > 0 that float32 can hold"},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3.5e38}}})",
       "test.json: scheduler.params.warmup_max_lr: expected a number >= 0 that float32 can hold"},
      {R"({"train_batch_size": 8, "gradient_clipping": 1.0e+40})",
       "test.json: gradient_clipping: expected a number >= 0 that float32 can hold"},
  };
  const char* const written[] = {"got 1e39", "got 1E-50", "got 4e38", "got 3.5e38", "got 1.0e+40"};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const zero8::Error e = parse_error(cases[i].config);
    const std::string what = e.what();
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << what;
    EXPECT_EQ(what.rfind(cases[i].error, 0), 0u) << what;
    EXPECT_EQ(what.size() - what.rfind(written[i]), std::string(written[i]).size()) << what;  // ends with it
    EXPECT_EQ(what.find(".cpp"), std::string::npos) << what;
  }
  // Other value errors quote the number as written too (a double would print 1e+30 and 1.5000000000000000001).
  auto e = parse_error(R"({"train_batch_size": 1e30})");
  EXPECT_STREQ(e.what(), "test.json: train_batch_size: expected an integer >= 1, got 1e30");
  e = parse_error(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5000000000000000001]}}})");
  EXPECT_STREQ(e.what(), "test.json: optimizer.params.betas[1]: expected a number in [0, 1), got 1.5000000000000000001");
  // The largest float32 and the smallest subnormal are fine, and so is a timeout kept in double.
  const auto ok = parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"lr": 3.4028234e38, "eps": 1.5e-45}}, "zero8": {"comm_timeout_s": 1e300}})");
  EXPECT_EQ(float(ok.optimizer.get("lr")), 3.4028234e38f);
  EXPECT_GT(float(ok.optimizer.get("eps")), 0.0f);
}

TEST(ConfigWarnings, IgnoredFeaturesAndDeepSpeedQuirks) {
  const auto c = parse(R"({
    "train_batch_size": 8,
    "sparse_attention": {"mode": "fixed"},
    "progressive_layer_drop": {"enabled": true, "theta": 0.5},
    "zero_optimization": {"stage": 1, "zero_quantized_gradients": true},
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}
  })");
  EXPECT_TRUE(has_warning(c, "sparse_attention: not implemented by zero8"));
  EXPECT_TRUE(has_warning(c, "progressive_layer_drop: not implemented by zero8"));
  EXPECT_TRUE(has_warning(c, "zero_optimization.zero_quantized_gradients: ZeRO++"));
  // SGD has no betas: DeepSpeed's OneCycle turns momentum cycling off with a warning.
  EXPECT_FALSE(c.scheduler.momentum_cycled);
  EXPECT_TRUE(has_warning(c, "scheduler.params.cycle_momentum: momentum is not cycled: SGD has no betas"));
  // OneCycle takes no warmup_type: DeepSpeed's constructor would reject it.
  EXPECT_EQ(std::string(parse_error(R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params":
      {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "warmup_type": "linear"}}})").what()).rfind(
                "test.json: scheduler.params.warmup_type: unknown key (", 0), 0u);
  // An unknown warmup_type falls back to log, as lr_schedules.py does.
  const auto d = parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})");
  EXPECT_EQ(d.scheduler.warmup_type, cfg::WarmupType::log);
  EXPECT_TRUE(has_warning(d, "scheduler.params.warmup_type: unknown value \"cosine\""));
  // The deprecated boolean ZeRO form means stage 1.
  const auto z = parse(R"({"train_batch_size": 8, "zero_optimization": true, "allgather_size": 1e6})");
  EXPECT_EQ(z.zero.stage, 1);
  EXPECT_EQ(z.zero.allgather_bucket_size, 1000000);
  EXPECT_TRUE(has_warning(z, "zero_optimization: the boolean form is deprecated"));
}

// The monitor and profilers zero8 does not implement warn once, naming the enabled ones; the monitors it
// writes (tensorboard, csv_monitor, wandb) and disabled ones are silent.
TEST(ConfigWarnings, EnabledMonitorsWarnOnce) {
  const auto c = parse(R"({"train_batch_size": 8,
    "tensorboard": {"enabled": true, "output_path": "logs/"}, "wandb": {"enabled": true},
    "csv_monitor": {"enabled": false, "output_path": "csv/"}, "flops_profiler": {"enabled": true},
    "comet": {"enabled": false}, "comms_logger": {"enabled": true}})");
  ASSERT_EQ(c.warnings.size(), 1u) << all_warnings(c);
  EXPECT_EQ(c.warnings[0], "test.json: flops_profiler, comms_logger: enabled, but zero8 does not implement this "
                           "DeepSpeed monitor or profiler: it writes nothing for it (zero8 writes the tensorboard, "
                           "csv_monitor and wandb monitors only)");
  const auto off = parse(R"({"train_batch_size": 8, "tensorboard": {"enabled": false}, "wandb": {},
                             "csv_monitor": {"enabled": false}, "comet": {"enabled": false}})");
  EXPECT_EQ(off.warnings.size(), 0u) << all_warnings(off);
}

// The monitors' keys, types and defaults are DeepSpeed's (monitor/config.py); to_json writes them back.
TEST(ConfigMonitors, DeepSpeedKeysAndDefaults) {
  const auto d = parse(R"({"train_batch_size": 8})");
  for (const cfg::MonitorOutputConfig* m : {&d.tensorboard, &d.csv_monitor}) {
    EXPECT_FALSE(m->enabled);
    EXPECT_EQ(m->output_path, "");
    EXPECT_EQ(m->job_name, "DeepSpeedJobName");
  }
  EXPECT_FALSE(d.wandb.enabled);
  EXPECT_FALSE(d.wandb.group.has_value());
  EXPECT_FALSE(d.wandb.team.has_value());
  EXPECT_EQ(d.wandb.project, "deepspeed");

  const auto c = parse(R"({"train_batch_size": 8,
    "tensorboard": {"enabled": true, "output_path": "tb/", "job_name": "bert"},
    "csv_monitor": {"enabled": true, "job_name": "auto"},
    "wandb": {"enabled": true, "group": "g", "team": "t", "project": "p"}})");
  EXPECT_TRUE(c.tensorboard.enabled && c.csv_monitor.enabled && c.wandb.enabled);
  EXPECT_EQ(c.tensorboard.output_path, "tb/");
  EXPECT_EQ(c.tensorboard.job_name, "bert");
  EXPECT_EQ(c.csv_monitor.job_name, "DeepSpeedJobName");  // "auto" takes the default, as DeepSpeed drops it
  EXPECT_TRUE(has_warning(c, "csv_monitor.job_name: \"auto\" is not resolved here"));
  EXPECT_EQ(c.wandb.group.value_or(""), "g");
  EXPECT_EQ(c.wandb.team.value_or(""), "t");
  EXPECT_EQ(c.wandb.project, "p");
  const auto back = parse(cfg::to_json(c));
  EXPECT_TRUE(back == c);
  EXPECT_TRUE(parse(cfg::to_json(d)) == d);  // unset group and team come back unset
}

TEST(ConfigMonitors, BadValuesNameTheKey) {
  auto error = [](const char* body) {
    return std::string(parse_error(std::string(R"({"train_batch_size": 8, )") + body + "}").what());
  };
  EXPECT_EQ(error(R"("tensorboard": {"enabled": "yes"})"),
            "test.json: tensorboard.enabled: expected a boolean (true or false), got \"yes\"");
  EXPECT_EQ(error(R"("csv_monitor": {"output_path": 5})"), "test.json: csv_monitor.output_path: expected a string, got 5");
  EXPECT_EQ(error(R"("wandb": {"team": ["a"]})"), "test.json: wandb.team: expected a string, got [\"a\"]");
  EXPECT_EQ(error(R"("wandb": "on")"), "test.json: wandb: expected an object, got \"on\"");
  EXPECT_EQ(error(R"("tensorboard": {"enabled": true, "job_nme": "x"})"),
            "test.json: tensorboard.job_nme: unknown key; did you mean \"job_name\"? (DeepSpeed's monitor config "
            "rejects unknown keys too)");
  // wandb.init's own name for the team is not one of DeepSpeed's keys.
  EXPECT_EQ(error(R"("wandb": {"entity": "x"})"),
            "test.json: wandb.entity: unknown key (the keys zero8 reads here: enabled, group, team, project) "
            "(DeepSpeed's monitor config rejects unknown keys too)");
}

// ------------------------------------------------------------------------------------------------
// Optimizer mapping: DeepSpeed's type semantics and defaults.

TEST(ConfigOptimizer, AdamWModeFollowsDeepSpeed) {
  auto algo = [](const char* opt) {
    return cfg::optimizer_algo(parse(std::string(R"({"train_batch_size": 8, "optimizer": )") + opt + "}").optimizer);
  };
  EXPECT_EQ(algo(R"({"type": "Adam"})"), zero8::optim::Algo::adamw);  // adam_w_mode defaults to true
  EXPECT_EQ(algo(R"({"type": "Adam", "params": {"adam_w_mode": false}})"), zero8::optim::Algo::adam);
  EXPECT_EQ(algo(R"({"type": "AdamW", "params": {"adam_w_mode": false}})"), zero8::optim::Algo::adamw);
  EXPECT_EQ(algo(R"({"type": "adamw"})"), zero8::optim::Algo::adamw);  // case-insensitive, as DeepSpeed
  EXPECT_EQ(algo(R"({"type": "LION"})"), zero8::optim::Algo::lion);
  EXPECT_EQ(algo(R"({"type": "rmsprop"})"), zero8::optim::Algo::rmsprop);
  EXPECT_EQ(algo(R"({"type": "Adagrad"})"), zero8::optim::Algo::adagrad);
  EXPECT_EQ(algo(R"({"type": "LARS", "params": {"momentum": 0.9}})"), zero8::optim::Algo::lars);
}

// DeepSpeed clips at 1.0 when the config does not say (its PR #8068; it was off before); 0 turns it off.
// managed_gradient_accumulation is true unless false is written, and false is written back.
TEST(ConfigDeepSpeedDefaults, GradientClippingAndManagedAccumulation) {
  const cfg::Config d = parse(R"({"train_batch_size": 8})");
  EXPECT_EQ(d.gradient_clipping, 1.0);
  EXPECT_TRUE(d.managed_gradient_accumulation);
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "gradient_clipping": 0})").gradient_clipping, 0.0);
  const cfg::Config u = parse(R"({"train_batch_size": 8, "managed_gradient_accumulation": false})");
  EXPECT_FALSE(u.managed_gradient_accumulation);
  EXPECT_FALSE(parse(cfg::to_json(u)).managed_gradient_accumulation);
  EXPECT_TRUE(parse(cfg::to_json(d)).managed_gradient_accumulation);
  EXPECT_THROW(parse(R"({"train_batch_size": 8, "managed_gradient_accumulation": "no"})"), zero8::Error);
}

TEST(ConfigZero8, CommTimeoutDefaultsToTorchsTenMinutes) {
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "zero8": {}})").zero8.comm_timeout_s, 600.0);
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "zero8": {"comm_timeout_s": 45}})").zero8.comm_timeout_s, 45.0);
}

// Unpickling arbitrary objects on load is an opt-in, off unless the config says so, and written back.
TEST(ConfigZero8, CheckpointAllowPickleIsOffByDefault) {
  EXPECT_FALSE(parse(R"({"train_batch_size": 8, "zero8": {}})").zero8.checkpoint_allow_pickle);
  const cfg::Config c = parse(R"({"train_batch_size": 8, "zero8": {"checkpoint": {"allow_pickle": true}}})");
  EXPECT_TRUE(c.zero8.checkpoint_allow_pickle);
  EXPECT_TRUE(parse(cfg::to_json(c)).zero8.checkpoint_allow_pickle);
  EXPECT_THROW(parse(R"({"train_batch_size": 8, "zero8": {"checkpoint": {"allow_pickle": "yes"}}})"), zero8::Error);
}

// The int8 parameter sync (issue 31: the loss study qualified it) and the all-gather into the next forward
// (the engine makes each parameter wait for its piece at its first touch) are on by default; both are
// written back by to_json.
TEST(ConfigZero8, Int8ParamsAndOverlappedGatherOnByDefault) {
  const cfg::Config d = parse(R"({"train_batch_size": 8, "zero8": {}})");
  EXPECT_TRUE(d.zero8.int8_params);
  EXPECT_TRUE(d.zero8.overlap_param_gather);
  const cfg::Config c = parse(R"({"train_batch_size": 8, "zero8": {"int8_params": false, "overlap_param_gather": false}})");
  EXPECT_FALSE(c.zero8.int8_params);
  EXPECT_FALSE(c.zero8.overlap_param_gather);
  const cfg::Config back = parse(cfg::to_json(c));
  EXPECT_FALSE(back.zero8.int8_params);
  EXPECT_FALSE(back.zero8.overlap_param_gather);
  EXPECT_THROW(parse(R"({"train_batch_size": 8, "zero8": {"overlap_param_gather": 1}})"), zero8::Error);
}

// Pipeline activations on the wire: fp32 by default, int8 blocks when asked; a boolean like the other
// int8 keys, and written back by to_json.
TEST(ConfigZero8, Int8ActivationsIsAnOptInBoolean) {
  EXPECT_FALSE(parse(R"({"train_batch_size": 8, "zero8": {}})").zero8.int8_activations);
  const auto c = parse(R"({"train_batch_size": 8, "zero8": {"int8_activations": true}})");
  EXPECT_TRUE(c.zero8.int8_activations);
  EXPECT_TRUE(cfg::parse_string(cfg::to_json(c), 1).zero8.int8_activations);
  const std::string m = parse_error(R"({"train_batch_size": 8, "zero8": {"int8_activations": "yes"}})").what();
  EXPECT_NE(m.find("zero8.int8_activations"), std::string::npos) << m;
}

// Every backend parses (the engine refuses "nccl" for a model on the CPU: the config does not know where
// the model is), in any case; another value is an error listing the choices.
TEST(ConfigZero8, CommBackendChoices) {
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "zero8": {}})").zero8.comm_backend, cfg::CommBackend::automatic);
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "zero8": {"comm_backend": "mpi"}})").zero8.comm_backend,
            cfg::CommBackend::mpi);
  for (const char* v : {"nccl", "NCCL"})
    EXPECT_EQ(parse(std::string(R"({"train_batch_size": 8, "zero8": {"comm_backend": ")") + v + "\"}}").zero8.comm_backend,
              cfg::CommBackend::nccl);
  EXPECT_EQ(parse(R"({"train_batch_size": 8, "zero8": {"comm_backend": "tcp"}})").zero8.comm_backend,
            cfg::CommBackend::tcp);
  const std::string m = parse_error(R"({"train_batch_size": 8, "zero8": {"comm_backend": "gloo"}})").what();
  EXPECT_NE(m.find("test.json: zero8.comm_backend"), std::string::npos) << m;
  EXPECT_NE(m.find("nccl"), std::string::npos) << m;
  EXPECT_NE(m.find("tcp"), std::string::npos) << m;
}

TEST(ConfigOptimizer, PerTypeDefaults) {
  auto opt = [](const char* o) {
    return parse(std::string(R"({"train_batch_size": 8, "zero8": {}, "optimizer": )") + o + "}").optimizer;
  };
  const auto adagrad = opt(R"({"type": "Adagrad"})");  // torch.optim.Adagrad
  EXPECT_EQ(adagrad.get("lr"), 1e-2);
  EXPECT_EQ(adagrad.get("eps"), 1e-10);
  const auto rms = opt(R"({"type": "RMSprop", "params": {"alpha": 0.9}})");  // torch.optim.RMSprop
  EXPECT_EQ(rms.get("lr"), 1e-2);
  EXPECT_EQ(cfg::optimizer_hyper(rms).beta2, 0.9f);  // alpha travels in beta2
  const auto lion = opt(R"({"type": "Lion"})");     // DeepSpeed FusedLion
  EXPECT_EQ(lion.get("lr"), 1e-3);
  EXPECT_EQ(lion.get("betas[1]"), 0.999);
  const auto lamb = opt(R"({"type": "Lamb"})");     // DeepSpeed FusedLamb
  EXPECT_EQ(lamb.get("max_coeff"), 10.0);
  EXPECT_EQ(lamb.get("min_coeff"), 0.01);
  // Both clips reach the kernel's trust ratio: [min_coeff, max_coeff], zero norms exempt (FusedLamb).
  const auto lamb_h = cfg::optimizer_hyper(lamb);
  EXPECT_EQ(lamb_h.max_trust_ratio, 10.0f);
  EXPECT_EQ(lamb_h.min_trust_ratio, 0.01f);
  EXPECT_EQ(zero8::optim::optim_trust_ratio(zero8::optim::Algo::lamb, lamb_h, {1.0, 1e6}), 0.01f);  // 0.001 raised
  EXPECT_EQ(zero8::optim::optim_trust_ratio(zero8::optim::Algo::lamb, lamb_h, {400.0, 1.0}), 10.0f);  // 20 clipped
  EXPECT_EQ(zero8::optim::optim_trust_ratio(zero8::optim::Algo::lamb, lamb_h, {4.0, 1.0}), 2.0f);
  EXPECT_EQ(zero8::optim::optim_trust_ratio(zero8::optim::Algo::lamb, lamb_h, {0.0, 1.0}), 1.0f);  // zero norm
  const auto lars = opt(R"({"type": "LARS", "params": {"trust_coefficient": 0.02}})");
  EXPECT_EQ(cfg::optimizer_hyper(lars).trust_coefficient, 0.02f);
  const auto c = parse(R"({"train_batch_size": 8, "zero8": {"optim_bits": 32}, "optimizer": {"type": "Adam"}})");
  EXPECT_EQ(cfg::optimizer_display_name(c), "AdamW32bit");
  const auto off = parse(R"({"train_batch_size": 8, "zero8": {"enabled": false}, "optimizer": {"type": "Lion"}})");
  EXPECT_FALSE(off.zero8.enabled);
  EXPECT_EQ(cfg::optimizer_state_bits(off), 32);
}

TEST(ConfigPrecision, LossScalerMapping) {
  auto c = parse(R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 128}})");
  auto l = cfg::loss_scaler_config(c);
  EXPECT_FALSE(l.dynamic);
  EXPECT_EQ(l.static_scale, 128.0);
  c = parse(R"({"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 12, "hysteresis": 1,
                 "loss_scale_window": 200, "consecutive_hysteresis": true, "min_loss_scale": 0}})");
  l = cfg::loss_scaler_config(c);
  EXPECT_TRUE(l.dynamic);
  EXPECT_EQ(l.initial_scale_power, 12);
  EXPECT_EQ(l.scale_window, 200);
  EXPECT_EQ(l.hysteresis, 1);
  EXPECT_TRUE(l.consecutive_hysteresis);
  EXPECT_GT(l.min_scale, 0.0);  // 0 = no floor, kept positive for the scaler
  EXPECT_LT(l.min_scale, 1e-300);
  zero8::LossScaler scaler(l);  // accepted by the scaler's own validation
  EXPECT_EQ(scaler.scale(), 4096.0);
  // The old "bfloat16" name still works.
  EXPECT_TRUE(parse(R"({"train_batch_size": 8, "bfloat16": {"enabled": true}})").bf16.enabled);
}

// ------------------------------------------------------------------------------------------------
// Schedules at hand-computed points. t is DeepSpeed's last_batch_iteration (-1 = at construction).

TEST(ConfigSchedule, WarmupLRLogAndLinear) {
  auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params":
                 {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 100}}})");
  const auto& s = c.scheduler;
  EXPECT_LR(cfg::lr_at(s, -1), 0.001);
  EXPECT_LR(cfg::lr_at(s, 0), 0.001);               // log(1) / log(100) = 0
  EXPECT_LR(cfg::lr_at(s, 9), 0.001 + 0.01 * 0.5);  // log(10) / log(100) = 1/2
  EXPECT_LR(cfg::lr_at(s, 99), 0.011);              // log(100) / log(100) = 1
  EXPECT_LR(cfg::lr_at(s, 100), 0.011);
  EXPECT_LR(cfg::lr_at(s, 100000), 0.011);
  c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params":
            {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 100, "warmup_type": "linear"}}})");
  EXPECT_LR(cfg::lr_at(c.scheduler, 25), 0.001 + 0.01 * 0.25);
  // warmup_num_steps 1 is raised to 2 (so that log(W) > 0): t = 0 is the minimum, t = 1 the maximum.
  c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params":
            {"warmup_min_lr": 0.5, "warmup_max_lr": 1.5, "warmup_num_steps": 1}}})");
  EXPECT_LR(cfg::lr_at(c.scheduler, 0), 0.5);
  EXPECT_LR(cfg::lr_at(c.scheduler, 1), 1.5);
}

TEST(ConfigSchedule, ZeroWarmupStepsAreAcceptedAsTwo) {
  // The Hugging Face Trainer writes warmup_num_steps 0 when a run has no warmup. DeepSpeed's formulas use
  // max(2, n), so zero8 takes 0 as 2 (current DeepSpeed raises ValueError for 0 first: docs/CONFIG.md):
  // t = 0 is the minimum, t >= 1 the maximum (or the decay/cosine from there).
  auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params":
                 {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 0}}})");
  EXPECT_EQ(c.scheduler.warmup_num_steps, 0);
  EXPECT_EQ(cfg::lr_at(c.scheduler, 0), 0.0);
  EXPECT_LR(cfg::lr_at(c.scheduler, 1), 3e-5);
  c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params":
            {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 0, "total_num_steps": 12}}})");
  EXPECT_LR(cfg::lr_at(c.scheduler, 2), 0.1);        // (12 - 2) / (12 - 2)
  EXPECT_LR(cfg::lr_at(c.scheduler, 7), 0.1 * 0.5);  // (12 - 7) / 10
  c = parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
                "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0, "total_num_steps": 12}}})");
  EXPECT_EQ(cfg::lr_at(c.scheduler, 0), 0.0);                // warmup_min_ratio 0
  EXPECT_LR(cfg::lr_at(c.scheduler, 11), 0.002 * 0.0001);   // progress 1: cos_min_ratio
  const auto back = cfg::parse_string(cfg::to_json(c), 1, "normalized.json");
  EXPECT_TRUE(back == c);
  // Negative counts stay an error: no DeepSpeed config means them.
  const auto e = parse_error(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params":
                 {"warmup_num_steps": -5}}})");
  EXPECT_NE(std::string(e.what()).find("scheduler.params.warmup_num_steps: expected an integer >= 0, got -5"),
            std::string::npos) << e.what();
}

TEST(ConfigSchedule, WarmupDecayLR) {
  const auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params":
      {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "total_num_steps": 110,
       "warmup_type": "linear"}}})");
  const auto& s = c.scheduler;
  EXPECT_LR(cfg::lr_at(s, 5), 0.05);    // 5/10 of the way up
  EXPECT_LR(cfg::lr_at(s, 10), 0.1);    // (110 - 10) / (110 - 10) = 1
  EXPECT_LR(cfg::lr_at(s, 60), 0.05);   // (110 - 60) / 100 = 0.5
  EXPECT_LR(cfg::lr_at(s, 109), 0.001); // 1 / 100
  EXPECT_EQ(cfg::lr_at(s, 110), 0.0);
  EXPECT_EQ(cfg::lr_at(s, 500), 0.0);   // clamped at 0
  // warmup_max_lr defaults to 0.001 for WarmupDecayLR (its constructor's default), not the optimizer's lr.
  const auto d = parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})");
  EXPECT_EQ(d.scheduler.warmup_max_lr, 0.001);
  // DeepSpeed does this silently; a Megatron-style config with lr 6e-4 would peak 1.7x higher than
  // written, so zero8 says so (and not when the optimizer's lr is 0.001 anyway, or the peak is given).
  EXPECT_TRUE(has_warning(d, "test.json: scheduler.params.warmup_max_lr: not given: WarmupDecayLR peaks at "
                             "DeepSpeed's default 0.001, not optimizer.params.lr 0.5")) << all_warnings(d);
  EXPECT_TRUE(parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}})")
                  .warnings.empty());
  EXPECT_TRUE(parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 0.5}}})")
                  .warnings.empty());
}

TEST(ConfigSchedule, WarmupCosineLR) {
  const auto c = parse(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 110, "warmup_num_steps": 10,
       "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}}})");
  const auto& s = c.scheduler;
  EXPECT_EQ(cfg::lr_at(s, -1), 0.0);             // lr_schedules.py returns 0 before the first step()
  EXPECT_LR(cfg::lr_at(s, 0), 0.002 * 0.1);      // ratio = warmup_min_ratio
  EXPECT_LR(cfg::lr_at(s, 5), 0.002 * (0.1 + 0.5 * 0.9));
  // t = 59: progress (59 - 10 + 1) / (110 - 10) = 1/2, cos(pi/2) = 0: ratio 0.01 + 0.99 / 2. In double
  // cos(pi/2) is 6.1e-17, which moves the lr by 0.002 * 0.99 * 3e-17 = 6e-20: hence the absolute 1e-18.
  EXPECT_NEAR(cfg::lr_at(s, 59), 0.002 * (0.01 + 0.99 * 0.5), 1e-18);
  // t = 34: progress 1/4, (1 + cos(pi/4)) / 2 = (1 + sqrt(1/2)) / 2.
  EXPECT_LR(cfg::lr_at(s, 34), 0.002 * (0.01 + 0.99 * (1.0 + std::sqrt(0.5)) / 2.0));
  EXPECT_LR(cfg::lr_at(s, 109), 0.002 * 0.01);   // progress 1: cos_min_ratio
  EXPECT_LR(cfg::lr_at(s, 1000), 0.002 * 0.01);  // stays at the floor
}

TEST(ConfigSchedule, OneCycleLrAndMomentum) {
  const auto c = parse(R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.011,
       "cycle_first_step_size": 10, "cycle_second_step_size": 20, "decay_step_size": 5, "decay_lr_rate": 0.5,
       "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}}})");
  // beta2 is already 0.99. The one warning: momentum 0.95 * (1 + 0.1 * k) leaves [0, 1) at k = 0.6, which
  // is iteration 32 ((32 - 30 + 1) / 5), where it is 0.95 * 1.06 = 1.007; at 31 it is 0.95 * 1.04.
  ASSERT_EQ(c.warnings.size(), 1u) << all_warnings(c);
  EXPECT_NE(c.warnings[0].find("scheduler.params.decay_mom_rate: momentum after the cycle is cycle_max_mom * "
                               "(1 + decay_mom_rate * k) for the k-th decay interval, which leaves [0, 1) at "
                               "scheduler step 32 (beta1 1.007)"),
            std::string::npos)
      << c.warnings[0];
  const auto& s = c.scheduler;
  ASSERT_TRUE(s.momentum_cycled);
  // Cycle of 30 iterations, rising for 10 (step ratio 1/3), falling for 20.
  EXPECT_LR(cfg::lr_at(s, -1), 0.001);
  EXPECT_LR(cfg::momentum_at(s, -1), 0.85);            // construction sets cycle_min_mom
  EXPECT_LR(cfg::lr_at(s, 4), 0.001 + 0.01 * 0.5);     // x = 5/30 = half of the rising 1/3
  EXPECT_LR(cfg::momentum_at(s, 4), 0.95 - 0.1 * 0.5);
  EXPECT_LR(cfg::lr_at(s, 9), 0.011);                  // peak at x = 1/3
  EXPECT_LR(cfg::momentum_at(s, 9), 0.85);
  EXPECT_LR(cfg::lr_at(s, 19), 0.001 + 0.01 * 0.5);    // x = 2/3: (2/3 - 1) / (1/3 - 1) = 1/2
  EXPECT_LR(cfg::lr_at(s, 29), 0.001);                 // end of the cycle (x = 1 + 30/30 - 2 = 0)
  EXPECT_LR(cfg::momentum_at(s, 29), 0.95);
  // Decay: iteration 1 after the cycle is 1/5 of a decay step.
  EXPECT_LR(cfg::lr_at(s, 30), 0.001 / (1.0 + 0.5 * 0.2));
  EXPECT_LR(cfg::momentum_at(s, 30), 0.95 * (1.0 + 0.1 * 0.2));
  EXPECT_LR(cfg::lr_at(s, 39), 0.001 / 2.0);           // 10 / 5 = 2 decay steps
  EXPECT_LR(cfg::momentum_at(s, 39), 0.95 * 1.2);      // DeepSpeed grows momentum past 1 here too
  // A negative rate leaves [0, 1) below 0: 0.95 * (1 - 2 * k) < 0 from k > 1/2, iteration 32 again (k = 0.6).
  const auto n = parse(R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.011,
       "cycle_first_step_size": 10, "cycle_second_step_size": 20, "decay_step_size": 5,
       "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": -2}}})");
  ASSERT_EQ(n.warnings.size(), 1u) << all_warnings(n);
  EXPECT_NE(n.warnings[0].find("at scheduler step 32 (beta1 -0.19)"), std::string::npos) << n.warnings[0];
}

TEST(ConfigSchedule, OneCycleStairsAndNoDecay) {
  const auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params":
      {"cycle_min_lr": 0.001, "cycle_max_lr": 0.011, "cycle_first_step_size": 10, "cycle_second_step_size": 20,
       "cycle_first_stair_count": 2, "cycle_second_stair_count": 4}}})");
  const auto& s = c.scheduler;
  EXPECT_LR(cfg::lr_at(s, 3), 0.001);                 // 4 * 2 / 10 = 0.8 -> stair 0
  EXPECT_LR(cfg::lr_at(s, 4), 0.001 + 0.01 * 0.5);    // 5 * 2 / 10 = 1 -> stair 1 of 2
  EXPECT_LR(cfg::lr_at(s, 14), 0.001 + 0.01 * 0.75);  // (30 - 15) * 4 / 20 = 3 -> 3/4
  EXPECT_LR(cfg::lr_at(s, 16), 0.001 + 0.01 * 0.5);   // (30 - 17) * 4 / 20 = 2.6 -> 2/4
  EXPECT_LR(cfg::lr_at(s, 40), 0.001);                // decay_step_size 0: no decay
  // DeepSpeed documents the stairs, but its OneCycle stores the counts and never reads them (its lr
  // is the continuous triangle): zero8 applies them, and says that the lr differs from DeepSpeed's run.
  EXPECT_TRUE(has_warning(c, "test.json: scheduler.params.cycle_first_stair_count: "));
  EXPECT_TRUE(has_warning(c, "DeepSpeed's OneCycle ignores it")) << all_warnings(c);
  EXPECT_FALSE(has_warning(parse(R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params":
      {"cycle_min_lr": 0.001, "cycle_max_lr": 0.011, "cycle_first_stair_count": 0}}})"), "stair"));
  // No optimizer section: the caller's optimizer decides; momentum cycling stays on as configured.
  EXPECT_TRUE(s.momentum_cycled);
  EXPECT_LR(cfg::momentum_at(s, 40), 0.9);            // DeepSpeed's default cycle_max_mom
  EXPECT_THROW(cfg::momentum_at(parse(R"({"train_batch_size": 8})").scheduler, 0), zero8::Error);
}

TEST(ConfigSchedule, LRRangeTest) {
  auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "LRRangeTest", "params":
      {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 2}}})");
  EXPECT_LR(cfg::lr_at(c.scheduler, -1), 0.001);
  EXPECT_LR(cfg::lr_at(c.scheduler, 4), 0.001 * (1 + 2 * 0.5));
  c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "LRRangeTest", "params":
      {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 2,
       "lr_range_test_staircase": true}}})");
  EXPECT_LR(cfg::lr_at(c.scheduler, 4), 0.001);            // floor(0.5) = 0
  EXPECT_LR(cfg::lr_at(c.scheduler, 9), 0.001 * (1 + 2));  // floor(1) = 1
}

TEST(ConfigSchedule, BaseLrFromTheClientOptimizer) {
  // No optimizer section: WarmupLR's maximum and WarmupCosineLR's scale come from the caller's optimizer.
  auto c = parse(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                    "warmup_type": "linear"}}})");
  EXPECT_THROW(cfg::lr_at(c.scheduler, 5), zero8::Error);
  cfg::scheduler_set_base_lr(c.scheduler, 0.2);
  EXPECT_LR(cfg::lr_at(c.scheduler, 5), 0.1);
  c = parse(R"({"train_batch_size": 8})");
  EXPECT_THROW(cfg::lr_at(c.scheduler, 0), zero8::Error);
  cfg::scheduler_set_base_lr(c.scheduler, 0.3);
  EXPECT_EQ(cfg::lr_at(c.scheduler, 7), 0.3);  // no scheduler: constant
}

// ------------------------------------------------------------------------------------------------
// to_json: normalized and resolved; parsing it back gives the same config, with no warnings.

TEST(ConfigJson, RoundTripEveryConfigFile) {
  for (const char* name : {"bert_fp16_adam_warmup_decay.json", "zero2_fp16_adamw_warmup.json",
                           "bf16_adamw_cosine_zero2.json", "zero8_lamb_onecycle.json", "zero1_sgd_nesterov.json"}) {
    SCOPED_TRACE(name);
    const auto c = cfg::parse_file(kConfigs + name, 4);
    const std::string j = cfg::to_json(c);
    const auto back = cfg::parse_string(j, 4, "normalized.json");
    EXPECT_TRUE(back == c) << j;
    // No unknown keys; a warning about a value (OneCycle's stairs) comes back with the value.
    EXPECT_LE(back.warnings.size(), c.warnings.size()) << all_warnings(back);
    for (const auto& w : back.warnings) EXPECT_EQ(w.find("unknown key"), std::string::npos) << w;
    EXPECT_EQ(cfg::to_json(back), j);
  }
}

TEST(ConfigJson, RoundTripEveryOptimizerAndSchedule) {
  const char* optimizers[] = {
      R"({"type": "Adam", "params": {"adam_w_mode": false, "betas": [0.8, 0.9], "eps": 1e-7}})",
      R"({"type": "Lion", "params": {"lr": 3e-5, "weight_decay": 0.1}})",
      R"({"type": "SGD", "params": {"momentum": 0.5, "dampening": 0.1}})",
      R"({"type": "RMSprop", "params": {"alpha": 0.95}})",
      R"({"type": "Adagrad", "params": {"lr_decay": 0.01, "initial_accumulator_value": 0.1}})",
      R"({"type": "LARS", "params": {"momentum": 0.9, "nesterov": true, "trust_coefficient": 0.01}})"};
  const char* schedulers[] = {
      R"({"type": "WarmupLR", "params": {}})",
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": false}})",
      R"({"type": "LRRangeTest", "params": {"lr_range_test_staircase": true}})"};
  for (const char* o : optimizers)
    for (const char* s : schedulers) {
      const std::string text = std::string(R"({"train_micro_batch_size_per_gpu": 3, "communication_data_type": "bf16",
          "fp16": {"enabled": true, "loss_scale": 0, "min_loss_scale": 0.0001}, "zero8": {"seed": 18446744073709551615},
          "optimizer": )") + o + R"(, "scheduler": )" + s + "}";
      SCOPED_TRACE(text);
      const auto c = parse(text, 2);
      const auto back = cfg::parse_string(cfg::to_json(c), 2, "normalized.json");
      EXPECT_TRUE(back == c) << cfg::to_json(c);
      EXPECT_TRUE(back.warnings.empty()) << all_warnings(back);
      EXPECT_EQ(back.zero8.seed, 18446744073709551615ull);
    }
  // Equality is real: a changed field breaks it.
  auto a = parse(R"({"train_batch_size": 8})");
  auto b = a;
  EXPECT_TRUE(a == b);
  b.zero8.wire_block_size = 1024;
  EXPECT_FALSE(a == b);
  b = a;
  b.scheduler.warmup_max_lr = 0.5;
  EXPECT_FALSE(a == b);
}
