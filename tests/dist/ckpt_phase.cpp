// One phase of a checkpoint scenario that needs several jobs (run_checkpoint.cmake strings them
// together: save with N ranks then load with M, kill a rank mid-save then check, run the tool):
//   ckpt_phase save <dir> <steps> [--resume] [--tag T] [--dump D] [--hyper]   (under mpirun)
//   ckpt_phase check <dir> <allowed steps a,b>                                 (under mpirun)
//   ckpt_phase resize <dir> <dump> [--hyper]                                   (under mpirun)
//   ckpt_phase fp32-compare <file.safetensors> <dump> [--hyper]                (one process)
//   ckpt_phase flip <file> <offset | middle>                                   (one process)
// --hyper: the model in three param groups with their own hyperparameters (ckpt_hyper_params).
// Prints "CKPT_PHASE OK" or "CKPT_PHASE FAIL rank R: what" lines; the exit status is non-zero when
// any rank failed. The state dumps are gathered with the communicator alone, not the checkpoint code.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ckpt_util.h"
#include "zero8/checkpoint.h"
#include "zero8/comm/communicator.h"

namespace fs = std::filesystem;
using namespace zero8;
using namespace zero8::test;

namespace {

struct Fail : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define PHASE_CHECK(cond, msg_stream)   \
  do {                                  \
    if (!(cond)) {                      \
      std::ostringstream os_;           \
      os_ << msg_stream;                \
      throw Fail(os_.str());            \
    }                                   \
  } while (0)

std::string opt_value(std::vector<std::string>& args, const std::string& name) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == name) {
      const std::string v = args[i + 1];
      args.erase(args.begin() + long(i), args.begin() + long(i) + 2);
      return v;
    }
  return "";
}

bool opt_flag(std::vector<std::string>& args, const std::string& name) {
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] == name) {
      args.erase(args.begin() + long(i));
      return true;
    }
  return false;
}

void replicas_identical(ShardedOptimizer& opt) {
  for (int g = 0; g < 2; ++g) {
    const int64_t bytes = opt.layout().groups[g].padded() * dtype_size(opt.config().working_dtype);
    if (bytes == 0) continue;
    const uint8_t* w = static_cast<const uint8_t*>(opt.working(Group(g)));
    std::vector<uint8_t> mine(w, w + bytes), root = mine;
    opt.comm().broadcast(root.data(), bytes, 0);
    PHASE_CHECK(mine == root, "working copy of group " << g << " differs from rank 0's");
  }
}

int phase_save(comm::Communicator& c, std::vector<std::string> args) {
  const bool resume = opt_flag(args, "--resume"), hyper = opt_flag(args, "--hyper");
  const std::string tag = opt_value(args, "--tag"), dump = opt_value(args, "--dump");
  PHASE_CHECK(args.size() == 2, "save <dir> <steps> [--resume] [--tag T] [--dump D] [--hyper]");
  const std::string dir = args[0];
  const int steps = std::stoi(args[1]);
  auto opt = hyper ? ckpt_make(ckpt_hyper_config(), c, 77, ckpt_hyper_params()) : ckpt_make(ckpt_config(), c);
  int64_t first = 0;
  if (resume) first = ckpt::load(*opt, dir).step;
  ckpt_train(*opt, first, steps);
  if (!dump.empty()) {
    const Global G = ckpt_gather(*opt);
    if (c.rank() == 0) ckpt_dump(G, dump);
  }
  ckpt::SaveOptions so;
  so.tag = tag;
  so.client_state = "{\"phase\": \"save\", \"world\": " + std::to_string(c.size()) + "}";
  const ckpt::SaveResult r = ckpt::save(*opt, dir, so);
  if (c.rank() == 0) std::printf("CKPT_PHASE saved %s (step %lld, %d ranks)\n", r.tag.c_str(), (long long)opt->steps(), c.size());
  return 0;
}

