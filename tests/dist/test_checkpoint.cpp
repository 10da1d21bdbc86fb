// Checkpoints under mpirun -np K (K = 1, 2, 4): resuming is bit-exact (run A: train, save, train on;
// run B: load, train on; every byte of parameters, masters, 8-bit states, residuals, step and loss
// scaler equal), keep_last and same-tag replacement, and bad input (missing, truncated, corrupt or
// foreign files, another model or optimizer, unknown format, no `latest`) fails naming the file and
// the problem without changing the files or the optimizer; param groups (hyper groups): resume,
// a load into other groups refused naming the parameter, manifests from before them. Other world
// sizes and crashes mid-save: ckpt_phase.cpp with run_checkpoint.cmake.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ckpt_util.h"
#include "dist_env.h"
#include "zero8/checkpoint.h"

namespace zero8::test {
namespace {

namespace fs = std::filesystem;

// Every file under dir with its content (small test checkpoints), to prove nothing was changed.
std::map<std::string, std::vector<uint8_t>> tree(const std::string& dir) {
  std::map<std::string, std::vector<uint8_t>> t;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    t[fs::relative(e.path(), dir).string()] = e.is_regular_file() ? file_read_bytes(e.path().string()) : std::vector<uint8_t>{};
  return t;
}

struct ResumeCase {
  const char* name;
  ShardConfig cfg;
  int gas = 1;
  int64_t inf_step = -1;
  std::vector<ParamSpec> params = ckpt_params();
};

std::vector<ResumeCase> resume_cases() {
  std::vector<ResumeCase> v;
  v.push_back({"adamw 8-bit, bf16, int8 grads + params, error feedback", ckpt_config()});
  ShardConfig lion = ckpt_config();
  lion.algo = optim::Algo::lion;
  lion.hyper.lr = 1e-3f;
  lion.hyper.beta2 = 0.99f;
  lion.working_dtype = DType::f16;
  lion.fp16 = true;
  lion.loss_scaler.initial_scale_power = 8;
  lion.loss_scaler.hysteresis = 1;
  lion.loss_scaler.scale_window = 2;
  lion.stage = 1;
  v.push_back({"lion 8-bit, fp16 loss scaling after an overflow, stage 1, accumulation 2", lion, 2, 1});
  ShardConfig lamb = ckpt_config();
  lamb.algo = optim::Algo::lamb;
  lamb.bits = 32;
  lamb.working_dtype = DType::f32;
  lamb.int8_grads = false;
  lamb.int8_params = false;
  lamb.error_feedback = false;
  v.push_back({"lamb 32-bit, f32, fp32 communication", lamb});
  v.push_back({"adamw 8-bit in three param groups (own lr, weight decay, betas)", ckpt_hyper_config(), 1, -1,
               ckpt_hyper_params()});
  ShardConfig lamb_groups = ckpt_hyper_config();
  lamb_groups.algo = optim::Algo::lamb;
  lamb_groups.bits = 32;
  lamb_groups.stage = 1;
  v.push_back({"lamb 32-bit in three param groups, stage 1, accumulation 2", lamb_groups, 2, -1, ckpt_hyper_params()});
  return v;
}

TEST(Checkpoint, ResumeIsBitExact) {
  const int k = 3, m = 3;
  for (const ResumeCase& c : resume_cases()) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    // Run A: k steps, save, m more.
    auto a = ckpt_make(c.cfg, world(), 77, c.params);
    ckpt_train(*a, 0, k, c.gas, c.inf_step);
    const Snapshot at_save = ckpt_snapshot(*a);
    ckpt::SaveOptions so;
    so.client_state = R"({"epoch": 1, "scheduler": {"last_epoch": 3}, "note": "résumé"})";
    so.config_json = R"({"train_batch_size": 8})";
    const ckpt::SaveResult sr = ckpt::save(*a, dir.path, so);
    EXPECT_EQ(sr.tag, "global_step" + std::to_string(a->steps()));
    EXPECT_EQ(sr.path, dir.path + "/" + sr.tag);
    EXPECT_GT(sr.bytes, 0);
    ckpt_train(*a, k, m, c.gas, c.inf_step);
    const Snapshot run_a = ckpt_snapshot(*a);

    // Run B: another optimizer that has trained elsewhere (different parameters, states, residuals,
    // scaler), loads, and trains the same m steps.
    auto b = ckpt_make(c.cfg, world(), 1234, c.params);
    ckpt_train(*b, 100, 1, c.gas);
    ASSERT_NE(ckpt_diff(ckpt_snapshot(*b), at_save), "");
    const ckpt::LoadResult lr = ckpt::load(*b, dir.path);
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), at_save), "") << "right after load, rank " << world().rank();
    EXPECT_EQ(lr.tag, sr.tag);
    EXPECT_EQ(lr.step, at_save.steps);
    EXPECT_EQ(lr.saved_world, world().size());
    EXPECT_EQ(nlohmann::json::parse(lr.client_state), nlohmann::json::parse(so.client_state));
    EXPECT_EQ(nlohmann::json::parse(lr.config_json), nlohmann::json::parse(so.config_json));
    EXPECT_TRUE(lr.warnings.empty()) << lr.warnings.front();
    ckpt_train(*b, k, m, c.gas, c.inf_step);
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), run_a), "") << "after " << m << " more steps, rank " << world().rank();
  }
}

