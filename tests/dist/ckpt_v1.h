// The stored format-version-1 checkpoints of tests/data/checkpoints/: what ckpt_v1_gen.cpp trained and
// saved (by hand, with the checkpoint code of the time), and what test_checkpoint_v1.cpp loads them
// into. Changing anything here changes the data: regenerate it (see ckpt_v1_gen.cpp) and say why.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "zero8/checkpoint.h"
#include "zero8/kernels/hd.h"
#include "zero8/sharded.h"

namespace zero8::test {

struct V1Case {
  const char* name;  // the checkpoint directory under tests/data/checkpoints/
  int world;         // ranks that saved it
  int steps;         // step() calls (a skipped one included)
  int gas;           // micro-batches per step
  int64_t inf_step;  // the step whose gradient holds an Inf on rank 0 (-1: none)
  bool hyper_groups; // the parameters in two param groups with their own hyperparameters
  bool module;       // saved with a state_dict, module tensors and an extra file
};

// 8-bit group (min_8bit_size 256): embed, w1, w2 (1080 elements); fp32 group: ln.w, bias, the marked
// "stable", a scalar (64 elements). State blocks of 64 elements; in adamw8_np2's two param groups the
// 8-bit partitions of 2 ranks meet inside w2, and rank 1 holds no fp32 partition.
inline std::vector<shard::ParamSpec> v1_params(const V1Case& c) {
  std::vector<shard::ParamSpec> p = {{"embed", {12, 40}}, {"ln.w", {40}},          {"w1", {300}}, {"bias", {7}},
                                     {"stable", {2, 8}, true}, {"scale", {}}, {"w2", {3, 100}}};
  if (c.hyper_groups) {
    const int hg[] = {0, 1, 1, 0, 0, 1, 0};
    for (size_t i = 0; i < p.size(); ++i) p[i].hyper_group = hg[i];
  }
  return p;
}

// adamw8_np2: 8-bit AdamW in two param groups, a bf16 working copy that is not the rounded master
// (int8 parameter sync), int8 gradients with error feedback (a residual per rank), and the module's
// state_dict (a tied alias, an I64 and an F16 buffer) and an extra file.
// lion8_fp16_np1: 8-bit Lion (one state) with an f16 working copy and fp16 loss scaling after an
// overflowed (skipped) step, stage 1 with 2 micro-batches, no state_dict.
inline const V1Case kV1Cases[] = {
    {"adamw8_np2", 2, 3, 1, -1, true, true},
    {"lion8_fp16_np1", 1, 4, 2, 1, false, false},
};

inline shard::ShardConfig v1_config(const V1Case& c) {
  shard::ShardConfig cfg;
  cfg.layout.state_block = 64;
  cfg.layout.wire_block = 128;
  cfg.layout.min_8bit_size = 256;
  cfg.reduce_bucket_size = 512;
  if (std::strcmp(c.name, "adamw8_np2") == 0) {
    cfg.algo = optim::Algo::adamw;
    cfg.hyper.lr = 1e-2f;
    cfg.hyper.weight_decay = 0.01f;
    optim::Hyper h1 = cfg.hyper;
    h1.lr = 3e-3f;
    h1.weight_decay = 0.0f;
    h1.beta1 = 0.8f;
    h1.beta2 = 0.99f;
    cfg.group_hypers = {cfg.hyper, h1};
    cfg.working_dtype = DType::bf16;
    cfg.int8_grads = true;
    cfg.int8_params = true;
    cfg.error_feedback = true;
  } else {
    cfg.algo = optim::Algo::lion;
    cfg.hyper.lr = 1e-3f;
    cfg.hyper.beta2 = 0.99f;
    cfg.working_dtype = DType::f16;
    cfg.fp16 = true;
    cfg.loss_scaler.initial_scale_power = 8;
    cfg.loss_scaler.hysteresis = 1;
    cfg.loss_scaler.scale_window = 2;
    cfg.stage = 1;
  }
  return cfg;
}

// The client state and config saved (JSON text, compared as JSON after a load).
inline std::string v1_client_state(const V1Case& c) {
  return std::string(R"({"epoch": 1, "case": ")") + c.name + R"(", "data": {"position": 96, "seed": 1234}})";
}
inline std::string v1_config_json(const V1Case& c) {
  return std::string(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": )") + std::to_string(c.gas) +
         R"(, "zero8": {"state_block": 64, "wire_block": 128}})";
}

// The module's entries the optimizer does not train, as ckpt::SaveOptions::ModuleTensor wants them:
// position ids (I64, one not exact in float32) and a running mean (F16), with their bytes.
struct V1Module {
  std::vector<int64_t> pos_ids = {0, 1, 2, (int64_t(1) << 40) + 3};
  std::vector<uint16_t> bn_mean;
  std::vector<uint8_t> trainer_state;  // the extra file's bytes
  V1Module() {
    const float mean[3] = {0.5f, -1.25f, 3.0f};
    bn_mean.resize(3);
    for (int i = 0; i < 3; ++i) dtype_store(bn_mean.data(), DType::f16, i, mean[i]);
    for (int i = 0; i < 37; ++i) trainer_state.push_back(uint8_t(i * 7 + 3));
  }
  float bn_mean_value(int i) const { return dtype_load(bn_mean.data(), DType::f16, i); }
};

inline constexpr const char* kV1ExtraName = "trainer_state.bin";

// state_dict order: a trained parameter, a buffer, the rest of the parameters, a tied alias of embed, a buffer.
inline ckpt::SaveOptions v1_save_options(const V1Case& c, const V1Module& mod) {
  ckpt::SaveOptions so;
  so.client_state = v1_client_state(c);
  so.config_json = v1_config_json(c);
  if (!c.module) return so;
  so.state_dict = {{"embed", "embed"}, {"pos_ids", "pos_ids"}, {"ln.w", "ln.w"},         {"w1", "w1"},
                   {"bias", "bias"},   {"stable", "stable"},   {"scale", "scale"},       {"w2", "w2"},
                   {"head.weight", "embed"}, {"bn.mean", "bn.mean"}};
  so.module_tensors = {{"pos_ids", "I64", {4}, {mod.pos_ids.data(), int64_t(mod.pos_ids.size() * 8)}},
                       {"bn.mean", "F16", {3}, {mod.bn_mean.data(), int64_t(mod.bn_mean.size() * 2)}}};
  so.extra_files = {{kV1ExtraName, {mod.trainer_state.data(), int64_t(mod.trainer_state.size())}}};
  return so;
}

}  // namespace zero8::test