// After a crash mid-save: latest names a complete tag that verifies and loads at an allowed step,
// and the next save works and leaves no leftovers.
int phase_check(comm::Communicator& c, std::vector<std::string> args) {
  PHASE_CHECK(args.size() == 2, "check <dir> <allowed steps a,b>");
  const std::string dir = args[0];
  std::set<int64_t> allowed;
  std::stringstream ss(args[1]);
  for (std::string t; std::getline(ss, t, ',');) allowed.insert(std::stoll(t));
  auto opt = ckpt_make(ckpt_config(), c, 5);
  const ckpt::LoadResult lr = ckpt::load(*opt, dir);
  PHASE_CHECK(allowed.count(lr.step), "loaded step " << lr.step << " (tag " << lr.tag << "), expected one of " << args[1]);
  if (c.rank() == 0) {
    const ckpt::VerifyResult v = ckpt::verify(lr.path);
    PHASE_CHECK(v.ok(), "verify of " << lr.path << ": " << v.problems.front());
  }
  ckpt_train(*opt, lr.step, 1);
  const ckpt::SaveResult sr = ckpt::save(*opt, dir);
  const Snapshot s = ckpt_snapshot(*opt);
  if (c.rank() == 0) {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      PHASE_CHECK(n[0] != '.' && n != "latest.tmp", "leftover " << n << " after the next save");
    }
    PHASE_CHECK(ckpt::latest_read(dir) == sr.tag, "latest does not name the new tag " << sr.tag);
  }
  auto again = ckpt_make(ckpt_config(), c, 6);
  const ckpt::LoadResult l2 = ckpt::load(*again, dir);
  PHASE_CHECK(l2.step == lr.step + 1, "the next save loads at step " << l2.step);
  const std::string d = ckpt_diff(ckpt_snapshot(*again), s);
  PHASE_CHECK(d.empty(), "the next save does not load what was saved: " << d);
  if (c.rank() == 0) std::printf("CKPT_PHASE checked: %s loaded at step %lld, next save %s\n", lr.tag.c_str(), (long long)lr.step, sr.tag.c_str());
  return 0;
}

bool has_warning(const ckpt::LoadResult& r, const std::string& needle) {
  for (const std::string& w : r.warnings)
    if (w.find(needle) != std::string::npos) return true;
  return false;
}

// Single-process reference of `steps` fp32-communication steps of the whole model from a dumped state.
// Each param group's run within a state group is stepped as a tensor of its own with that param
// group's hyperparameters (without param groups: one run, the whole state group); the padding between
// runs (codes and masters) is kept as dumped.
struct Reference {
  struct Run {
    int hyper_group = 0;
    int64_t begin = 0, end = 0;
    std::unique_ptr<optim::State> state;
  };
  shard::Layout layout;
  ShardConfig cfg;
  Global saved;
  std::vector<float> master[2];
  std::vector<Run> runs[2];

  Reference(const ShardConfig& c, const Global& G, const std::vector<ParamSpec>& params) : cfg(c), saved(G) {
    shard::LayoutConfig lc = c.layout;
    lc.world = 1;
    layout = shard::Layout::build(params, lc);
    for (int g = 0; g < 2; ++g) {
      const int64_t n = layout.groups[g].numel;
      master[g].resize(size_t(n));
      if (n) std::memcpy(master[g].data(), G.master[g].data(), size_t(n) * 4);
      const int bits = g == 0 ? c.bits : 32;
      const int64_t B = c.layout.state_block;
      for (const shard::HyperRun& hr : layout.groups[g].runs) {
        Run r{hr.hyper_group, hr.begin, hr.end, nullptr};
        const int64_t rn = r.end - r.begin;
        r.state = std::make_unique<optim::State>(optim::StateLayout(c.algo, rn, bits, c.layout.state_block));
        for (int k = 1; k <= r.state->layout().num_states; ++k) {
          if (bits == 8) {
            std::memcpy(r.state->codes(k), G.codes[g][k - 1].data() + r.begin, size_t(rn));
            std::memcpy(r.state->absmax(k), G.absmax[g][k - 1].data() + r.begin / B * 4,
                        size_t(r.state->layout().num_blocks()) * 4);
          } else {
            std::memcpy(r.state->fp32(k), G.fp32[g][k - 1].data() + r.begin * 4, size_t(rn) * 4);
          }
        }
        runs[g].push_back(std::move(r));
      }
    }
  }

