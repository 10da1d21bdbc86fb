// Helpers of the checkpoint tests (test_checkpoint.cpp and test_checkpoint_v1.cpp under mpirun,
// ckpt_phase.cpp driven by run_checkpoint.cmake, tests/cpp/test_checkpoint_tool.cpp): a small model whose
// partitions cut through tensors, deterministic training, byte snapshots of one rank's optimizer, the
// whole model's state gathered over the ranks by the communicator alone, and a safetensors reader of the
// tests' own (all independent of the checkpoint code under test).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/hd.h"
#include "zero8/sharded.h"

namespace zero8::test {

using shard::Group;
using shard::ParamSpec;
using shard::ShardConfig;
using shard::ShardedOptimizer;

// 8-bit group: embed, w1, w2, w3 (22876 elements); fp32 group: ln.w, bias, the marked "stable",
// a scalar and an empty tensor (211 elements: at 4 ranks, ranks 2 and 3 hold no fp32 partition).
inline std::vector<ParamSpec> ckpt_params() {
  return {{"embed", {37, 129}}, {"ln.w", {100}}, {"w1", {5003}}, {"w2", {3, 3001}}, {"bias", {17}},
          {"stable", {3, 31}, true}, {"scale", {}}, {"w3", {4097}}, {"empty", {0, 5}}};
}

// 8-bit AdamW with everything on that changes what must be saved: a bf16 working copy that is not
// the rounded master (int8 parameter sync), int8 gradients with error feedback.
inline ShardConfig ckpt_config() {
  ShardConfig c;
  c.layout.state_block = 64;
  c.layout.wire_block = 128;
  c.layout.min_8bit_size = 1000;
  c.algo = optim::Algo::adamw;
  c.hyper.lr = 1e-2f;
  c.hyper.weight_decay = 0.01f;
  c.working_dtype = DType::bf16;
  c.int8_grads = true;
  c.int8_params = true;
  c.error_feedback = true;
  c.reduce_bucket_size = 2048;
  return c;
}

// The same model in three param groups (hyper groups), each with 8-bit and fp32-state parameters,
// listed out of group order so the layout reorders them: group 0 w1 | scale, empty; group 1 w2 |
// ln.w, bias; group 2 embed, w3 | stable. Runs start on state blocks (64): 8-bit runs [0, 5003),
// [5056, 14059), [14080, 22950); fp32 runs [0, 1), [64, 181), [192, 285). Partitions at 2, 3 and 4
// ranks cut through runs and tensors.
inline std::vector<ParamSpec> ckpt_hyper_params() {
  std::vector<ParamSpec> p = ckpt_params();
  const int hg[] = {2, 1, 0, 1, 1, 2, 0, 2, 0};
  for (size_t i = 0; i < p.size(); ++i) p[i].hyper_group = hg[i];
  return p;
}

// ckpt_config() with its own lr, weight decay and betas per group.
inline ShardConfig ckpt_hyper_config() {
  ShardConfig c = ckpt_config();
  optim::Hyper h1 = c.hyper, h2 = c.hyper;
  h1.lr = 3e-3f;
  h1.weight_decay = 0.0f;
  h1.beta1 = 0.8f;
  h1.beta2 = 0.99f;
  h2.lr = 5e-3f;
  h2.weight_decay = 0.1f;
  h2.beta1 = 0.85f;
  h2.beta2 = 0.95f;
  c.group_hypers = {c.hyper, h1, h2};
  return c;
}

inline float ckpt_init_value(uint64_t seed, int param, int64_t i) {
  return (rng_uniform(seed, uint64_t(param) * 1000003ull + uint64_t(i)) - 0.5f) * 0.2f;
}

// Rank r's local gradient of (step, micro): differs per rank, step and parameter.
inline float ckpt_grad_value(int r, int64_t step, int micro, int param, int64_t i) {
  const float u = rng_uniform(uint64_t(1 + step * 16 + micro), uint64_t(r) * 0x9e3779b9ull + uint64_t(param) * 1000003ull + uint64_t(i));
  return (u - 0.5f) * std::ldexp(1.0f, -(param % 4));
}

inline std::unique_ptr<ShardedOptimizer> ckpt_make(const ShardConfig& c, comm::Communicator& comm, uint64_t seed = 77,
                                                   const std::vector<ParamSpec>& params = ckpt_params()) {
  auto opt = std::make_unique<ShardedOptimizer>(params, c, comm);
  for (size_t p = 0; p < opt->layout().params.size(); ++p) {
    void* w = opt->param_working(int(p));
    for (int64_t i = 0; i < opt->layout().slots[p].numel; ++i) dtype_store(w, c.working_dtype, i, ckpt_init_value(seed, int(p), i));
  }
  opt->init(0);
  return opt;
}

// Steps [first, first + steps) with `gas` micro-batches each; the gradient of step s is the same
// whoever computes it (a resumed run feeds what the uninterrupted one fed). Gradients are multiplied
// by the loss scale as a training loop does. inf_step: on that step rank 0 feeds an Inf (skipped).
inline void ckpt_train(ShardedOptimizer& opt, int64_t first, int steps, int gas = 1, int64_t inf_step = -1) {
  const int r = opt.rank();
  for (int64_t s = first; s < first + steps; ++s) {
    const float scale = float(opt.loss_scale());
    for (int m = 0; m < gas; ++m) {
      for (size_t p = 0; p < opt.layout().params.size(); ++p) {
        float* g = opt.param_grad(int(p));
        for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) g[i] += ckpt_grad_value(r, s, m, int(p), i) * scale;
      }
      if (s == inf_step && m == 0 && r == 0 && opt.layout().slots[2].numel > 0) opt.param_grad(2)[5] = INFINITY;
      for (int p = int(opt.layout().params.size()) - 1; p >= 0; --p) opt.grad_ready(p);
      opt.backward_end(m == gas - 1);
    }
    opt.step();
  }
}

