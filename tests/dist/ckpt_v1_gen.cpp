// Writes one of the stored format-version-1 checkpoints (ckpt_v1.h) and the values it must load as; run
// by hand, not by ctest, with the world size of the case:
//   mpirun -np 2 build/tests/dist/ckpt_v1_gen tests/data/checkpoints adamw8_np2
//   mpirun -np 1 build/tests/dist/ckpt_v1_gen tests/data/checkpoints lion8_fp16_np1
// It trains the case's model from ckpt_util.h's deterministic values, saves <out>/<case>/ with ckpt::save,
// and writes <out>/<case>.expected.json from the live optimizer, gathered over the ranks with the
// communicator alone (not the checkpoint code): every element of the fp32 masters, the working copy,
// the 8-bit codes and absmax, fp32 states, each rank's error-feedback residual, the step and the loss
// scaler. A rerun gives the same expected.json; the checkpoint differs only in its nonce and save time.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt_util.h"
#include "ckpt_v1.h"
#include "zero8/checkpoint.h"
#include "zero8/comm/communicator.h"

namespace fs = std::filesystem;
using namespace zero8;
using namespace zero8::test;
using json = nlohmann::ordered_json;

namespace {

// Floats as the shortest decimal that reads back as the same float ("%.9g"), negative zero kept.
json floats_json(const float* v, int64_t n) {
  std::string t = "[";
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) throw std::runtime_error("a saved value is not finite");
    char buf[32];
    if (v[i] == 0.0f) std::snprintf(buf, sizeof(buf), "%s", std::signbit(v[i]) ? "-0.0" : "0");
    else std::snprintf(buf, sizeof(buf), "%.9g", double(v[i]));
    t += (i ? "," : "") + std::string(buf);
  }
  return json::parse(t + "]");
}

json floats_json(const std::vector<uint8_t>& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return floats_json(v.data(), int64_t(v.size()));
}

// JSON text with objects (and arrays of objects) indented and arrays of numbers on one line each.
std::string text_of(const json& j, int indent = 0) {
  const bool nested = j.is_object() || (j.is_array() && std::any_of(j.begin(), j.end(), [](const json& x) { return x.is_object(); }));
  if (!nested || j.empty()) return j.dump();
  const std::string pad(size_t(indent + 1), ' ');
  std::string t = j.is_object() ? "{\n" : "[\n";
  size_t i = 0;
  for (auto it = j.begin(); it != j.end(); ++it, ++i) {
    t += pad + (j.is_object() ? json(it.key()).dump() + ": " : "") + text_of(it.value(), indent + 1);
    t += i + 1 < j.size() ? ",\n" : "\n";
  }
  return t + std::string(size_t(indent), ' ') + (j.is_object() ? "}" : "]");
}

int run(comm::Communicator& c, const std::string& out, const std::string& name) {
  const V1Case* vc = nullptr;
  for (const V1Case& k : kV1Cases)
    if (name == k.name) vc = &k;
  if (!vc) throw std::runtime_error("unknown case '" + name + "' (see ckpt_v1.h)");
  if (c.size() != vc->world)
    throw std::runtime_error(name + " is saved by " + std::to_string(vc->world) + " ranks, this job has " +
                             std::to_string(c.size()));
  const std::string dir = out + "/" + name, expected = out + "/" + name + ".expected.json";
  if (fs::exists(dir) || fs::exists(expected)) throw std::runtime_error(dir + " or " + expected + " exists: remove them first");
  c.barrier();

  const shard::ShardConfig cfg = v1_config(*vc);
  auto opt = ckpt_make(cfg, c, 77, v1_params(*vc));
  ckpt_train(*opt, 0, vc->steps, vc->gas, vc->inf_step);
  const V1Module mod;
  const ckpt::SaveResult sr = ckpt::save(*opt, dir, v1_save_options(*vc, mod));

  const Global G = ckpt_gather(*opt);
  json groups = json::object();
  for (int g = 0; g < 2; ++g) {
    const shard::GroupLayout& gl = opt->layout().groups[g];
    json j;
    j["master"] = floats_json(G.master[g]);
    std::vector<float> working(size_t(gl.numel));
    for (int64_t i = 0; i < gl.numel; ++i) working[size_t(i)] = dtype_load(G.working[g].data(), cfg.working_dtype, i);
    j["working"] = floats_json(working.data(), gl.numel);
    const optim::StateLayout& sl = opt->state(Group(g))->layout();
    for (int k = 1; k <= sl.num_states; ++k) {
      if (sl.bits == 8) {
        j["codes" + std::to_string(k)] = G.codes[g][k - 1];
        j["absmax" + std::to_string(k)] = floats_json(G.absmax[g][k - 1]);
      } else {
        j["state" + std::to_string(k)] = floats_json(G.fp32[g][k - 1]);
      }
    }
    groups[shard::group_name(Group(g))] = std::move(j);
  }
  // Each rank's residuals (rank-local, over the whole padded group), gathered in rank order.
  json residual = json::array();
  for (int r = 0; r < c.size(); ++r) {
    json per = json::object();
    for (int g = 0; g < 2; ++g) {
      std::vector<float> v = opt->residual(Group(g));
      int64_t n = int64_t(v.size());
      c.broadcast(&n, sizeof(n), r);
      v.resize(size_t(n));
      if (n > 0) c.broadcast(v.data(), n * 4, r);
      per[shard::group_name(Group(g))] = floats_json(v.data(), n);
    }
    residual.push_back(std::move(per));
  }
  if (c.rank() == 0) {
    const LossScalerState ls = opt->scaler().state();
    json e;
    e["about"] = "values of tests/data/checkpoints/" + name + ", written by tests/dist/ckpt_v1_gen.cpp from the live optimizer";
    e["case"] = name;
    e["world"] = c.size();
    e["tag"] = sr.tag;
    e["step"] = opt->steps();
    e["loss_scaler"] = json{{"scale", ls.scale},
                            {"cur_iter", ls.cur_iter},
                            {"last_overflow_iter", ls.last_overflow_iter},
                            {"cur_hysteresis", ls.cur_hysteresis}};
    e["groups"] = std::move(groups);
    if (cfg.error_feedback) e["residual"] = std::move(residual);
    std::FILE* f = std::fopen(expected.c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + expected);
    const std::string text = text_of(e) + "\n";
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write " + expected);
    std::printf("ckpt_v1_gen: %s (tag %s, %lld bytes) and %s\n", dir.c_str(), sr.tag.c_str(), (long long)sr.bytes,
                expected.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: mpirun -np <world> ckpt_v1_gen <out dir> <case>  (cases: see ckpt_v1.h)\n");
    return 2;
  }
  std::unique_ptr<comm::Communicator> c = comm::comm_create("auto");
  try {
    return run(*c, argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_v1_gen (rank %d): %s\n", c->rank(), e.what());
    return 1;
  }
}
