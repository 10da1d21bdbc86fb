// The stored format-1 checkpoints of tests/data/checkpoints/ load with this build, under mpirun -np K
// (K = 1, 2, 4: the saving world size and others). ckpt_v1_gen.cpp wrote them by hand with the
// checkpoint code of main at 9adaddd (before checkpoint.cpp was split), and wrote <case>.expected.json
// from the live optimizer, gathered with the communicator alone; ckpt_v1.h says what each case holds.
// Checked: every fp32 master, working value, 8-bit code and absmax and fp32 state equals the recorded
// one bit for bit, as do the step, the loss scaler, the client state and config, and each rank's
// error-feedback residual at the saving world size (dropped with a warning at another); the shard
// headers read through checkpoint_format.h; verify() accepts every file; the fp32 export holds the
// masters and the module's other tensors; the extra file is intact; the loaded optimizer steps on.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "ckpt_util.h"
#include "ckpt_v1.h"
#include "dist_env.h"
#include "zero8/checkpoint.h"
#include "zero8/checkpoint_format.h"

namespace zero8::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string v1_dir(const V1Case& c) { return std::string(ZERO8_TEST_DATA_DIR) + "/checkpoints/" + c.name; }

json v1_expected(const V1Case& c) {
  const std::vector<uint8_t> b = file_read_bytes(v1_dir(c) + ".expected.json");
  return json::parse(b.begin(), b.end());
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// "" when the n floats at `got` are the recorded ones bit for bit, else the first difference.
std::string floats_diff(const json& want, const void* got, int64_t n) {
  if (int64_t(want.size()) != n) return std::to_string(n) + " values, recorded " + std::to_string(want.size());
  for (int64_t i = 0; i < n; ++i) {
    float g;
    std::memcpy(&g, static_cast<const uint8_t*>(got) + i * 4, 4);
    const float w = float(want[size_t(i)].get<double>());
    if (float_bits(g) != float_bits(w)) {
      char buf[128];
      std::snprintf(buf, sizeof(buf), "element %lld: %.9g (0x%08x), recorded %.9g (0x%08x)", (long long)i, double(g),
                    float_bits(g), double(w), float_bits(w));
      return buf;
    }
  }
  return "";
}

// Rank 0: what a reader of the tag's files sees (shard headers, verify, the export, the extra file).
void check_files(const V1Case& c, const json& want, ShardedOptimizer& opt) {
  const std::string tag_dir = v1_dir(c) + "/" + want.at("tag").get<std::string>();
  const ckpt::Manifest m = ckpt::manifest_read(tag_dir);
  EXPECT_EQ(m.world, c.world);
  EXPECT_EQ(m.step, want.at("step").get<int64_t>());
  for (int r = 0; r < c.world; ++r) {
    const std::vector<uint8_t> b = file_read_bytes(tag_dir + "/" + ckpt::shard_file_name(r));
    ASSERT_GE(b.size(), sizeof(ckpt::ShardHeader));
    ckpt::ShardHeader h;
    std::memcpy(&h, b.data(), sizeof(h));
    EXPECT_EQ(std::memcmp(h.magic, ckpt::kShardMagic, sizeof(h.magic)), 0);
    EXPECT_EQ(h.version, uint32_t(ckpt::kFormatVersion));
    EXPECT_EQ(h.header_bytes, sizeof(ckpt::ShardHeader));
    EXPECT_EQ(h.rank, r);
    EXPECT_EQ(h.world, c.world);
    EXPECT_EQ(h.step, m.step);
    EXPECT_EQ(h.nonce, m.nonce);
  }

  const ckpt::VerifyResult v = ckpt::verify(tag_dir);
  EXPECT_TRUE(v.ok()) << (v.problems.empty() ? "" : v.problems[0]);
  EXPECT_EQ(v.files, int(m.files.size()));

  const std::string out = (fs::temp_directory_path() / ("zero8_v1_" + std::to_string(::getpid()) + ".safetensors")).string();
  const ckpt::ExportResult er = ckpt::export_fp32(tag_dir, out);
  const StFile t = safetensors_read(out);
  fs::remove(out);
  EXPECT_EQ(er.complete, c.module);
  EXPECT_EQ(t.metadata.at("format"), "pt");
  EXPECT_EQ(t.metadata.at("zero8_tag"), want.at("tag"));
  EXPECT_EQ(t.metadata.at("zero8_step"), std::to_string(m.step));
  const shard::Layout& lay = opt.layout();
  auto master_of = [&](const std::string& param, const std::string& key) {
    for (size_t i = 0; i < lay.params.size(); ++i) {
      if (lay.params[i].name != param) continue;
      const shard::ParamSlot& s = lay.slots[i];
      const json& recorded = want.at("groups").at(shard::group_name(s.group)).at("master");
      const StTensor& x = t.tensors.at(key);
      EXPECT_EQ(x.dtype, "F32") << key;
      EXPECT_EQ(x.shape, lay.params[i].shape) << key;
      ASSERT_EQ(int64_t(x.data.size()), s.numel * 4) << key;
      const json part(recorded.begin() + s.offset, recorded.begin() + s.offset + s.numel);
      EXPECT_EQ(floats_diff(part, x.data.data(), s.numel), "") << key;
      return;
    }
    ADD_FAILURE() << "no parameter " << param;
  };
  if (!c.module) {
    EXPECT_EQ(er.tensors, int64_t(lay.params.size()));
    for (const shard::ParamSpec& p : lay.params) master_of(p.name, p.name);
    return;
  }
  // The state_dict's keys in order: the trained ones from the masters (head.weight is embed's alias),
  // pos_ids as saved (I64), bn.mean widened from F16.
  const V1Module mod;
  const ckpt::SaveOptions so = v1_save_options(c, mod);
  ASSERT_EQ(t.order.size(), so.state_dict.size());
  for (size_t i = 0; i < t.order.size(); ++i) EXPECT_EQ(t.order[i], so.state_dict[i].first);
  EXPECT_EQ(er.tensors, 10);
  EXPECT_EQ(er.trained, 8);
  EXPECT_EQ(er.rest, 2);
  for (const auto& [key, source] : so.state_dict)
    if (key != "pos_ids" && key != "bn.mean") master_of(source, key);
  const StTensor& pos = t.tensors.at("pos_ids");
  EXPECT_EQ(pos.dtype, "I64");
  ASSERT_EQ(pos.data.size(), mod.pos_ids.size() * 8);
  EXPECT_EQ(std::memcmp(pos.data.data(), mod.pos_ids.data(), pos.data.size()), 0);
  const StTensor& mean = t.tensors.at("bn.mean");
  EXPECT_EQ(mean.dtype, "F32");
  ASSERT_EQ(mean.data.size(), 12u);
  for (int i = 0; i < 3; ++i) {
    float x;
    std::memcpy(&x, mean.data.data() + i * 4, 4);
    EXPECT_EQ(x, mod.bn_mean_value(i)) << "bn.mean[" << i << "]";
  }
  EXPECT_NO_THROW(ckpt::manifest_read_extras_checked(tag_dir));
  EXPECT_EQ(file_read_bytes(tag_dir + "/" + kV1ExtraName), mod.trainer_state);
}

TEST(CheckpointV1, StoredCheckpointsLoadAsSaved) {
  const int w = world().size(), r = world().rank();
  for (const V1Case& c : kV1Cases) {
    SCOPED_TRACE(std::string(c.name) + " at " + std::to_string(w) + " ranks");
    const json want = v1_expected(c);
    ASSERT_EQ(want.at("world").get<int>(), c.world);
    const shard::ShardConfig cfg = v1_config(c);
    auto opt = std::make_unique<ShardedOptimizer>(v1_params(c), cfg, world());
    const ckpt::LoadResult lr = ckpt::load(*opt, v1_dir(c));

    EXPECT_EQ(lr.tag, want.at("tag").get<std::string>());
    EXPECT_EQ(lr.step, want.at("step").get<int64_t>());
    EXPECT_EQ(lr.saved_world, c.world);
    EXPECT_EQ(json::parse(lr.client_state), json::parse(v1_client_state(c)));
    EXPECT_EQ(json::parse(lr.config_json), json::parse(v1_config_json(c)));
    const bool residual_kept = cfg.error_feedback && w == c.world;
    if (cfg.error_feedback && !residual_kept) {
      ASSERT_EQ(lr.warnings.size(), 1u);
      EXPECT_NE(lr.warnings[0].find("error-feedback residuals dropped"), std::string::npos) << lr.warnings[0];
    } else {
      EXPECT_TRUE(lr.warnings.empty()) << lr.warnings[0];
    }

    const Global G = ckpt_gather(*opt);
    for (int g = 0; g < 2; ++g) {
      const std::string gname = shard::group_name(Group(g));
      SCOPED_TRACE("group " + gname);
      const json& gw = want.at("groups").at(gname);
      const int64_t numel = opt->layout().groups[g].numel;
      EXPECT_EQ(floats_diff(gw.at("master"), G.master[g].data(), numel), "") << "master";
      std::vector<float> working(static_cast<size_t>(numel));
      for (int64_t i = 0; i < numel; ++i) working[size_t(i)] = dtype_load(G.working[g].data(), cfg.working_dtype, i);
      EXPECT_EQ(floats_diff(gw.at("working"), working.data(), numel), "") << "working copy";
      const optim::StateLayout& sl = opt->state(Group(g))->layout();
      for (int k = 1; k <= sl.num_states; ++k) {
        const std::string n = std::to_string(k);
        if (sl.bits == 8) {
          EXPECT_EQ(G.codes[g][k - 1], gw.at("codes" + n).get<std::vector<uint8_t>>()) << "codes" << n;
          const json& a = gw.at("absmax" + n);
          EXPECT_EQ(floats_diff(a, G.absmax[g][k - 1].data(), int64_t(G.absmax[g][k - 1].size() / 4)), "") << "absmax" << n;
        } else {
          EXPECT_EQ(floats_diff(gw.at("state" + n), G.fp32[g][k - 1].data(), numel), "") << "state" << n;
        }
      }
      const std::vector<float>& res = opt->residual(Group(g));
      if (!cfg.error_feedback) {
        EXPECT_TRUE(res.empty());
      } else if (residual_kept) {
        EXPECT_EQ(floats_diff(want.at("residual").at(size_t(r)).at(gname), res.data(), int64_t(res.size())), "") << "residual";
      } else {
        EXPECT_TRUE(std::all_of(res.begin(), res.end(), [](float x) { return float_bits(x) == 0; })) << "residual not zeroed";
      }
    }
    EXPECT_EQ(opt->steps(), want.at("step").get<int64_t>());
    const json& ls = want.at("loss_scaler");
    const LossScalerState s = opt->scaler().state();
    EXPECT_EQ(s.scale, ls.at("scale").get<double>());
    EXPECT_EQ(s.cur_iter, ls.at("cur_iter").get<int64_t>());
    EXPECT_EQ(s.last_overflow_iter, ls.at("last_overflow_iter").get<int64_t>());
    EXPECT_EQ(s.cur_hysteresis, ls.at("cur_hysteresis").get<int>());

    if (r == 0) check_files(c, want, *opt);
    // The loaded optimizer steps on (a load marks it initialized), every rank the same.
    ckpt_train(*opt, opt->steps(), 1, c.gas);
    EXPECT_EQ(opt->steps(), want.at("step").get<int64_t>() + 1);
    world().barrier();
  }
}

}  // namespace
}  // namespace zero8::test