// One micro-batch of an unfinished step (accumulation 2): in grad_input (stage 1) or reduced into the
// rank's gradient partition (stage 2).
void ckpt_half_step(ShardedOptimizer& opt, int64_t step) {
  for (size_t p = 0; p < opt.layout().params.size(); ++p) {
    float* g = opt.param_grad(int(p));
    for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) g[i] += ckpt_grad_value(opt.rank(), step, 0, int(p), i);
  }
  for (int p = int(opt.layout().params.size()) - 1; p >= 0; --p) opt.grad_ready(p);
  opt.backward_end(false);
}

TEST(Checkpoint, LoadAndInitDropTheGradientsAccumulatedBeforeThem) {
  // The gradients of an unfinished step belong to the weights a load (or init) replaces: the next step
  // must be made of the micro-batches fed after it alone, as at a step boundary. They used to be added in.
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    ShardConfig c = ckpt_config();
    c.stage = stage;
    TempDir dir;
    auto a = ckpt_make(c, world(), 77);
    ckpt_train(*a, 0, 2, 2);
    ckpt::save(*a, dir.path);
    ckpt_train(*a, 2, 2, 2);
    const Snapshot run_a = ckpt_snapshot(*a);
    auto b = ckpt_make(c, world(), 1234);
    ckpt_train(*b, 100, 1, 2);
    ckpt_half_step(*b, 101);
    ckpt::load(*b, dir.path);
    ckpt_train(*b, 2, 2, 2);
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), run_a), "") << "load, rank " << world().rank();

    auto fresh = ckpt_make(c, world(), 5);
    ckpt_train(*fresh, 0, 1, 2);
    auto again = ckpt_make(c, world(), 5);
    ckpt_half_step(*again, 7);
    again->init(0);
    ckpt_train(*again, 0, 1, 2);
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*again), ckpt_snapshot(*fresh)), "") << "init, rank " << world().rank();
  }
}

TEST(Checkpoint, BeforeCommitSeesTheResultAndItsFailureChangesNothing) {
  TempDir dir;
  auto a = ckpt_make(ckpt_config(), world(), 77);
  ckpt_train(*a, 0, 2);
  ckpt::SaveOptions so;
  so.client_state = R"({"epoch": 4})";
  const ckpt::SaveResult sr = ckpt::save(*a, dir.path, so);
  const Snapshot saved = ckpt_snapshot(*a);
  auto b = ckpt_make(ckpt_config(), world(), 1234);
  ckpt_train(*b, 100, 1);
  const Snapshot before = ckpt_snapshot(*b);
  const int last = world().size() - 1;

  // The hook throws on the last rank only: every rank fails with its message, nothing changes.
  ckpt::LoadOptions lo;
  int calls = 0;
  lo.before_commit = [&](const ckpt::LoadResult& r) {
    ++calls;
    EXPECT_EQ(r.path, sr.path);
    EXPECT_EQ(r.step, saved.steps);
    EXPECT_EQ(nlohmann::json::parse(r.client_state), nlohmann::json::parse(so.client_state));
    if (world().rank() == last) ZERO8_THROW(invalid_argument, "the caller's own file is bad");
  };
  try {
    ckpt::load(*b, dir.path, lo);
    ADD_FAILURE() << "load succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("the caller's own file is bad"), std::string::npos) << e.what();
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), before), "") << "a failed load changed the optimizer";

  lo.before_commit = [&](const ckpt::LoadResult&) { ++calls; };
  ckpt::load(*b, dir.path, lo);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), saved), "");
}