// Everything one rank holds that a resumed run depends on, as bytes.
struct Snapshot {
  std::vector<uint8_t> working[2], master[2], residual[2];
  std::vector<uint8_t> codes[2][2], absmax[2][2], fp32[2][2];
  int64_t steps = 0;
  LossScalerState scaler;
};

template <class T>
std::vector<uint8_t> bytes_of(const T* p, int64_t n) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  return n > 0 ? std::vector<uint8_t>(b, b + n * int64_t(sizeof(T))) : std::vector<uint8_t>();
}

inline Snapshot ckpt_snapshot(ShardedOptimizer& opt) {
  Snapshot s;
  for (int g = 0; g < 2; ++g) {
    const auto& gl = opt.layout().groups[g];
    const int64_t valid = gl.part_valid(opt.rank());
    s.working[g] = bytes_of(static_cast<uint8_t*>(opt.working(Group(g))), gl.padded() * dtype_size(opt.config().working_dtype));
    s.master[g] = bytes_of(opt.master(Group(g)), valid);
    s.residual[g] = bytes_of(opt.residual(Group(g)).data(), int64_t(opt.residual(Group(g)).size()));
    optim::State* st = opt.state(Group(g));
    for (int k = 1; k <= st->layout().num_states; ++k) {
      if (st->layout().bits == 8) {
        s.codes[g][k - 1] = bytes_of(st->codes(k), valid);
        s.absmax[g][k - 1] = bytes_of(st->absmax(k), st->layout().num_blocks());
      } else {
        s.fp32[g][k - 1] = bytes_of(st->fp32(k), valid);
      }
    }
  }
  s.steps = opt.steps();
  s.scaler = opt.scaler().state();
  return s;
}