  // The averaged gradient as the ranks' fp32 reduce-scatter computes it: a left fold in rank order.
  void step(int64_t index, int64_t steps_before, int world) {
    for (int g = 0; g < 2; ++g) {
      const int64_t n = layout.groups[g].numel;
      if (n == 0) continue;
      std::vector<float> grad(size_t(n), 0.0f);
      for (int p : layout.groups[g].params) {
        const shard::ParamSlot& s = layout.slots[p];
        for (int64_t i = 0; i < s.numel; ++i) {
          float sum = ckpt_grad_value(0, index, 0, p, i);
          for (int r = 1; r < world; ++r) sum = sum + ckpt_grad_value(r, index, 0, p, i);
          grad[size_t(s.offset + i)] = sum;
        }
      }
      for (Run& r : runs[g]) {
        optim::Hyper h = cfg.group_hypers.empty() ? cfg.hyper : cfg.group_hypers[size_t(r.hyper_group)];
        h.step = steps_before + 1;
        h.grad_scale = float(1.0 / double(world));
        optim::step(*r.state, h, master[g].data() + r.begin, DType::f32, nullptr, grad.data() + r.begin, DType::f32, 1);
      }
    }
  }

  Global global() {
    Global G;
    const int64_t B = cfg.layout.state_block;
    for (int g = 0; g < 2; ++g) {
      G.master[g] = bytes_of(master[g].data(), int64_t(master[g].size()));
      G.working[g] = G.master[g];
      for (int k = 0; k < 2; ++k) {
        G.codes[g][k] = saved.codes[g][k];
        G.absmax[g][k] = saved.absmax[g][k];
        G.fp32[g][k] = saved.fp32[g][k];
      }
      for (const Run& r : runs[g]) {
        const int64_t rn = r.end - r.begin;
        for (int k = 1; k <= r.state->layout().num_states; ++k) {
          if (r.state->layout().bits == 8) {
            std::memcpy(G.codes[g][k - 1].data() + r.begin, r.state->codes(k), size_t(rn));
            std::memcpy(G.absmax[g][k - 1].data() + r.begin / B * 4, r.state->absmax(k),
                        size_t(r.state->layout().num_blocks()) * 4);
          } else {
            std::memcpy(G.fp32[g][k - 1].data() + r.begin * 4, r.state->fp32(k), size_t(rn) * 4);
          }
        }
      }
    }
    return G;
  }
};