TEST(Checkpoint, ResumeWithoutRestoringTheWorkingCopyWouldDiffer) {
  // Why the working copy is saved: with int8 parameter sync over several ranks it is not the rounded
  // master, so rebuilding it from the masters changes the next steps. (Guards the bit-exact test above
  // against a loader that silently recomputes it.) One rank syncs nothing (sharded.h, WirePlan): its
  // working copy is the rounded master.
  TempDir dir;
  auto a = ckpt_make(ckpt_config(), world());
  ckpt_train(*a, 0, 3);
  const Snapshot s = ckpt_snapshot(*a);
  a->sync_working_from_master();
  bool differs = false;
  const Snapshot t = ckpt_snapshot(*a);
  for (int g = 0; g < 2; ++g) differs = differs || s.working[g] != t.working[g];
  if (world().size() > 1) {
    EXPECT_TRUE(differs) << "the working copy equals the rounded masters: the test model does not exercise int8 sync";
  } else {
    EXPECT_FALSE(differs) << "one rank's working copy went through int8: it is not the rounded master";
  }
}

TEST(Checkpoint, KeepLastKeepsTheMostRecentTags) {
  TempDir dir;
  auto opt = ckpt_make(ckpt_config(), world());
  std::vector<std::string> removed;
  for (int s = 0; s < 4; ++s) {
    ckpt_train(*opt, s, 1);
    ckpt::SaveOptions so;
    so.keep_last = 2;
    const ckpt::SaveResult r = ckpt::save(*opt, dir.path, so);
    removed.insert(removed.end(), r.removed.begin(), r.removed.end());
  }
  EXPECT_EQ(removed, (std::vector<std::string>{"global_step1", "global_step2"}));
  if (world().rank() == 0) {
    EXPECT_EQ(ckpt::tags_list(dir.path), (std::vector<std::string>{"global_step3", "global_step4"}));
    EXPECT_EQ(ckpt::latest_read(dir.path), "global_step4");
  }
  // An older step saved last is the latest: keep_last 1 keeps it and removes the others.
  ckpt::SaveOptions so;
  so.tag = "rewind";
  so.keep_last = 1;
  const ckpt::SaveResult r = ckpt::save(*opt, dir.path, so);
  EXPECT_EQ(r.removed, (std::vector<std::string>{"global_step3", "global_step4"}));
  if (world().rank() == 0) {
    EXPECT_EQ(ckpt::tags_list(dir.path), (std::vector<std::string>{"rewind"}));
  }
  // Without updating latest, keep_last 1 keeps both the tag latest names and the one just saved.
  for (const char* tag : {"side1", "side2"}) {
    so.tag = tag;
    so.update_latest = false;
    ckpt_train(*opt, 5, 1);
    ckpt::save(*opt, dir.path, so);
  }
  if (world().rank() == 0) {
    EXPECT_EQ(ckpt::latest_read(dir.path), "rewind");
    EXPECT_EQ(ckpt::tags_list(dir.path), (std::vector<std::string>{"rewind", "side2"}));
  }
}