// "" when equal, else what differs.
inline std::string ckpt_diff(const Snapshot& a, const Snapshot& b) {
  std::ostringstream os;
  for (int g = 0; g < 2; ++g) {
    if (a.working[g] != b.working[g]) os << "working copy of group " << g << "; ";
    if (a.master[g] != b.master[g]) os << "master of group " << g << "; ";
    if (a.residual[g] != b.residual[g]) os << "error-feedback residual of group " << g << "; ";
    for (int k = 0; k < 2; ++k) {
      if (a.codes[g][k] != b.codes[g][k]) os << "codes of state " << k + 1 << " group " << g << "; ";
      if (a.absmax[g][k] != b.absmax[g][k]) os << "absmax of state " << k + 1 << " group " << g << "; ";
      if (a.fp32[g][k] != b.fp32[g][k]) os << "fp32 state " << k + 1 << " group " << g << "; ";
    }
  }
  if (a.steps != b.steps) os << "steps " << a.steps << " vs " << b.steps << "; ";
  if (std::memcmp(&a.scaler.scale, &b.scaler.scale, sizeof(double)) != 0 || a.scaler.cur_iter != b.scaler.cur_iter ||
      a.scaler.last_overflow_iter != b.scaler.last_overflow_iter || a.scaler.cur_hysteresis != b.scaler.cur_hysteresis)
    os << "loss scaler; ";
  return os.str();
}

// The whole model's state, gathered over the ranks with plain all_gather_v (every rank gets it).
struct Global {
  std::vector<uint8_t> master[2], working[2];
  std::vector<uint8_t> codes[2][2], absmax[2][2], fp32[2][2];
};

inline std::vector<uint8_t> gather_parts(comm::Communicator& c, const void* mine, const std::vector<int64_t>& begin,
                                         const std::vector<int64_t>& count, int esize) {
  const size_t w = size_t(c.size());
  std::vector<int64_t> bytes(w), displs(w);
  int64_t total = 0;
  for (size_t p = 0; p < w; ++p) {
    bytes[p] = count[p] * esize;
    displs[p] = begin[p] * esize;
    total = std::max(total, displs[p] + bytes[p]);
  }
  std::vector<uint8_t> out(static_cast<size_t>(total));
  static const uint8_t none = 0;
  c.all_gather_v(bytes[size_t(c.rank())] ? mine : &none, bytes[size_t(c.rank())], out.data(), bytes, displs);
  return out;
}

inline Global ckpt_gather(ShardedOptimizer& opt) {
  Global G;
  comm::Communicator& c = opt.comm();
  const int w = c.size();
  for (int g = 0; g < 2; ++g) {
    const auto& gl = opt.layout().groups[g];
    const size_t nw = static_cast<size_t>(w);
    std::vector<int64_t> begin(nw), count(nw), bbegin(nw), bcount(nw);
    const int32_t B = opt.config().layout.state_block;
    for (int p = 0; p < w; ++p) {
      // A rank without elements is placed at the end, where it adds nothing.
      const int64_t valid = gl.part_valid(p);
      begin[size_t(p)] = valid > 0 ? gl.part_begin(p) : gl.numel;
      count[size_t(p)] = valid;
      bbegin[size_t(p)] = valid > 0 ? gl.part_begin(p) / B : (gl.numel + B - 1) / B;
      bcount[size_t(p)] = (valid + B - 1) / B;
    }
    G.master[g] = gather_parts(c, opt.master(Group(g)), begin, count, 4);
    optim::State* st = opt.state(Group(g));
    for (int k = 1; k <= st->layout().num_states; ++k) {
      if (st->layout().bits == 8) {
        G.codes[g][k - 1] = gather_parts(c, st->codes(k), begin, count, 1);
        G.absmax[g][k - 1] = gather_parts(c, st->absmax(k), bbegin, bcount, 4);
      } else {
        G.fp32[g][k - 1] = gather_parts(c, st->fp32(k), begin, count, 4);
      }
    }
    const int es = dtype_size(opt.config().working_dtype);
    const uint8_t* wk = static_cast<const uint8_t*>(opt.working(Group(g)));
    G.working[g] = gl.numel > 0 ? std::vector<uint8_t>(wk, wk + gl.numel * es) : std::vector<uint8_t>();
  }
  return G;
}

inline void file_write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline std::vector<uint8_t> file_read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A safetensors file as the format defines it: u64 LE header length (the header padded to a multiple
// of 8 bytes), the JSON header, then the tensors' bytes, which fill the rest of the file without gaps or
// overlaps. Throws std::runtime_error naming the file and the fault.
struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};
struct StFile {
  nlohmann::json metadata;         // __metadata__ (null when absent)
  std::vector<std::string> order;  // the tensors' names as the header lists them
  std::map<std::string, StTensor> tensors;
};