// Load a checkpoint saved at another world size: every global block moved byte for byte, then
// training goes on (and equals a single-process reference started from the saved state). --hyper:
// with param groups, whose runs the new partitions cut elsewhere; each group keeps its own
// hyperparameters after the load.
int phase_resize(comm::Communicator& c, std::vector<std::string> args) {
  const bool hyper = opt_flag(args, "--hyper");
  PHASE_CHECK(args.size() == 2, "resize <dir> <dump> [--hyper]");
  const std::string dir = args[0];
  const Global saved = ckpt_undump(args[1]);
  const std::vector<ParamSpec> params = hyper ? ckpt_hyper_params() : ckpt_params();
  const ShardConfig base = hyper ? ckpt_hyper_config() : ckpt_config();
  {
    // Same configuration: masters, codes, absmax, fp32 states and the bf16 working copy identical.
    auto opt = ckpt_make(base, c, 11, params);
    const ckpt::LoadResult lr = ckpt::load(*opt, dir);
    const bool moved = lr.saved_world != c.size();
    // Residuals carry over to the same ranks only; a single rank keeps none (sharded.h, WirePlan), so
    // its checkpoint holds none.
    const char* why = !moved ? "" : lr.saved_world == 1 ? "holds no error-feedback residuals" : "residuals dropped";
    for (const char* w : {"holds no error-feedback residuals", "residuals dropped"})
      PHASE_CHECK(has_warning(lr, w) == (std::strcmp(w, why) == 0),
                  (std::strcmp(w, why) == 0 ? "no warning '" : "an unexpected warning '") << w << "' after loading "
                      << lr.saved_world << " ranks' checkpoint with " << c.size());
    const std::string d = ckpt_global_diff(ckpt_gather(*opt), saved);
    PHASE_CHECK(d.empty(), "after loading " << lr.saved_world << " ranks' checkpoint with " << c.size() << ": " << d);
    if (moved)
      for (int g = 0; g < 2; ++g)
        for (float x : opt->residual(Group(g))) PHASE_CHECK(x == 0.0f, "a dropped residual is not zero");
    PHASE_CHECK(opt->steps() == lr.step, "steps " << opt->steps() << " after loading step " << lr.step);
    ckpt_train(*opt, lr.step, 2);
    replicas_identical(*opt);
    for (int g = 0; g < 2; ++g)
      for (int64_t i = 0; i < opt->layout().groups[g].part_valid(c.rank()); ++i)
        PHASE_CHECK(std::isfinite(opt->master(Group(g))[i]), "non-finite master after training on");
    if (c.rank() == 0)
      std::printf("CKPT_PHASE resize: %d -> %d ranks, every block identical, 2 more steps trained\n", lr.saved_world, c.size());
  }
  {
    // fp32 communication and an f32 working copy: training on equals the single-process reference.
    ShardConfig cfg = base;
    cfg.int8_grads = false;
    cfg.int8_params = false;
    cfg.error_feedback = false;
    cfg.working_dtype = DType::f32;
    auto opt = ckpt_make(cfg, c, 12, params);
    const ckpt::LoadResult lr = ckpt::load(*opt, dir);
    PHASE_CHECK(has_warning(lr, "recomputed from the fp32 masters"), "no warning about the working dtype");
    PHASE_CHECK(has_warning(lr, "error feedback is off") == (lr.saved_world > 1),
                (lr.saved_world > 1 ? "no warning about the unused residuals"
                                    : "a residual warning for a single rank's checkpoint, which holds none"));
    Global now = ckpt_gather(*opt);
    Global expect = saved;
    for (int g = 0; g < 2; ++g) expect.working[g] = saved.master[g];  // f32 working copy = the masters
    std::string d = ckpt_global_diff(now, expect);
    PHASE_CHECK(d.empty(), "f32 load: " << d);
    Reference ref(cfg, saved, params);
    for (int64_t s = lr.step; s < lr.step + 3; ++s) {
      ckpt_train(*opt, s, 1);
      ref.step(s, s, c.size());
    }
    const Global after = ckpt_gather(*opt);
    d = ckpt_global_diff(after, ref.global());
    PHASE_CHECK(d.empty(), "3 steps after the load differ from the single-process reference: " << d);
    if (hyper) {
      // The groups' hyperparameters show in every state: stepped with group 0's alone, the masters
      // and states of each group but 0 would differ (so a load that lost them would be seen).
      ShardConfig one = cfg;
      one.group_hypers.assign(one.group_hypers.size(), cfg.hyper);
      Reference flat(one, saved, params);
      for (int64_t s = lr.step; s < lr.step + 3; ++s) flat.step(s, s, c.size());
      const Global f = flat.global();
      for (int g = 0; g < 2; ++g)
        for (const auto& r : ref.runs[g]) {
          if (r.hyper_group == 0) continue;
          const bool same = std::memcmp(after.master[g].data() + r.begin * 4, f.master[g].data() + r.begin * 4,
                                        size_t(r.end - r.begin) * 4) == 0;
          PHASE_CHECK(!same, "param group " << r.hyper_group << " of group " << g << " moved as with group 0's hyperparameters");
        }
    }
    if (c.rank() == 0) std::printf("CKPT_PHASE resize: 3 fp32-communication steps equal the reference\n");
  }
  return 0;
}