TEST(Checkpoint, SavingAnExistingTagReplacesIt) {
  for (const char* exchange : {"1", "0"}) {
    SCOPED_TRACE(std::string("ZERO8_CKPT_RENAME_EXCHANGE=") + exchange);
    setenv("ZERO8_CKPT_RENAME_EXCHANGE", exchange, 1);
    TempDir dir;
    auto a = ckpt_make(ckpt_config(), world());
    ckpt::SaveOptions so;
    so.tag = "best";
    ckpt_train(*a, 0, 2);
    ckpt::save(*a, dir.path, so);
    ckpt_train(*a, 2, 1);
    const Snapshot s3 = ckpt_snapshot(*a);
    ckpt::save(*a, dir.path, so);
    auto b = ckpt_make(ckpt_config(), world(), 5);
    const ckpt::LoadResult lr = ckpt::load(*b, dir.path);
    EXPECT_EQ(lr.tag, "best");
    EXPECT_EQ(lr.step, 3);
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), s3), "");
    if (world().rank() == 0) {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
      std::sort(names.begin(), names.end());
      EXPECT_EQ(names, (std::vector<std::string>{"best", "latest"})) << "leftovers after replacing a tag";
    }
    unsetenv("ZERO8_CKPT_RENAME_EXCHANGE");
  }
}