inline StFile safetensors_read(const std::string& path) {
  auto fail = [&](const std::string& what) { throw std::runtime_error(path + ": " + what); };
  const std::vector<uint8_t> f = file_read_bytes(path);
  if (f.size() < 8) fail("shorter than 8 bytes");
  uint64_t n = 0;
  std::memcpy(&n, f.data(), 8);
  if (n > f.size() - 8) fail("header length " + std::to_string(n) + " exceeds the file");
  if (n % 8 != 0) fail("header not padded to 8 bytes");
  const nlohmann::ordered_json h = nlohmann::ordered_json::parse(f.begin() + 8, f.begin() + 8 + long(n));
  StFile out;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  const uint64_t data = f.size() - 8 - n;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      out.metadata = nlohmann::json::parse(it.value().dump());
      continue;
    }
    StTensor t;
    t.dtype = it.value().at("dtype").get<std::string>();
    t.shape = it.value().at("shape").get<std::vector<int64_t>>();
    const uint64_t b = it.value().at("data_offsets")[0], e = it.value().at("data_offsets")[1];
    if (b > e || e > data) fail("tensor '" + it.key() + "': data_offsets outside the data");
    t.data.assign(f.begin() + long(8 + n + b), f.begin() + long(8 + n + e));
    spans.emplace_back(b, e);
    out.order.push_back(it.key());
    out.tensors[it.key()] = std::move(t);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t pos = 0;
  for (const auto& [b, e] : spans) {
    if (b != pos) fail("data holes or overlaps at byte " + std::to_string(pos));
    pos = e;
  }
  if (pos != data) fail("data holes or trailing bytes: " + std::to_string(data) + " data bytes, the tensors " + std::to_string(pos));
  return out;
}

inline void ckpt_dump(const Global& G, const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (int g = 0; g < 2; ++g) {
    const std::string p = dir + "/g" + std::to_string(g) + "_";
    file_write_bytes(p + "master.bin", G.master[g]);
    file_write_bytes(p + "working.bin", G.working[g]);
    for (int k = 0; k < 2; ++k) {
      file_write_bytes(p + "codes" + std::to_string(k + 1) + ".bin", G.codes[g][k]);
      file_write_bytes(p + "absmax" + std::to_string(k + 1) + ".bin", G.absmax[g][k]);
      file_write_bytes(p + "state" + std::to_string(k + 1) + ".bin", G.fp32[g][k]);
    }
  }
}

inline Global ckpt_undump(const std::string& dir) {
  Global G;
  for (int g = 0; g < 2; ++g) {
    const std::string p = dir + "/g" + std::to_string(g) + "_";
    G.master[g] = file_read_bytes(p + "master.bin");
    G.working[g] = file_read_bytes(p + "working.bin");
    for (int k = 0; k < 2; ++k) {
      G.codes[g][k] = file_read_bytes(p + "codes" + std::to_string(k + 1) + ".bin");
      G.absmax[g][k] = file_read_bytes(p + "absmax" + std::to_string(k + 1) + ".bin");
      G.fp32[g][k] = file_read_bytes(p + "state" + std::to_string(k + 1) + ".bin");
    }
  }
  return G;
}

inline std::string ckpt_global_diff(const Global& a, const Global& b) {
  std::ostringstream os;
  for (int g = 0; g < 2; ++g) {
    if (a.master[g] != b.master[g]) os << "master of group " << g << "; ";
    if (a.working[g] != b.working[g]) os << "working copy of group " << g << "; ";
    for (int k = 0; k < 2; ++k) {
      if (a.codes[g][k] != b.codes[g][k]) os << "codes of state " << k + 1 << " group " << g << "; ";
      if (a.absmax[g][k] != b.absmax[g][k]) os << "absmax of state " << k + 1 << " group " << g << "; ";
      if (a.fp32[g][k] != b.fp32[g][k]) os << "fp32 state " << k + 1 << " group " << g << "; ";
    }
  }
  return os.str();
}

}  // namespace zero8::test