// The exported safetensors, read with a reader of our own: one F32 tensor per parameter (name,
// shape) whose bytes are the saved masters (--hyper: at the offsets of the model in param groups).
int phase_fp32_compare(std::vector<std::string> args) {
  const bool hyper = opt_flag(args, "--hyper");
  PHASE_CHECK(args.size() == 2, "fp32-compare <file.safetensors> <dump> [--hyper]");
  const StFile f = safetensors_read(args[0]);
  const Global saved = ckpt_undump(args[1]);
  PHASE_CHECK(f.metadata.at("format") == "pt", "metadata format is not pt");
  shard::LayoutConfig lc = ckpt_config().layout;
  const shard::Layout lay = shard::Layout::build(hyper ? ckpt_hyper_params() : ckpt_params(), lc);
  PHASE_CHECK(f.tensors.size() == lay.params.size(), f.tensors.size() << " tensors for " << lay.params.size() << " parameters");
  for (size_t p = 0; p < lay.params.size(); ++p) {
    const StTensor& t = f.tensors.at(lay.params[p].name);
    PHASE_CHECK(t.dtype == "F32", lay.params[p].name << " is " << t.dtype);
    PHASE_CHECK(t.shape == lay.params[p].shape, lay.params[p].name << " shape");
    const shard::ParamSlot& s = lay.slots[p];
    PHASE_CHECK(int64_t(t.data.size()) == s.numel * 4, lay.params[p].name << " offsets");
    // An empty tensor's data() may be null, which memcmp must not get even for 0 bytes (UBSan).
    PHASE_CHECK(s.numel == 0 ||
                    std::memcmp(t.data.data(), saved.master[int(s.group)].data() + s.offset * 4, size_t(s.numel) * 4) == 0,
                lay.params[p].name << " differs from the saved masters");
  }
  std::printf("CKPT_PHASE fp32 export equals the masters: %zu tensors\n", lay.params.size());
  return 0;
}

int phase_flip(std::vector<std::string> args) {
  PHASE_CHECK(args.size() == 2, "flip <file> <offset | middle>");
  std::vector<uint8_t> b = file_read_bytes(args[0]);
  const size_t at = args[1] == "middle" ? b.size() / 2 : size_t(std::stoll(args[1]));
  PHASE_CHECK(at < b.size(), "offset beyond the file");
  b[at] ^= 0x01;
  file_write_bytes(args[0], b);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: ckpt_phase save|check|resize|fp32-compare|flip ...\n");
    return 2;
  }
  const std::string mode = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (mode == "fp32-compare" || mode == "flip") {
    try {
      return mode == "flip" ? phase_flip(args) : phase_fp32_compare(args);
    } catch (const std::exception& e) {
      std::printf("CKPT_PHASE FAIL rank 0: %s\n", e.what());
      return 1;
    }
  }
  std::unique_ptr<comm::Communicator> c = comm::comm_create("auto");
  int failed = 0;
  try {
    if (mode == "save") failed = phase_save(*c, args);
    else if (mode == "check") failed = phase_check(*c, args);
    else if (mode == "resize") failed = phase_resize(*c, args);
    else throw Fail("unknown mode " + mode);
  } catch (const std::exception& e) {
    std::printf("CKPT_PHASE FAIL rank %d: %s\n", c->rank(), e.what());
    std::fflush(stdout);
    failed = 1;
  }
  try {
    failed = c->all_reduce_value<int32_t>(failed, comm::ReduceOp::max);
  } catch (const std::exception& e) {
    std::printf("CKPT_PHASE FAIL rank %d: final exchange: %s\n", c->rank(), e.what());
    return 3;
  }
  if (!failed && c->rank() == 0) std::printf("CKPT_PHASE OK %s\n", mode.c_str());
  return failed;
}