TEST(Checkpoint, SaveOfAnOptimizerNeverInitializedIsRefused) {
  // Its masters are zeros: the save wrote them beside the model's weights (verify OK), and a load of it then
  // set every weight to the update from zero.
  TempDir dir;
  ShardedOptimizer opt(ckpt_params(), ckpt_config(), world());
  try {
    ckpt::save(opt, dir.path);
    ADD_FAILURE() << "save of an optimizer never initialized accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("the optimizer was never initialized"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(ckpt::tags_list(dir.path).empty());
  opt.init(0);
  EXPECT_FALSE(ckpt::save(opt, dir.path).path.empty());
}

TEST(Checkpoint, BadSaveArgumentsChangeNothing) {
  TempDir dir;
  auto opt = ckpt_make(ckpt_config(), world());
  ckpt_train(*opt, 0, 1);
  ckpt::save(*opt, dir.path);
  const auto before = world().rank() == 0 ? tree(dir.path) : std::map<std::string, std::vector<uint8_t>>{};
  auto expect_error = [&](const ckpt::SaveOptions& so, const std::string& needle) {
    try {
      ckpt::save(*opt, dir.path, so);
      ADD_FAILURE() << "save accepted bad input (" << needle << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ckpt::SaveOptions so;
  so.client_state = "{\"epoch\": 1,";
  expect_error(so, "client_state");
  so = {};
  so.tag = ".hidden";
  expect_error(so, "'tag'");
  so.tag = "a/b";
  expect_error(so, "'tag'");
  so.tag = "latest";
  expect_error(so, "'tag'");
  setenv("ZERO8_CKPT_CRASH_AT", "nowhere:0", 1);
  expect_error({}, "ZERO8_CKPT_CRASH_AT");
  unsetenv("ZERO8_CKPT_CRASH_AT");
  if (world().rank() == 0) {
    EXPECT_TRUE(tree(dir.path) == before) << "a failed save changed the directory";
  }
}

void flip_byte(const std::string& path, int64_t offset) {
  std::vector<uint8_t> b = file_read_bytes(path);
  b.at(size_t(offset)) ^= 0x10;
  file_write_bytes(path, b);
}

void truncate_half(const std::string& path) { fs::resize_file(path, fs::file_size(path) / 2); }

// Edits the manifest as a person would: without keep_checksum, its own checksum field goes too (what
// a load then checks is the edited field); with it, the edit is corruption the checksum must catch.
void manifest_edit(const std::string& tag_dir, const std::function<void(nlohmann::ordered_json&)>& f,
                   bool keep_checksum = false) {
  const std::string p = tag_dir + "/manifest.json";
  const std::vector<uint8_t> b = file_read_bytes(p);
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(std::string(b.begin(), b.end()));
  f(j);
  if (!keep_checksum) j.erase(ckpt::kManifestHashKey);
  const std::string t = j.dump(1);
  file_write_bytes(p, std::vector<uint8_t>(t.begin(), t.end()));
}

// manifest_xxh3 as zero8 computes it: XXH3-64 of the compact dump of every other field, in the
// order they are written (zero8's manifest JSON is nlohmann::ordered_json). Lets a test write a
// manifest as an older zero8 did, checksum included.
std::string manifest_xxh3_of(nlohmann::ordered_json j) {
  j.erase(ckpt::kManifestHashKey);
  const std::string text = j.dump();
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", (unsigned long long)XXH3_64bits(text.data(), text.size()));
  return buf;
}

TEST(Checkpoint, BadInputFailsNamingTheFileAndChangesNothing) {
  TempDir dir;
  const int w = world().size();
  {
    auto opt = ckpt_make(ckpt_config(), world());
    ckpt_train(*opt, 0, 2);
    ckpt::save(*opt, dir.path + "/good");
    ckpt_train(*opt, 2, 1);
    ckpt::save(*opt, dir.path + "/other");  // the same model one step later: a foreign save
  }
  const std::string tag = "global_step2";
  const std::string last_shard = ckpt::shard_file_name(w - 1);

  struct Case {
    std::string name;
    std::function<void(const std::string& ckpt_dir)> mutate;  // run by rank 0 on a copy
    std::function<ShardConfig()> config;
    std::vector<ParamSpec> params;
    std::vector<std::string> expect;  // substrings of the error
    bool verify = true;
  };
  auto same = [] { return ckpt_config(); };
  auto nothing = [](const std::string&) {};
  std::vector<ParamSpec> renamed = ckpt_params(), reshaped = ckpt_params(), fewer = ckpt_params(), regrouped = ckpt_params();
  renamed[1].name = "ln.weight";
  regrouped[1].hyper_group = 1;
  reshaped[2].shape = {5004};
  fewer.pop_back();
  std::vector<Case> cases = {
      {"missing shard", [&](const std::string& d) { fs::remove(d + "/" + tag + "/" + last_shard); }, same, ckpt_params(),
       {last_shard, "missing"}},
      {"truncated shard", [&](const std::string& d) { truncate_half(d + "/" + tag + "/zero8_shard_rank0.bin"); }, same,
       ckpt_params(), {"zero8_shard_rank0.bin", "truncated"}},
      {"truncated shard, checksums off", [&](const std::string& d) { truncate_half(d + "/" + tag + "/zero8_shard_rank0.bin"); },
       same, ckpt_params(), {"zero8_shard_rank0.bin", "truncated"}, false},
      {"flipped byte in a shard",
       [&](const std::string& d) {
         const std::string p = d + "/" + tag + "/" + last_shard;
         flip_byte(p, int64_t(fs::file_size(p)) / 2);
       },
       same, ckpt_params(), {last_shard, "checksum mismatch"}},
      {"flipped byte in the model file",
       [&](const std::string& d) {
         const std::string p = d + "/" + tag + "/model.safetensors";
         flip_byte(p, int64_t(fs::file_size(p)) - 3);
       },
       same, ckpt_params(), {"model.safetensors", "checksum mismatch"}},
      {"shard of another save",
       [&](const std::string& d) {
         fs::copy_file(dir.path + "/other/global_step3/zero8_shard_rank0.bin", d + "/" + tag + "/zero8_shard_rank0.bin",
                       fs::copy_options::overwrite_existing);
       },
       same, ckpt_params(), {"zero8_shard_rank0.bin", "another save"}},
      {"another model: a name differs", nothing, same, renamed, {"manifest.json", "another model", "'ln.w'", "'ln.weight'"}},
      {"another model: a shape differs", nothing, same, reshaped, {"manifest.json", "'w1'", "[5003]", "[5004]"}},
      {"another model: a parameter fewer", nothing, same, fewer, {"manifest.json", "another model", "'empty'"}},
      {"another param group", nothing, same, regrouped,
       {"manifest.json", "parameter 'ln.w' is in param group 0 in the checkpoint, param group 1 here"}},
      {"different state block size", nothing,
       [] {
         ShardConfig c = ckpt_config();
         c.layout.state_block = 128;
         return c;
       },
       ckpt_params(), {"manifest.json", "state block size", "64", "128"}},
      {"different optimizer", nothing,
       [] {
         ShardConfig c = ckpt_config();
         c.algo = optim::Algo::lion;
         return c;
       },
       ckpt_params(), {"manifest.json", "different optimizer", "adamw", "lion"}},
      {"different state bits", nothing,
       [] {
         ShardConfig c = ckpt_config();
         c.bits = 32;
         return c;
       },
       ckpt_params(), {"manifest.json", "8-bit", "32-bit"}},
      {"unknown format version",
       [&](const std::string& d) { manifest_edit(d + "/" + tag, [](nlohmann::ordered_json& j) { j["format_version"] = 99; }); },
       same, ckpt_params(), {"manifest.json", "unknown format version 99"}},
      {"a digit of the client state changed",
       [&](const std::string& d) {
         manifest_edit(d + "/" + tag, [](nlohmann::ordered_json& j) { j["client_state"] = {{"global_steps", 1008}}; }, true);
       },
       same, ckpt_params(), {"manifest.json", "checksum mismatch", "manifest_xxh3"}},
      {"manifest cut short", [&](const std::string& d) { truncate_half(d + "/" + tag + "/manifest.json"); }, same,
       ckpt_params(), {"manifest.json", "not valid JSON"}},
      {"a range in no shard",
       [&](const std::string& d) {
         manifest_edit(d + "/" + tag, [](nlohmann::ordered_json& j) {
           auto& secs = j["files"][0]["sections"];
           for (auto& s : secs)
             if (s["kind"] == "codes1" && s["group"] == "8bit") {
               s["end"] = s["end"].get<int64_t>() - 64;
               s["bytes"] = s["bytes"].get<int64_t>() - 64;
             }
         });
       },
       same, ckpt_params(), {"manifest.json", "8bit codes1", "in no shard"}},
      {"no latest", [&](const std::string& d) { fs::remove(d + "/latest"); }, same, ckpt_params(), {"latest", "missing"}},
  };

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string d = dir.path + "/case";
    std::map<std::string, std::vector<uint8_t>> before;
    if (world().rank() == 0) {
      fs::remove_all(d);
      fs::copy(dir.path + "/good", d, fs::copy_options::recursive);
      c.mutate(d);
      before = tree(d);
    }
    world().barrier();
    auto opt = ckpt_make(c.config(), world(), 9, c.params);
    ckpt_train(*opt, 50, 1);
    const Snapshot s = ckpt_snapshot(*opt);
    ckpt::LoadOptions lo;
    lo.verify = c.verify;
    try {
      ckpt::load(*opt, d, lo);
      ADD_FAILURE() << "load accepted it";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io) << e.what();
      if (world().rank() == 0) std::printf("  %-34s -> %s\n", c.name.c_str(), e.what());
      for (const std::string& needle : c.expect)
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
    }
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*opt), s), "") << "a failed load changed the optimizer";
    if (world().rank() == 0) {
      EXPECT_TRUE(tree(d) == before) << "a failed load changed the files";
    }
    world().barrier();
  }
  // The untouched copy still loads.
  auto opt = ckpt_make(ckpt_config(), world(), 9);
  EXPECT_EQ(ckpt::load(*opt, dir.path + "/good").step, 2);
}

// The module's other tensors (model_rest.safetensors) and an extra file: save writes them from the
// caller's memory, and a load, which uses neither itself, checks the extra file on every rank (each
// rank's caller reads it) and model_rest on rank 0 only: the other ranks do not read it. A corrupt
// model_rest still fails the load on every rank and changes nothing.
TEST(Checkpoint, LoadChecksModelRestOnRankZeroOnly) {
  TempDir dir;
  const int r = world().rank();
  auto a = ckpt_make(ckpt_config(), world(), 77);
  ckpt_train(*a, 0, 1);
  std::vector<float> frozen(3000);
  for (size_t i = 0; i < frozen.size(); ++i) frozen[i] = 0.5f * float(i);
  const std::string notes(777, 'n');
  ckpt::SaveOptions so;
  so.extra_files = {{"notes.bin", {notes.data(), int64_t(notes.size())}}};
  for (const ParamSpec& p : ckpt_params()) so.state_dict.emplace_back(p.name, p.name);
  so.state_dict.emplace_back("frozen", "frozen");
  so.module_tensors = {{"frozen", "F32", {3000}, {frozen.data(), int64_t(frozen.size() * 4)}}};
  const std::string tag_dir = ckpt::save(*a, dir.path, so).path;
  const ckpt::Manifest mf = ckpt::manifest_read(tag_dir);
  std::map<std::string, int64_t> size;
  for (const ckpt::FileInfo& f : mf.files) size[f.name] = f.bytes;
  const std::string rest = tag_dir + "/" + ckpt::kModelRestName;
  if (r == 0) {  // the tensor's bytes as given, after the safetensors head
    const std::vector<uint8_t> b = file_read_bytes(rest);
    ASSERT_EQ(int64_t(b.size()), size.at(ckpt::kModelRestName));
    EXPECT_EQ(std::memcmp(b.data() + b.size() - frozen.size() * 4, frozen.data(), frozen.size() * 4), 0);
    EXPECT_EQ(file_read_bytes(tag_dir + "/notes.bin"), std::vector<uint8_t>(notes.begin(), notes.end()));
  }

  auto b = ckpt_make(ckpt_config(), world(), 9);
  const ckpt::LoadResult lr = ckpt::load(*b, dir.path);
  int64_t want = size.at(ckpt::shard_file_name(r)) + size.at("notes.bin");
  if (r == 0) want += size.at(ckpt::kModelName) + size.at(ckpt::kModelRestName);
  EXPECT_EQ(lr.bytes_hashed, want) << "rank " << r;

  if (r == 0) flip_byte(rest, size.at(ckpt::kModelRestName) - 5);
  world().barrier();
  auto c = ckpt_make(ckpt_config(), world(), 9);
  const Snapshot before = ckpt_snapshot(*c);
  try {
    ckpt::load(*c, dir.path);
    ADD_FAILURE() << "a corrupt model_rest loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model_rest.safetensors: checksum mismatch"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*c), before), "") << "a failed load changed the optimizer";
  // The engine's module-only load checks the extra files without a communicator: model_rest on one rank.
  EXPECT_NO_THROW(ckpt::manifest_read_extras_checked(tag_dir, false));
  EXPECT_THROW(ckpt::manifest_read_extras_checked(tag_dir), Error);
}

TEST(Checkpoint, LoadIntoOtherParamGroupsFailsNamingTheParameterAndChangesNothing) {
  // The optimizer states are laid out by param group (hyper group): a load into an optimizer whose
  // parameters sit in other groups fails naming the first such parameter, on every rank, before
  // anything moves. "renumbered" keeps every offset (groups 0, 1, 3 sort as 0, 1, 2): only the
  // recorded group tells it apart.
  TempDir dir;
  {
    auto a = ckpt_make(ckpt_hyper_config(), world(), 77, ckpt_hyper_params());
    ckpt_train(*a, 0, 2);
    ckpt::save(*a, dir.path + "/groups");
    auto b = ckpt_make(ckpt_config(), world(), 77);
    ckpt_train(*b, 0, 2);
    ckpt::save(*b, dir.path + "/plain");
  }
  struct Case {
    const char* name;
    const char* ckpt;
    std::vector<ParamSpec> params;
    std::string expect;
  };
  std::vector<ParamSpec> plain = ckpt_params(), swapped = ckpt_hyper_params(), moved = ckpt_hyper_params(),
                         renumbered = ckpt_hyper_params();
  for (ParamSpec& p : swapped) p.hyper_group = p.hyper_group == 0 ? 0 : 3 - p.hyper_group;
  moved[7].hyper_group = 0;  // w3, the last 8-bit parameter
  for (ParamSpec& p : renumbered)
    if (p.hyper_group == 2) p.hyper_group = 3;
  const std::vector<Case> cases = {
      {"param groups into a model without them", "groups", plain,
       "parameter 'embed' is in param group 2 in the checkpoint, param group 0 here"},
      {"groups 1 and 2 swapped", "groups", swapped, "parameter 'embed' is in param group 2 in the checkpoint, param group 1 here"},
      {"one tensor in another group", "groups", moved, "parameter 'w3' is in param group 2 in the checkpoint, param group 0 here"},
      {"group 2 renumbered 3", "groups", renumbered,
       "parameter 'embed' is in param group 2 in the checkpoint, param group 3 here"},
      {"no param groups into a model with them", "plain", ckpt_hyper_params(),
       "parameter 'embed' is in param group 0 in the checkpoint, param group 2 here"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string d = dir.path + "/" + c.ckpt;
    const auto before = world().rank() == 0 ? tree(d) : std::map<std::string, std::vector<uint8_t>>{};
    ShardConfig cfg = ckpt_hyper_config();
    cfg.group_hypers.resize(4, cfg.hyper);
    auto opt = ckpt_make(cfg, world(), 9, c.params);
    ckpt_train(*opt, 50, 1);
    const Snapshot s = ckpt_snapshot(*opt);
    try {
      ckpt::load(*opt, d);
      ADD_FAILURE() << "load accepted it";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io) << e.what();
      if (world().rank() == 0) std::printf("  %-40s -> %s\n", c.name, e.what());
      for (const std::string& needle : {std::string("manifest.json"), c.expect})
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
    }
    EXPECT_EQ(ckpt_diff(ckpt_snapshot(*opt), s), "") << "a failed load changed the optimizer";
    if (world().rank() == 0) {
      EXPECT_TRUE(tree(d) == before) << "a failed load changed the files";
    }
    world().barrier();
  }
}

TEST(Checkpoint, ManifestWithoutParamGroupsLoads) {
  // A manifest written before param groups existed has no "hyper_group" (and its manifest_xxh3 covers
  // the fields it has): every parameter is in group 0, and resume stays bit-exact.
  TempDir dir;
  const int k = 2, m = 2;
  auto a = ckpt_make(ckpt_config(), world(), 77);
  ckpt_train(*a, 0, k);
  const Snapshot at_save = ckpt_snapshot(*a);
  const ckpt::SaveResult sr = ckpt::save(*a, dir.path);
  ckpt_train(*a, k, m);
  const Snapshot run_a = ckpt_snapshot(*a);
  auto erase_groups = [](nlohmann::ordered_json& j) {
    for (auto& p : j["params"]) {
      ASSERT_TRUE(p.contains("hyper_group")) << p.dump();
      p.erase("hyper_group");
    }
    j[ckpt::kManifestHashKey] = manifest_xxh3_of(j);
  };
  if (world().rank() == 0) manifest_edit(sr.path, erase_groups, true);
  world().barrier();
  auto b = ckpt_make(ckpt_config(), world(), 1234);
  ckpt_train(*b, 100, 1);
  const ckpt::LoadResult lr = ckpt::load(*b, dir.path);
  EXPECT_EQ(lr.step, k);
  EXPECT_TRUE(lr.warnings.empty()) << lr.warnings.front();
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), at_save), "") << "right after load, rank " << world().rank();
  ckpt_train(*b, k, m);
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*b), run_a), "") << "after " << m << " more steps, rank " << world().rank();
  if (world().rank() == 0) {
    const ckpt::Manifest mf = ckpt::manifest_read(sr.path);
    for (const ckpt::ParamInfo& p : mf.params) EXPECT_EQ(p.hyper_group, 0) << p.name;
    EXPECT_TRUE(ckpt::verify(sr.path).ok());
  }

  // A checkpoint with param groups whose fields were dropped is not read as group 0: its offsets are
  // those of the groups' runs, and the manifest is refused naming the first parameter they disagree on.
  auto g = ckpt_make(ckpt_hyper_config(), world(), 77, ckpt_hyper_params());
  ckpt_train(*g, 0, 1);
  const ckpt::SaveResult gr = ckpt::save(*g, dir.path + "/groups");
  if (world().rank() == 0) manifest_edit(gr.path, erase_groups, true);
  world().barrier();
  auto c = ckpt_make(ckpt_config(), world(), 9);
  const Snapshot before = ckpt_snapshot(*c);
  try {
    ckpt::load(*c, dir.path + "/groups");
    ADD_FAILURE() << "a manifest with the groups' offsets and no groups loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'embed': group/offset/numel 8bit/14080/4773 disagree with the layout"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ckpt_diff(ckpt_snapshot(*c), before), "") << "a failed load changed the optimizer";
}

}  // namespace
}  // namespace zero8::test
