// The sharded optimizer under mpirun -np K: sharded steps equal one process stepping the averaged
// gradient (bit-exact with fp32 communication, within the codec's bound with int8), stage 1 equals
// stage 2, clipping and LAMB/LARS trust ratios agree with the unsharded computation, an overflow
// on one rank makes every rank skip (also through a step group, the pipeline engine's), the bucket
// input (grad_add) and the overlap thread give the bits of the full buffer reduced in the caller's
// thread, and one rank, which sends nothing, quantizes nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>

#include "dist_env.h"
#include "zero8/error.h"
#include "zero8/sharded.h"

namespace zero8::test {
namespace {

using shard::Group;
using shard::ParamSpec;
using shard::ShardConfig;
using shard::ShardedOptimizer;

// Sizes that are multiples of nothing; small blocks so that partitions cut through tensors.
std::vector<ParamSpec> test_params() {
  return {{"embed", {37, 129}}, {"ln.w", {100}}, {"w1", {5003}}, {"w2", {3, 3001}}, {"bias", {17}},
          {"stable", {41, 101}, true}, {"w3", {4097}}};
}

ShardConfig base_config() {
  ShardConfig c;
  c.layout.state_block = 64;
  c.layout.wire_block = 128;
  c.layout.min_8bit_size = 1000;
  c.algo = optim::Algo::adamw;
  c.hyper.lr = 1e-2f;
  c.hyper.weight_decay = 0.01f;
  c.int8_grads = false;
  c.int8_params = false;  // exact communication both ways: the bit-exact tests compare with one process
  c.reduce_bucket_size = 2048;
  return c;
}

float init_value(int param, int64_t i) { return (rng_uniform(77, uint64_t(param) * 1000003ull + uint64_t(i)) - 0.5f) * 0.2f; }

// Rank r's local gradient for (step, micro): magnitudes vary per parameter.
float grad_value(int r, int step, int micro, int param, int64_t i) {
  const float u = rng_uniform(uint64_t(1 + step * 16 + micro), uint64_t(r) * 0x9e3779b9ull + uint64_t(param) * 1000003ull + uint64_t(i));
  return (u - 0.5f) * std::ldexp(1.0f, -(param % 4));
}

// One process stepping the averaged gradient over the whole group with the same kernels: the
// single-process reference. Its 8-bit blocks coincide with the sharded ones (partitions start on
// state-block boundaries).
struct Reference {
  shard::Layout layout;
  ShardConfig cfg;
  int world;
  std::vector<float> master[2];
  std::unique_ptr<optim::State> state[2];
  int64_t steps = 0;

  Reference(const ShardConfig& c, int world_) : cfg(c), world(world_) {
    shard::LayoutConfig lc = c.layout;
    lc.world = 1;
    layout = shard::Layout::build(test_params(), lc);
    for (int g = 0; g < 2; ++g) {
      const auto& gl = layout.groups[g];
      master[g].resize(size_t(gl.numel));
      state[g] = std::make_unique<optim::State>(
          optim::StateLayout(c.algo, gl.numel, g == 0 ? c.bits : 32, c.layout.state_block), c.initial_accumulator);
    }
    for (size_t p = 0; p < layout.params.size(); ++p) {
      const auto& s = layout.slots[p];
      for (int64_t i = 0; i < s.numel; ++i) master[int(s.group)][size_t(s.offset + i)] = init_value(int(p), i);
    }
  }

  // Sum over ranks in rank order, as the reduce-scatter's left fold does.
  std::vector<float> summed_grad(int g, int step) const {
    std::vector<float> sum(size_t(layout.groups[g].numel), 0.0f);
    for (int r = 0; r < world; ++r)
      for (int p : layout.groups[g].params) {
        const auto& s = layout.slots[p];
        for (int64_t i = 0; i < s.numel; ++i) {
          float& d = sum[size_t(s.offset + i)];
          d = r == 0 ? grad_value(r, step, 0, p, i) : d + grad_value(r, step, 0, p, i);
        }
      }
    return sum;
  }

  void step(int step_index, float grad_scale) {
    for (int g = 0; g < 2; ++g) {
      std::vector<float> grad = summed_grad(g, step_index);
      optim::Hyper h = cfg.hyper;
      h.step = steps + 1;
      h.grad_scale = grad_scale;
      if (!master[g].empty()) optim::step(*state[g], h, master[g].data(), DType::f32, nullptr, grad.data(), DType::f32, 1);
    }
    ++steps;
  }
};

void fill_local_grads(ShardedOptimizer& opt, int step, int micro) {
  const int r = opt.rank();
  for (size_t p = 0; p < opt.layout().params.size(); ++p) {
    float* g = opt.param_grad(int(p));
    for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) g[i] += grad_value(r, step, micro, int(p), i);
  }
}

// Runs `steps` steps of gradient accumulation `gas`, reporting parameters ready in reverse order
// (as backward produces them).
void train(ShardedOptimizer& opt, int steps, int gas = 1, int first = 0) {
  for (int s = first; s < first + steps; ++s) {
    for (int m = 0; m < gas; ++m) {
      fill_local_grads(opt, s, m);
      for (int p = int(opt.layout().params.size()) - 1; p >= 0; --p) opt.grad_ready(p);
      opt.backward_end(m == gas - 1);
    }
    opt.step();
  }
}

std::unique_ptr<ShardedOptimizer> make(const ShardConfig& c) {
  auto opt = std::make_unique<ShardedOptimizer>(test_params(), c, world());
  for (size_t p = 0; p < opt->layout().params.size(); ++p) {
    void* w = opt->param_working(int(p));
    for (int64_t i = 0; i < opt->layout().slots[p].numel; ++i) dtype_store(w, c.working_dtype, i, init_value(int(p), i));
  }
  opt->init(0);
  return opt;
}

// The working copy as float32, whole model.
std::vector<float> params_of(ShardedOptimizer& opt) {
  std::vector<float> out;
  for (size_t p = 0; p < opt.layout().params.size(); ++p) {
    const void* w = opt.param_working(int(p));
    const DType dt = opt.config().working_dtype;
    for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) out.push_back(dtype_load(w, dt, i));
  }
  return out;
}

std::vector<float> params_of(const Reference& ref) {
  std::vector<float> out;
  for (size_t p = 0; p < ref.layout.params.size(); ++p) {
    const auto& s = ref.layout.slots[p];
    for (int64_t i = 0; i < s.numel; ++i) out.push_back(ref.master[int(s.group)][size_t(s.offset + i)]);
  }
  return out;
}

// Replicas are identical: every rank's working copy has the same bytes as rank 0's.
void expect_replicas_identical(ShardedOptimizer& opt) {
  for (int g = 0; g < 2; ++g) {
    const auto& gl = opt.layout().groups[g];
    const int64_t bytes = gl.padded() * dtype_size(opt.config().working_dtype);
    std::vector<uint8_t> mine(static_cast<uint8_t*>(opt.working(Group(g))), static_cast<uint8_t*>(opt.working(Group(g))) + bytes);
    std::vector<uint8_t> root = mine;
    world().broadcast(root.data(), bytes, 0);
    EXPECT_TRUE(mine == root) << "rank " << world().rank() << " group " << g << " working copy differs from rank 0";
  }
}

// This rank's states equal the reference's blocks of the same global range.
void expect_states_equal(ShardedOptimizer& opt, Reference& ref) {
  for (int g = 0; g < 2; ++g) {
    const auto& gl = opt.layout().groups[g];
    const int64_t b = gl.part_begin(opt.rank()), valid = gl.part_valid(opt.rank());
    optim::State* st = opt.state(Group(g));
    for (int which = 1; which <= optim::algo_num_states(opt.config().algo); ++which) {
      if (st->codes(which)) {
        ASSERT_EQ(std::memcmp(st->codes(which), ref.state[g]->codes(which) + b, size_t(valid)), 0)
            << "state " << which << " codes of group " << g << " on rank " << opt.rank();
        ASSERT_EQ(std::memcmp(st->absmax(which), ref.state[g]->absmax(which) + b / opt.config().layout.state_block,
                              size_t(st->layout().num_blocks()) * 4), 0)
            << "state " << which << " scales of group " << g << " on rank " << opt.rank();
      } else if (st->fp32(which)) {
        ASSERT_EQ(std::memcmp(st->fp32(which), ref.state[g]->fp32(which) + b, size_t(valid) * 4), 0)
            << "fp32 state " << which << " of group " << g << " on rank " << opt.rank();
      }
    }
    ASSERT_EQ(std::memcmp(opt.master(Group(g)), ref.master[g].data() + b, size_t(valid) * 4), 0)
        << "master of group " << g << " on rank " << opt.rank();
  }
}

// SGD without momentum or decay: the update is lr times the averaged gradient, linear in it, so a
// reduction's error shows in the parameters as lr times itself.
ShardConfig plain_sgd_config(float lr) {
  ShardConfig c = base_config();
  c.algo = optim::Algo::sgd;
  c.hyper.beta1 = 0.0f;
  c.hyper.weight_decay = 0.0f;
  c.hyper.lr = lr;
  return c;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

TEST(Sharded, EqualsSingleProcessBitExactWithFp32Communication) {
  for (optim::Algo algo : {optim::Algo::adamw, optim::Algo::adam, optim::Algo::sgd, optim::Algo::lion,
                           optim::Algo::rmsprop, optim::Algo::adagrad}) {
    for (int stage : {1, 2}) {
      ShardConfig c = base_config();
      c.algo = algo;
      c.stage = stage;
      if (algo == optim::Algo::sgd) c.hyper.beta1 = 0.9f;
      auto opt = make(c);
      Reference ref(c, world().size());
      const float scale = float(1.0 / double(world().size()));
      for (int s = 0; s < 6; ++s) {
        train(*opt, 1, 1, s);
        ref.step(s, scale);
      }
      EXPECT_EQ(params_of(*opt), params_of(ref)) << optim::algo_name(algo) << " stage " << stage;
      expect_states_equal(*opt, ref);
      expect_replicas_identical(*opt);
      EXPECT_EQ(opt->steps(), 6);
    }
  }
}

TEST(Sharded, Stage1EqualsStage2AndBucketingDoesNotMatter) {
  ShardConfig c = base_config();
  std::vector<std::vector<float>> results;
  for (int stage : {1, 2})
    for (int64_t bucket : {int64_t(128), int64_t(2048), int64_t(1) << 30}) {
      c.stage = stage;
      c.reduce_bucket_size = bucket;
      auto opt = make(c);
      train(*opt, 4);
      results.push_back(params_of(*opt));
    }
  for (size_t i = 1; i < results.size(); ++i) EXPECT_EQ(results[i], results[0]) << "configuration " << i;
}

// Ranks need not report the same parameters, nor in the same order: a branch or an expert unused on one
// rank gets no gradient and is never reported there, and another graph reports in another order. Stage 2
// still reduces the buckets in one order on every rank (the head during backward, the rest at
// backward_end), so the collectives match and the result is stage 1's, which reduces everything at the
// end. (Reducing buckets as each rank completed them mixed buckets across ranks or deadlocked.)
TEST(Sharded, Stage2RanksReportingDifferentParametersMatchStage1) {
  ShardConfig c = base_config();
  c.reduce_bucket_size = 1024;
  std::vector<float> results[2];
  for (int stage : {1, 2}) {
    c.stage = stage;
    auto opt = make(c);
    const int r = opt->rank(), n = int(opt->layout().params.size());
    for (int s = 0; s < 3; ++s) {
      const int unused = (r + 2 * s) % n;  // this rank's unused parameter this step
      for (int p = 0; p < n; ++p) {
        if (p == unused) continue;
        float* g = opt->param_grad(p);
        for (int64_t i = 0; i < opt->layout().slots[p].numel; ++i) g[i] += grad_value(r, s, 0, p, i);
      }
      for (int k = 0; k < n; ++k) {  // odd ranks report in forward order, even ones in reverse
        const int p = r % 2 ? k : n - 1 - k;
        if (p != unused) opt->grad_ready(p);
      }
      opt->backward_end(true);
      opt->step();
    }
    results[stage - 1] = params_of(*opt);
    expect_replicas_identical(*opt);
  }
  EXPECT_EQ(results[1], results[0]) << "rank " << world().rank();
}

TEST(Sharded, GradientAccumulationStage1MatchesStage2) {
  // With accumulation the two stages add the same numbers in a different order (stage 1: micro-
  // batches first, then ranks; stage 2: ranks first), so they agree to fp32 rounding: a relative
  // 1e-5 on parameters after 4 AdamW steps (each update is normalized, an ulp-level gradient
  // difference moves a parameter by about lr * 1e-6). 32-bit states: with 8-bit ones, such an ulp
  // can flip a state code, which is the codec's business, not the reduction order's.
  ShardConfig c = base_config();
  c.bits = 32;
  std::vector<float> a, b;
  for (int stage : {1, 2}) {
    c.stage = stage;
    auto opt = make(c);
    train(*opt, 4, 3);
    (stage == 1 ? a : b) = params_of(*opt);
  }
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5f * std::max(1.0f, std::fabs(a[i]))) << i;
}

TEST(Sharded, Int8GradientsStayWithinTheCodecBound) {
  // Plain SGD is linear in the gradient, so the parameter difference between int8 and fp32
  // reduction is lr * sum over steps of the averaged gradient error. Each of the world-1 remote
  // contributions is off by at most half the largest gap of the dynamic map (its top decade is
  // spaced 0.9/64 = 0.0140625) times its block's absmax (<= 0.5 here, the gradient range); the own
  // contribution is added exactly. So per step and element |error| <= (world-1)/world * 0.5 *
  // 0.0140625 * 0.5.
  ShardConfig c = plain_sgd_config(0.1f);
  const int steps = 5;
  std::vector<float> exact, q;
  for (bool int8 : {false, true}) {
    c.int8_grads = int8;
    auto opt = make(c);
    train(*opt, steps);
    (int8 ? q : exact) = params_of(*opt);
    expect_replicas_identical(*opt);
  }
  const int n = world().size();
  const double bound = c.hyper.lr * steps * double(n - 1) / n * 0.5 * 0.0140625 * 0.5 + 1e-6;
  const double worst = max_abs_diff(q, exact);
  EXPECT_LE(worst, bound);
  if (n > 1) {
    EXPECT_GT(worst, 0.0) << "int8 reduction changed nothing: is it really quantizing?";
  }
}

TEST(Sharded, StochasticInt8GradientsAreUnbiasedAndReproducible) {
  // zero8.stochastic_rounding: the int8 gradient blocks round stochastically. Plain SGD is linear in
  // the gradient, so K steps on the same gradient move a parameter by lr * (the sum of K reduced
  // gradients). With nearest rounding each step repeats the same error; with fresh draws per step the
  // errors average out (their mean shrinks as 1/sqrt(K)), which also shows that no step reuses another's
  // draws. Nearest's mean |error| is about a quarter of a map gap per remote contribution; one stochastic
  // draw's error has a standard deviation of about 0.41 gap, so after K = 64 steps the mean |error| is
  // about 0.04 gap, a sixth of nearest's; 0.35 leaves room for the blocks whose values fall on codes.
  ShardConfig c = plain_sgd_config(0.1f);
  c.bits = 32;
  const int K = 64;
  auto run = [&](bool int8, bool stochastic, uint64_t seed) {
    c.int8_grads = int8;
    c.stochastic_wire = stochastic;
    c.wire_seed = seed;
    auto opt = make(c);
    for (int s = 0; s < K; ++s) {
      fill_local_grads(*opt, 0, 0);  // the same gradient every step
      for (int p = int(opt->layout().params.size()) - 1; p >= 0; --p) opt->grad_ready(p);
      opt->backward_end(true);
      opt->step();
    }
    expect_replicas_identical(*opt);
    return params_of(*opt);
  };
  const std::vector<float> exact = run(false, false, 0), nearest = run(true, false, 0);
  const std::vector<float> sto = run(true, true, 7), again = run(true, true, 7), other = run(true, true, 8);
  EXPECT_TRUE(sto == again) << "the same seed must give the same run";
  if (world().size() == 1) {
    EXPECT_TRUE(sto == exact) << "one rank sends nothing, so nothing is rounded";
    return;
  }
  EXPECT_FALSE(sto == other) << "another seed must give other draws";
  double err_nearest = 0.0, err_sto = 0.0;
  for (size_t i = 0; i < exact.size(); ++i) {
    err_nearest += std::fabs(double(nearest[i]) - exact[i]);
    err_sto += std::fabs(double(sto[i]) - exact[i]);
  }
  EXPECT_GT(err_nearest, 0.0);
  EXPECT_LT(err_sto, 0.35 * err_nearest) << "mean |error| " << err_sto / double(exact.size()) << " against nearest's "
                                         << err_nearest / double(exact.size());
}

TEST(Sharded, Bf16GradientReductionRoundsEachContribution) {
  // bf16_grads (communication_data_type "bf16"): each remote contribution is rounded to bf16 (8
  // significant bits: relative error <= 2^-8), the own one is added exactly. One SGD step of lr 1 then
  // moves each parameter by the averaged gradient within (world - 1) / world * 2^-8 * max |g|.
  ShardConfig c = plain_sgd_config(1.0f);
  c.bits = 32;
  std::vector<float> exact, half;
  for (bool bf16 : {false, true}) {
    c.bf16_grads = bf16;
    auto opt = make(c);
    train(*opt, 1);
    expect_replicas_identical(*opt);
    (bf16 ? half : exact) = params_of(*opt);
  }
  const int n = world().size();
  const double worst = max_abs_diff(half, exact);
  EXPECT_LE(worst, double(n - 1) / n * std::ldexp(1.0, -8) * 0.5 + 1e-6);  // |g| <= 0.5
  if (n > 1) {
    EXPECT_GT(worst, 0.0) << "bf16 reduction changed nothing: is it really rounding?";
  }
}

TEST(Sharded, Int8ParameterSyncKeepsReplicasIdenticalAndMastersExact) {
  ShardConfig c = base_config();
  c.working_dtype = DType::bf16;
  std::vector<float> masters[2];
  std::vector<float> working_q;
  for (bool int8p : {false, true}) {
    c.int8_params = int8p;
    auto opt = make(c);
    train(*opt, 5);
    expect_replicas_identical(*opt);
    for (int g = 0; g < 2; ++g) {
      const int64_t valid = opt->layout().groups[g].part_valid(opt->rank());
      std::vector<float> m(opt->master(Group(g)), opt->master(Group(g)) + valid);
      if (!int8p) {
        masters[g] = m;
      } else {
        // The masters do not depend on how parameters are synchronized.
        EXPECT_EQ(m, masters[g]) << "group " << g;
      }
    }
    if (int8p) {
      // The working copy follows the master within one bf16 rounding plus the delta codec's error
      // (half the largest map gap of the block's largest delta, <= lr-sized steps of 1e-2 * ~3).
      for (int g = 0; g < 2; ++g) {
        const auto& gl = opt->layout().groups[g];
        const int64_t b = gl.part_begin(opt->rank()), valid = gl.part_valid(opt->rank());
        for (int64_t i = 0; i < valid; ++i) {
          const float w = dtype_load(opt->working(Group(g)), DType::bf16, b + i);
          const float m = opt->master(Group(g))[i];
          EXPECT_NEAR(w, m, std::fabs(m) * 0.0079f + 0.05f * 0.0036f + 1e-7f) << "group " << g << " element " << b + i;
        }
      }
    }
  }
}

TEST(Sharded, ClippingEqualsUnshardedClipping) {
  ShardConfig c = base_config();
  c.gradient_clipping = 0.5;
  auto opt = make(c);
  fill_local_grads(*opt, 0, 0);
  opt->backward_end(true);
  const shard::StepInfo info = opt->step();
  // Unsharded: the norm of the averaged gradient over the whole model, in double.
  Reference ref(c, world().size());
  double sq = 0.0;
  for (int g = 0; g < 2; ++g)
    for (float x : ref.summed_grad(g, 0)) sq += double(x) * double(x);
  const double norm = std::sqrt(sq) / world().size();
  EXPECT_NEAR(info.grad_norm, norm, 1e-9 * norm);
  ASSERT_GT(norm, 0.5) << "the test needs a gradient that is clipped";
  EXPECT_NEAR(info.clip_coef, 0.5 / (norm + 1e-6), 1e-9);
  ref.step(0, float(1.0 / world().size() * (0.5 / (norm + 1e-6))));
  const std::vector<float> a = params_of(*opt), b = params_of(ref);
  // The clip coefficient may differ in its last bits (the norm is summed in another order); AdamW's
  // first step is lr * sign-like, nearly insensitive to it.
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6f) << i;
}

TEST(Sharded, TrustRatioOptimizersMatchUnsharded) {
  // LAMB and LARS need per-tensor norms over tensors that the partitions cut; the sharded optimizer
  // adds the ranks' partial sums. Different summation order -> trust ratios equal to ~1e-7 relative,
  // so parameters agree to 1e-6 absolute after 3 steps of lr 1e-2.
  for (optim::Algo algo : {optim::Algo::lamb, optim::Algo::lars}) {
    ShardConfig c = base_config();
    c.algo = algo;
    c.hyper.beta1 = 0.9f;
    auto opt = make(c);
    train(*opt, 3);
    // Unsharded: every rank runs a 1-rank optimizer (its own communicator) on the averaged gradient.
    auto solo_comm = world().split(world().rank(), 0, "solo");
    ShardedOptimizer solo(test_params(), c, *solo_comm);
    for (size_t p = 0; p < solo.layout().params.size(); ++p) {
      float* w = static_cast<float*>(solo.param_working(int(p)));
      for (int64_t i = 0; i < solo.layout().slots[p].numel; ++i) w[i] = init_value(int(p), i);
    }
    solo.init(0);
    for (int s = 0; s < 3; ++s) {
      for (size_t p = 0; p < solo.layout().params.size(); ++p) {
        float* g = solo.param_grad(int(p));
        for (int64_t i = 0; i < solo.layout().slots[p].numel; ++i) {
          float sum = 0.0f;
          for (int r = 0; r < world().size(); ++r) sum = r == 0 ? grad_value(r, s, 0, int(p), i) : sum + grad_value(r, s, 0, int(p), i);
          g[i] = sum / float(world().size());
        }
      }
      solo.backward_end(true);
      solo.step();
    }
    const std::vector<float> a = params_of(*opt), b = params_of(solo);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6f) << optim::algo_name(algo) << " element " << i;
  }
}

TEST(Sharded, OverflowOnOneRankSkipsEverywhere) {
  for (bool int8 : {false, true}) {
    ShardConfig c = base_config();
    c.int8_grads = int8;
    auto opt = make(c);
    train(*opt, 2);
    const std::vector<float> before = params_of(*opt);
    std::vector<float> master_before(opt->master(Group::q8), opt->master(Group::q8) + opt->layout().groups[0].chunk);
    fill_local_grads(*opt, 9, 0);
    if (world().rank() == world().size() - 1) opt->param_grad(2)[17] = std::nanf("");
    opt->backward_end(true);
    const shard::StepInfo info = opt->step();
    EXPECT_TRUE(info.skipped) << "rank " << world().rank();
    EXPECT_EQ(info.step, 2);
    EXPECT_EQ(params_of(*opt), before);
    EXPECT_EQ(std::vector<float>(opt->master(Group::q8), opt->master(Group::q8) + opt->layout().groups[0].chunk), master_before);
    // The next clean step proceeds normally.
    train(*opt, 1);
    EXPECT_EQ(opt->steps(), 3);
    expect_replicas_identical(*opt);
  }
}

TEST(Sharded, StepGroupMakesTheOverflowAndTheNormCommon) {
  // Each rank steps an optimizer of its own (as a pipeline stage over a 1-rank data-parallel group) whose
  // step group is the world: the gradient norm is the world's, and an overflow on one rank skips them all.
  auto solo_comm = world().split(world().rank(), 0, "solo");
  const int r = world().rank(), n = world().size();
  for (bool grouped : {false, true}) {
    ShardConfig c = base_config();
    c.gradient_clipping = 0.5;
    ShardedOptimizer opt(test_params(), c, *solo_comm);
    for (size_t p = 0; p < opt.layout().params.size(); ++p) {
      float* w = static_cast<float*>(opt.param_working(int(p)));
      for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) w[i] = init_value(int(p), i);
    }
    opt.init(0);
    if (grouped) opt.set_step_group(&world());
    double mine = 0.0, all = 0.0;
    for (int q = 0; q < n; ++q)
      for (size_t p = 0; p < opt.layout().params.size(); ++p)
        for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) {
          const double x = grad_value(q, 0, 0, int(p), i);
          all += x * x;
          if (q == r) {
            opt.param_grad(int(p))[i] = float(x);
            mine += x * x;
          }
        }
    opt.backward_end(true);
    const shard::StepInfo info = opt.step();
    const double want = std::sqrt(grouped ? all : mine);
    EXPECT_NEAR(info.grad_norm, want, 1e-12 * want) << "rank " << r << (grouped ? " with" : " without") << " the group";
    EXPECT_FALSE(info.skipped);
    // An overflow on the last rank only.
    for (size_t p = 0; p < opt.layout().params.size(); ++p)
      for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) opt.param_grad(int(p))[i] = 0.25f;
    if (r == n - 1) opt.param_grad(1)[3] = std::numeric_limits<float>::infinity();
    opt.backward_end(true);
    const shard::StepInfo second = opt.step();
    EXPECT_EQ(second.skipped, grouped || r == n - 1) << "rank " << r << (grouped ? " with" : " without") << " the group";
  }
}

TEST(Sharded, Fp16LossScalingSkipsAndRecovers) {
  ShardConfig c = base_config();
  c.working_dtype = DType::f16;
  c.fp16 = true;
  c.loss_scaler.hysteresis = 1;
  auto opt = make(c);
  EXPECT_EQ(opt->loss_scale(), 65536.0);
  // A scaled gradient that overflowed to Inf on one rank: skip, halve.
  fill_local_grads(*opt, 0, 0);
  if (world().rank() == 0) opt->param_grad(0)[0] = INFINITY;
  opt->backward_end(true);
  EXPECT_TRUE(opt->step().skipped);
  EXPECT_EQ(opt->loss_scale(), 32768.0);
  // Clean scaled gradients: the step equals the unscaled fp32 computation to fp16 rounding.
  for (size_t p = 0; p < opt->layout().params.size(); ++p) {
    float* g = opt->param_grad(int(p));
    for (int64_t i = 0; i < opt->layout().slots[p].numel; ++i) g[i] = grad_value(world().rank(), 0, 0, int(p), i) * 32768.0f;
  }
  opt->backward_end(true);
  const shard::StepInfo info = opt->step();
  EXPECT_FALSE(info.skipped);
  EXPECT_EQ(info.loss_scale, 32768.0);
  Reference ref(c, world().size());
  for (int g = 0; g < 2; ++g)
    for (float& m : ref.master[g]) m = f16_to_f32(f32_to_f16(m));  // the masters start from the fp16 model
  ref.step(0, float(1.0 / world().size()));
  const std::vector<float> a = params_of(*opt), b = params_of(ref);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], std::fabs(b[i]) * 1e-3f + 1e-7f) << i;
  expect_replicas_identical(*opt);
}

TEST(Sharded, Stage2HandsBackTheMemoryOfReducedBuckets) {
  ShardConfig c = base_config();
  c.stage = 2;
  c.reduce_bucket_size = 1 << 20;  // 4 MiB of fp32 per bucket: two huge pages
  const int64_t bucket_bytes = int64_t(4) << 20;
  std::vector<ParamSpec> big = {{"a", {1 << 20}}, {"b", {1 << 20}}, {"c", {1 << 20}}, {"d", {1 << 20}}};
  std::vector<float> masters[2];
  for (int release = 0; release <= 1; ++release) {
    c.release_grads = release == 1;
    ShardedOptimizer opt(big, c, world());
    for (size_t p = 0; p < big.size(); ++p) {
      float* w = static_cast<float*>(opt.param_working(int(p)));
      for (int64_t i = 0; i < (1 << 20); ++i) w[i] = init_value(int(p), i);
    }
    opt.init(0);
    for (int s = 0; s < 2; ++s) {
      for (int m = 0; m < 2; ++m) {  // gradient accumulation: stage 2 reduces every micro-batch
        for (size_t p = 0; p < big.size(); ++p) {
          float* g = opt.param_grad(int(p));
          for (int64_t i = 0; i < (1 << 20); ++i) g[i] += grad_value(opt.rank(), s, m, int(p), i);
        }
        const int64_t written = opt.memory().grads;
        EXPECT_GE(written, 4 * bucket_bytes);
        for (int p = int(big.size()) - 1; p >= 0; --p) {
          opt.grad_ready(p);  // completes bucket p: reduced now, and its pages go back when releasing
          const int64_t now = opt.memory().grads;
          if (release) {
            EXPECT_LE(now, written - (int64_t(big.size()) - p) * bucket_bytes)
                << "rank " << opt.rank() << ": bucket " << p << " was reduced but its memory is still resident";
          } else {
            EXPECT_EQ(now, written);
          }
        }
        opt.backward_end(m == 1);
        if (release) {
          EXPECT_EQ(opt.memory().grads, 0);
        }
        // (Reading maps the zero page, which memory() then counts: the next micro-batch writes it anyway.)
        for (size_t p = 0; p < big.size(); ++p) EXPECT_EQ(opt.param_grad(int(p))[12345], 0.0f);
      }
      opt.step();
    }
    const int64_t valid = opt.layout().groups[0].part_valid(opt.rank());
    masters[release].assign(opt.master(Group::q8), opt.master(Group::q8) + valid);
  }
  EXPECT_TRUE(masters[0] == masters[1]) << "rank " << world().rank() << ": releasing pages changed the result";
}

TEST(Sharded, StateMemoryIsTheFractionOfOneRank) {
  ShardConfig c = base_config();
  c.layout.state_block = 256;
  c.layout.wire_block = 2048;
  std::vector<ParamSpec> big = {{"w", {1 << 20}}};
  ShardedOptimizer opt(big, c, world());
  const shard::MemoryStats m = opt.memory();
  const double per_param = double(m.state) / double(1 << 20);
  const int n = world().size();
  // 8-bit AdamW: (2 + 8/256) bytes per parameter over n ranks (whole blocks, so exactly when n | 2^20/2048).
  EXPECT_NEAR(per_param, (2.0 + 8.0 / 256.0) / n, 0.01 / n);
  EXPECT_NEAR(double(m.master) / double(1 << 20), 4.0 / n, 0.01 / n);
}

// A sharded optimizer over some of test_params() (by index) with one set of hyperparameters, stepped with
// the same initial values and gradients as the whole model's.
struct Subset {
  std::vector<int> idx;
  std::unique_ptr<ShardedOptimizer> opt;

  Subset(std::vector<int> idx_, const ShardConfig& c) : idx(std::move(idx_)) {
    std::vector<ParamSpec> all = test_params(), mine;
    for (int p : idx) mine.push_back(all[size_t(p)]);
    opt = std::make_unique<ShardedOptimizer>(mine, c, world());
    for (size_t k = 0; k < idx.size(); ++k) {
      float* w = static_cast<float*>(opt->param_working(int(k)));
      for (int64_t i = 0; i < opt->layout().slots[k].numel; ++i) w[i] = init_value(idx[k], i);
    }
    opt->init(0);
  }
  void step(int s) {
    for (size_t k = 0; k < idx.size(); ++k) {
      float* g = opt->param_grad(int(k));
      for (int64_t i = 0; i < opt->layout().slots[k].numel; ++i) g[i] += grad_value(world().rank(), s, 0, idx[k], i);
    }
    for (int k = int(idx.size()) - 1; k >= 0; --k) opt->grad_ready(k);
    opt->backward_end(true);
    opt->step();
  }
};

TEST(Sharded, ParamGroupsStepWithTheirOwnHyperparameters) {
  // Param groups (hyper groups) with their own lr, weight decay and betas: every parameter must move
  // exactly as it would in an optimizer of its group alone. Each group's run starts on a state block,
  // so its 8-bit blocks are the same as alone, and with fp32 communication the results are bit-exact.
  // Group 1 takes a no-decay group's usual members (norm weights, biases) plus one 8-bit matrix.
  const std::vector<int> group1 = {1, 3, 4};  // ln.w, w2, bias
  const std::vector<int> group0 = {0, 2, 5, 6};
  for (optim::Algo algo : {optim::Algo::adamw, optim::Algo::adam, optim::Algo::sgd, optim::Algo::lion}) {
    for (int stage : {1, 2}) {
      ShardConfig c = base_config();
      c.algo = algo;
      c.stage = stage;
      if (algo == optim::Algo::sgd) c.hyper.beta1 = 0.9f;
      optim::Hyper h1 = c.hyper;
      h1.lr = 3e-3f;
      h1.weight_decay = 0.0f;
      h1.beta1 = algo == optim::Algo::sgd ? 0.5f : 0.8f;
      h1.beta2 = algo == optim::Algo::sgd ? c.hyper.beta2 : 0.99f;
      std::vector<ParamSpec> params = test_params();
      for (int p : group1) params[size_t(p)].hyper_group = 1;
      ShardConfig both = c;
      both.group_hypers = {c.hyper, h1};
      ShardedOptimizer opt(params, both, world());
      for (size_t p = 0; p < params.size(); ++p) {
        float* w = static_cast<float*>(opt.param_working(int(p)));
        for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) w[i] = init_value(int(p), i);
      }
      opt.init(0);
      ShardConfig c1 = c;
      c1.hyper = h1;
      Subset alone0(group0, c), alone1(group1, c1);
      for (int s = 0; s < 5; ++s) {
        train(opt, 1, 1, s);
        alone0.step(s);
        alone1.step(s);
        if (s == 2) {  // a scheduler's change between steps, in one group only
          opt.hyper(1).lr = 1e-3f;
          alone1.opt->hyper().lr = 1e-3f;
        }
      }
      for (const Subset* sub : {&alone0, &alone1})
        for (size_t k = 0; k < sub->idx.size(); ++k) {
          const int p = sub->idx[k];
          const int64_t n = opt.layout().slots[size_t(p)].numel;
          const float* a = static_cast<const float*>(opt.param_working(p));
          const float* b = static_cast<const float*>(sub->opt->param_working(int(k)));
          ASSERT_EQ(std::memcmp(a, b, size_t(n) * 4), 0)
              << optim::algo_name(algo) << " stage " << stage << ": parameter '" << params[size_t(p)].name
              << "' differs from its group stepped alone";
        }
      expect_replicas_identical(opt);
    }
  }
}

TEST(Sharded, ParamGroupHyperparametersAreCheckedNamingTheGroup) {
  std::vector<ParamSpec> params = test_params();
  params[1].hyper_group = 2;
  ShardConfig c = base_config();
  c.group_hypers = {c.hyper, c.hyper};  // one short
  try {
    ShardedOptimizer opt(params, c, world());
    FAIL() << "2 hyper sets accepted for hyper group 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'group_hypers'"), std::string::npos) << e.what();
  }
  c.group_hypers.push_back(c.hyper);
  c.group_hypers[1].beta1 = 1.5f;
  try {
    ShardedOptimizer opt(params, c, world());
    FAIL() << "beta1 1.5 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hyper group 1: invalid argument 'beta1'"), std::string::npos) << e.what();
  }
  // A bad value set between steps (a scheduler's) fails the next step on every rank, before it moves anything.
  c.group_hypers[1].beta1 = 0.9f;
  ShardedOptimizer opt(params, c, world());
  opt.init(0);
  opt.hyper(2).lr = -1.0f;
  opt.backward_end(true);
  try {
    opt.step();
    FAIL() << "lr -1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hyper group 2: invalid argument 'lr'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.steps(), 0);
  EXPECT_THROW(opt.hyper(3), Error);
}

TEST(Sharded, StepBeforeInitIsRefused) {
  // Before init() the masters are zeros: a step would replace the model's weights by the update from zero.
  ShardedOptimizer opt(test_params(), base_config(), world());
  fill_local_grads(opt, 0, 0);
  opt.backward_end(true);
  try {
    opt.step();
    FAIL() << "step before init accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ShardedOptimizer::step called before init()"), std::string::npos)
        << e.what();
  }
  opt.init(0);
  EXPECT_EQ(opt.step().step, 1);
}

TEST(Sharded, StepInsideAnAccumulationIsRefused) {
  // A step before the boundary's backward_end(true) stepped on part of the gradient: stage 1 on none of it
  // (after backward_end(false): a zero-gradient step, counted, shifting the bias correction), stage 2 on the
  // buckets reduced so far; the rest went into the next step.
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    ShardConfig c = base_config();
    c.stage = stage;
    ShardedOptimizer opt(test_params(), c, world());
    opt.init(0);
    auto refused = [&](const std::string& what) {
      try {
        opt.step();
        ADD_FAILURE() << "step accepted (" << what << ")";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("step called in the middle of an accumulation"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
      EXPECT_EQ(opt.steps(), 0);
    };
    fill_local_grads(opt, 0, 0);
    opt.backward_end(false);
    refused("1 micro-batch(es) ended with backward_end(false)");
    fill_local_grads(opt, 0, 1);
    opt.grad_ready(int(opt.layout().params.size()) - 1);
    refused("gradients were reported by grad_ready() without backward_end()");
    for (int p = int(opt.layout().params.size()) - 2; p >= 0; --p) opt.grad_ready(p);
    opt.backward_end(true);
    EXPECT_EQ(opt.step().step, 1);
  }
}

// A boundary learnt only after the last micro-batch's backward_end(false) (DeepSpeed's unmanaged accumulation):
// end_accumulation gives the bits of backward_end(true) there, at stage 1 by reducing then and at stage 2
// without a byte on the wire (each micro-batch was reduced already). With nothing pending it does nothing;
// after grad_ready without backward_end it is refused as step() is.
TEST(Sharded, EndAccumulationEqualsABoundaryBackwardEnd) {
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    ShardConfig c = base_config();
    c.stage = stage;
    auto counted = make(c), late = make(c);
    train(*counted, 3, 2);
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) {
        fill_local_grads(*late, s, m);
        for (int p = int(late->layout().params.size()) - 1; p >= 0; --p) late->grad_ready(p);
        late->backward_end(false);
      }
      const uint64_t before = world().stats().bytes();
      late->end_accumulation();
      const uint64_t sent = world().stats().bytes() - before;
      if (stage == 2 || world().size() == 1) {
        EXPECT_EQ(sent, 0u);
      } else {
        EXPECT_GT(sent, 0u);
      }
      late->end_accumulation();  // nothing pending
      EXPECT_EQ(world().stats().bytes() - before, sent);
      late->step();
    }
    EXPECT_EQ(params_of(*late), params_of(*counted)) << "rank " << world().rank();
    fill_local_grads(*late, 3, 0);
    late->grad_ready(0);
    EXPECT_THROW(late->end_accumulation(), Error);
  }
}

// Runs the constructor and returns its error message ("" if it accepted the arguments).
std::string construction_error(const std::vector<ParamSpec>& params, const ShardConfig& c) {
  try {
    ShardedOptimizer opt(params, c, world());
    return "";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
}

TEST(Sharded, RanksPassingDifferentParametersOrConfigsAllFailNamingIt) {
  // Without the check, a shape that differs by one row "worked" with garbage (the buckets' owner
  // ranges disagree), and other differences hung in mismatched collectives until the timeout.
  const int n = world().size(), r = world().rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<ParamSpec> p = test_params();
  if (r == n - 1) p[3].shape = {3, 3000};
  std::string e = construction_error(p, base_config());
  EXPECT_NE(e.find("the ranks passed different parameters"), std::string::npos) << e;
  EXPECT_NE(e.find("parameter 3 is 'w2' shape [3, 3001] on rank 0, rank " + std::to_string(n - 1) +
                   " 'w2' shape [3, 3000]"), std::string::npos) << e;
  // One rank has a parameter more: the first parameter only some ranks have is named.
  p = test_params();
  if (r == 0) p.push_back({"extra", {10}});
  e = construction_error(p, base_config());
  EXPECT_NE(e.find("parameter 7 is 'extra' shape [10] on rank 0, rank 1 no such parameter (7 parameters)"),
            std::string::npos) << e;
  EXPECT_NE(e.find("parameter counts: rank 1 7"), std::string::npos) << e;
  ShardConfig c = base_config();
  if (r == 1) c.stage = 1;
  e = construction_error(test_params(), c);
  EXPECT_NE(e.find("the ranks passed different configs: 'stage' is 2 on rank 0, rank 1 1"), std::string::npos) << e;
  // Still in step: the same arguments everywhere construct.
  EXPECT_EQ(construction_error(test_params(), base_config()), "");
}

TEST(Sharded, BadConfigurationNamesTheProblem) {
  ShardConfig c = base_config();
  c.stage = 3;
  try {
    ShardedOptimizer opt(test_params(), c, world());
    FAIL() << "stage 3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'stage'"), std::string::npos) << e.what();
  }
  c = base_config();
  c.hyper.lr = std::nanf("");
  EXPECT_THROW(ShardedOptimizer(test_params(), c, world()), Error);
  // Negative threads used to pass the constructor and fail at the first step, inside its collectives.
  c = base_config();
  c.threads = -3;
  EXPECT_NE(construction_error(test_params(), c).find("invalid argument 'threads': must be >= 0"), std::string::npos)
      << construction_error(test_params(), c);
}

// ---- bucket input (grad_add) and overlap ----

// Rank r's gradients of (step, micro) handed over with grad_add, each parameter reported right after, in
// reverse order (as an engine's hooks do during backward); dtype: what the caller's gradients are in.
void backward_with_grad_add(ShardedOptimizer& opt, int step, int micro, DType dtype = DType::f32) {
  const int r = opt.rank();
  for (int p = int(opt.layout().params.size()) - 1; p >= 0; --p) {
    const int64_t n = opt.layout().slots[size_t(p)].numel;
    std::vector<uint16_t> half(static_cast<size_t>(n));
    std::vector<float> g(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      g[size_t(i)] = grad_value(r, step, micro, p, i);
      const float v = g[size_t(i)];
      if (dtype != DType::f32) half[size_t(i)] = dtype == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
    }
    opt.grad_add(p, dtype == DType::f32 ? static_cast<const void*>(g.data()) : half.data(), dtype);
    opt.grad_ready(p);
  }
}

void train_with_grad_add(ShardedOptimizer& opt, int steps, int gas = 1, DType dtype = DType::f32) {
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < gas; ++m) {
      backward_with_grad_add(opt, s, m, dtype);
      opt.backward_end(m == gas - 1);
    }
    opt.step();
  }
}

// The masters, states and residuals of this rank, as bytes (compared between runs that must agree bit
// for bit).
std::vector<uint8_t> shard_bytes(ShardedOptimizer& opt) {
  using Part = ShardedOptimizer::Part;
  std::vector<uint8_t> out;
  for (int g = 0; g < 2; ++g)
    for (Part part : {Part::master, Part::codes1, Part::absmax1, Part::codes2, Part::absmax2, Part::state1,
                      Part::state2, Part::residual}) {
      std::vector<uint8_t> b(static_cast<size_t>(opt.part_bytes(Group(g), part)));
      opt.copy_to_host(Group(g), part, b.data());
      out.insert(out.end(), b.begin(), b.end());
    }
  return out;
}

// The working copy of both groups, as bytes.
std::vector<uint8_t> working_bytes(ShardedOptimizer& opt) {
  std::vector<uint8_t> out;
  for (int g = 0; g < 2; ++g) {
    const uint8_t* w = static_cast<const uint8_t*>(opt.working(Group(g)));
    out.insert(out.end(), w, w + opt.layout().groups[g].padded() * dtype_size(opt.config().working_dtype));
  }
  return out;
}

TEST(Sharded, OneRankSendsNothingSoQuantizesNothing) {
  // One rank has no wire (sharded.h, WirePlan): int8 gradients and int8 parameter sync, with error
  // feedback and stochastic rounding, give the bits of fp32 communication (working copy, masters,
  // states) and hold no int8 scratch and no residual. Over several ranks the int8 options hold: other
  // bits, more scratch, and under half the bytes of fp32 communication (about a quarter).
  const int n = world().size();
  for (DType wt : {DType::f32, DType::bf16, DType::f16})
    for (int stage : {1, 2}) {
      ShardConfig exact = base_config();
      exact.working_dtype = wt;
      exact.stage = stage;
      ShardConfig q = exact;
      q.int8_grads = true;
      q.int8_params = true;
      q.error_feedback = true;
      q.stochastic_wire = true;
      q.wire_seed = 3;
      SCOPED_TRACE(std::string(dtype_name(wt)) + " model, stage " + std::to_string(stage) + ", " +
                   std::to_string(n) + " rank(s)");
      auto a = make(exact);
      auto b = make(q);
      uint64_t sent[2];
      for (int k = 0; k < 2; ++k) {
        const uint64_t before = world().stats().bytes();
        train(k == 0 ? *a : *b, 3, 2);
        sent[k] = world().stats().bytes() - before;
      }
      EXPECT_EQ(a->wire().grads, comm::WireFormat::f32);
      EXPECT_FALSE(a->wire().int8_params);
      EXPECT_EQ(b->wire().grads, n == 1 ? comm::WireFormat::f32 : comm::WireFormat::int8);
      EXPECT_EQ(b->wire().int8_params, n > 1);
      EXPECT_EQ(b->wire().error_feedback, n > 1);
      expect_replicas_identical(*b);
      if (n == 1) {
        EXPECT_TRUE(working_bytes(*b) == working_bytes(*a)) << "the working copy went through int8 at one rank";
        EXPECT_TRUE(shard_bytes(*b) == shard_bytes(*a)) << "the masters or states differ from fp32 communication's";
        EXPECT_EQ(b->part_bytes(Group::q8, ShardedOptimizer::Part::residual), 0);
        EXPECT_EQ(b->memory().buffers, a->memory().buffers) << "int8 scratch or a residual held at one rank";
        EXPECT_EQ(sent[0], 0u);
        EXPECT_EQ(sent[1], 0u);
      } else {
        EXPECT_FALSE(shard_bytes(*b) == shard_bytes(*a)) << "the int8 gradients changed nothing";
        EXPECT_GT(b->part_bytes(Group::q8, ShardedOptimizer::Part::residual), 0);
        EXPECT_GT(b->memory().buffers, a->memory().buffers) << "no int8 sync scratch";
        EXPECT_LT(2 * sent[1], sent[0]) << "int8 " << sent[1] << " bytes, fp32 " << sent[0];
      }
    }
}

TEST(Sharded, GradAddAndOverlapGiveTheBitsOfTheFullBuffer) {
  // The full gradient buffer written in place, reduced in the caller's thread, the parameters gathered
  // whole (the path the other tests take), against: grad_add into the reduction buckets, the reductions
  // and the gathers on the optimizer's thread (overlap), and the all-gather cut into pieces. The same
  // collectives in the same order over the same bytes: the same bits, in every configuration.
  struct Case {
    const char* name;
    std::function<void(ShardConfig&)> set;
    int gas;
  };
  const std::vector<Case> cases = {
      {"fp32 wire", [](ShardConfig&) {}, 1},
      {"int8 wire, error feedback, buckets of 128",
       [](ShardConfig& c) {
         c.int8_grads = true;
         c.error_feedback = true;
         c.reduce_bucket_size = 128;
       },
       1},
      {"bf16 model, int8 gradients and parameters",
       [](ShardConfig& c) {
         c.working_dtype = DType::bf16;
         c.int8_grads = true;
         c.int8_params = true;
       },
       1},
      {"stage 1, accumulation 3", [](ShardConfig& c) { c.stage = 1; }, 3},
      {"stage 2, accumulation 3, int8", [](ShardConfig& c) { c.int8_grads = true; }, 3},
      {"LAMB",
       [](ShardConfig& c) {
         c.algo = optim::Algo::lamb;
         c.hyper.beta1 = 0.9f;
       },
       1},
      {"release_grads", [](ShardConfig& c) { c.release_grads = true; }, 2},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    ShardConfig c = base_config();
    k.set(c);
    auto ref = make(c);
    train(*ref, 3, k.gas);
    const std::vector<float> want = params_of(*ref);
    const std::vector<uint8_t> want_shard = shard_bytes(*ref);
    for (int variant = 0; variant < 3; ++variant) {
      ShardConfig v = c;
      v.overlap = variant != 0;
      v.allgather_bucket_size = 1024;  // several pieces per partition
      auto opt = make(v);
      if (variant == 2)
        train(*opt, 3, k.gas);  // the full buffer, with overlap
      else
        train_with_grad_add(*opt, 3, k.gas);
      const char* what = variant == 0   ? "grad_add"
                         : variant == 1 ? "grad_add with overlap"
                                        : "full buffer with overlap";
      EXPECT_EQ(params_of(*opt), want) << what << ", rank " << opt->rank();
      EXPECT_TRUE(shard_bytes(*opt) == want_shard) << what << ": masters or states differ on rank " << opt->rank();
      expect_replicas_identical(*opt);
      const shard::OverlapStats o = opt->overlap_stats();
      EXPECT_EQ(o.threaded, v.overlap && world().size() > 1) << what;
      EXPECT_GT(o.reductions, 0) << what;
      EXPECT_GT(o.gathers, 0) << what;
    }
  }
}

TEST(Sharded, DeferredGatherGivesTheBitsOfTheWaitingStep) {
  // step(true) returns with the all-gather still running on the optimizer's thread; each parameter is
  // read only after wait_param (as the engine's forward hooks do), in forward order. After wait_param(p)
  // parameter p holds the step's update, and the run ends with the bits of step(false).
  struct Case {
    const char* name;
    std::function<void(ShardConfig&)> set;
  };
  const std::vector<Case> cases = {
      {"fp32 wire", [](ShardConfig&) {}},
      {"int8 gradients and parameters",
       [](ShardConfig& c) {
         c.int8_grads = true;
         c.int8_params = true;
       }},
      {"bf16 model, int8 parameters",
       [](ShardConfig& c) {
         c.working_dtype = DType::bf16;
         c.int8_params = true;
       }},
  };
  const int steps = 4;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    ShardConfig c = base_config();
    k.set(c);
    c.overlap = true;
    c.allgather_bucket_size = 256 * world().size();  // many pieces per partition
    auto ref = make(c);
    std::vector<std::vector<float>> want;  // the working copy after each step, per parameter
    for (int s = 0; s < steps; ++s) {
      backward_with_grad_add(*ref, s, 0);
      ref->backward_end(true);
      ref->step(false);
      EXPECT_FALSE(ref->gather_pending());
      want.push_back(params_of(*ref));
    }
    auto opt = make(c);
    const int nparams = int(opt->layout().params.size());
    for (int s = 0; s < steps; ++s) {
      if (s > 0) {
        int64_t at = 0;
        for (int p = 0; p < nparams; ++p) {
          opt->wait_param(p);
          const int64_t n = opt->layout().slots[size_t(p)].numel;
          const void* w = opt->param_working(p);
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(dtype_load(w, c.working_dtype, i), want[size_t(s - 1)][size_t(at + i)])
                << "parameter " << p << " element " << i << " read after wait_param, step " << s << ", rank "
                << opt->rank();
          at += n;
        }
      }
      backward_with_grad_add(*opt, s, 0);
      opt->backward_end(true);
      opt->step(true);
      EXPECT_EQ(opt->gather_pending(), world().size() > 1) << "the gather is deferred only with the thread";
    }
    opt->wait_gather();
    EXPECT_FALSE(opt->gather_pending());
    EXPECT_EQ(params_of(*opt), want.back()) << "rank " << opt->rank();
    EXPECT_TRUE(shard_bytes(*opt) == shard_bytes(*ref)) << "masters or states differ on rank " << opt->rank();
    expect_replicas_identical(*opt);
    EXPECT_THROW(opt->wait_param(nparams), Error);
  }
}

TEST(Sharded, GradAddTakes16BitGradients) {
  // bf16 and fp16 gradients are widened and added in fp32, as autograd's 16-bit gradient added into an
  // fp32 buffer: the same bits as writing the widened values in place.
  for (DType dt : {DType::bf16, DType::f16}) {
    ShardConfig c = base_config();
    auto in_place = make(c), added = make(c);
    const int r = in_place->rank();
    for (size_t p = 0; p < in_place->layout().params.size(); ++p) {
      float* g = in_place->param_grad(int(p));
      for (int64_t i = 0; i < in_place->layout().slots[p].numel; ++i) {
        const float v = grad_value(r, 0, 0, int(p), i);
        g[i] += dt == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
      }
    }
    in_place->backward_end(true);
    in_place->step();
    backward_with_grad_add(*added, 0, 0, dt);
    added->backward_end(true);
    added->step();
    EXPECT_EQ(params_of(*added), params_of(*in_place)) << dtype_name(dt);
  }
}

TEST(Sharded, Stage2HoldsItsPartitionAndTheBucketsInFlight) {
  // Six parameters of one bucket each. Reported last first (the reduction order), each bucket is reduced
  // as soon as its parameter is reported, so one bucket buffer serves them all; reported first to last,
  // every bucket waits for the last one and all six are in flight at once. Either way no buffer of its
  // own for the full gradient: the rank's gradient memory is its reduced partition (in `buffers`) plus
  // the buckets.
  const int64_t n = int64_t(1) << 16, bucket_bytes = 4 * n;
  std::vector<ParamSpec> params;
  for (int p = 0; p < 6; ++p) params.push_back({"w" + std::to_string(p), {n}});
  ShardConfig c = base_config();
  c.reduce_bucket_size = n;
  for (bool release : {false, true})
    for (bool last_first : {true, false}) {
      SCOPED_TRACE(std::string(release ? "release_grads, " : "") + (last_first ? "last first" : "first to last"));
      c.release_grads = release;
      ShardedOptimizer opt(params, c, world());
      opt.init(0);
      const shard::GroupLayout& gl = opt.layout().groups[0];
      EXPECT_EQ(opt.memory().grads, 0);
      std::vector<float> g(static_cast<size_t>(n), 0.25f);
      for (int k = 0; k < 6; ++k) {
        const int p = last_first ? 5 - k : k;
        opt.grad_add(p, g.data(), DType::f32);
        opt.grad_ready(p);
        // Once reduced, a bucket's buffer is free again (kept in the pool, or freed with release_grads).
        const int64_t waiting = last_first || k == 5 ? 0 : k + 1, reduced = last_first ? k + 1 : k == 5 ? 6 : 0;
        const int64_t pooled = release ? 0 : std::min<int64_t>(reduced, last_first ? 1 : 6);
        EXPECT_EQ(opt.memory().grads, (waiting + pooled) * bucket_bytes) << "after parameter " << p;
      }
      opt.backward_end(true);
      const shard::MemoryStats m = opt.memory();
      EXPECT_EQ(m.grads_peak, (last_first ? 1 : 6) * bucket_bytes);
      EXPECT_EQ(m.grads, release ? 0 : m.grads_peak) << "the pool after backward";
      if (last_first) {
        EXPECT_LT(m.grads_peak, 4 * gl.padded()) << "a full-size gradient buffer";
      }
      EXPECT_GE(m.buffers, 4 * gl.chunk) << "the reduced partition";
      EXPECT_FALSE(opt.step().skipped);
      // Every rank's gradient is 0.25: AdamW's first step moves each weight by lr.
      EXPECT_NEAR(static_cast<const float*>(opt.param_working(0))[7], -c.hyper.lr, 2e-4f);
    }
  // Stage 1 keeps the full buffer until the boundary (as DeepSpeed's stage 1 keeps its gradients).
  c.stage = 1;
  ShardedOptimizer one(params, c, world());
  EXPECT_EQ(one.memory().grads_peak, 4 * one.layout().groups[0].padded());
}

TEST(Sharded, GradAddAfterItsBucketWasHandedOverIsRefused) {
  // A part of a gradient that arrives after its bucket went to the reduction would be lost: refused,
  // naming the parameter; the micro-batch still ends normally on every rank.
  ShardConfig c = base_config();
  auto opt = make(c);
  const int last = int(opt->layout().params.size()) - 1;
  std::vector<float> g(static_cast<size_t>(opt->layout().slots[size_t(last)].numel), 0.5f);
  opt->grad_add(last, g.data(), DType::f32);
  opt->grad_ready(last);
  ASSERT_TRUE(opt->param_reduced(last));
  try {
    opt->grad_add(last, g.data(), DType::f32);
    ADD_FAILURE() << "a gradient after the reduction was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'w3' got a gradient after its bucket was handed to the reduction"),
              std::string::npos) << e.what();
  }
  // The full buffer cannot be taken in the middle of a micro-batch that used the buckets.
  EXPECT_THROW(opt->param_grad(0), Error);
  opt->backward_end(true);
  EXPECT_FALSE(opt->step().skipped);
  EXPECT_NO_THROW(opt->param_grad(0));  // between micro-batches it can
}

TEST(Sharded, OverlapReducesWhileTheCallerComputes) {
  // Real processes: once a backward has reported its parameters, the optimizer's thread reduces their
  // buckets without the caller. The caller does not call the optimizer again until every bucket is
  // reduced, then backward_end has almost nothing left to wait for: the reductions' time was hidden.
  if (world().size() < 2) GTEST_SKIP() << "one rank has nothing to overlap (its reductions are local)";
  ShardConfig c = base_config();
  c.int8_grads = true;
  c.overlap = true;
  const int64_t n = int64_t(1) << 20;
  c.reduce_bucket_size = n;
  std::vector<ParamSpec> params;
  for (int p = 0; p < 4; ++p) params.push_back({"w" + std::to_string(p), {n}});
  ShardedOptimizer opt(params, c, world());
  opt.init(0);
  ASSERT_TRUE(opt.overlap_stats().threaded);
  // Four buckets of parameters, and one of padding only where the partitions need it (3 ranks).
  const int64_t buckets = (opt.layout().groups[0].padded() + n - 1) / n;
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[size_t(i)] = grad_value(opt.rank(), 0, 0, 0, i);
  for (int p = 3; p >= 0; --p) {
    opt.grad_add(p, g.data(), DType::f32);
    opt.grad_ready(p);
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (opt.overlap_stats().reductions < buckets) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60)) << "the reductions did not progress";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  opt.backward_end(true);
  const shard::OverlapStats o = opt.overlap_stats();
  EXPECT_EQ(o.reductions, buckets);
  EXPECT_GT(o.reduce_seconds, 0.0);
  EXPECT_LT(o.reduce_wait_seconds, 0.5 * o.reduce_seconds) << "reductions " << o.reduce_seconds << " s, waited "
                                                            << o.reduce_wait_seconds << " s";
  EXPECT_FALSE(opt.step().skipped);
  expect_replicas_identical(opt);
}

TEST(Sharded, OverlapBoundsTheBucketsInFlight) {
  // Sixteen buckets reported last first, each posted at once: backward may run ahead of the reductions by
  // four buckets, then a gradient that needs a new buffer waits for one. So a rank holds at most the
  // bucket being filled, four waiting for their reduction, and one of padding only (3 ranks), whatever
  // the speed of the reductions; the weights are those of reductions in the caller's thread.
  const int64_t n = int64_t(1) << 16;
  std::vector<ParamSpec> params;
  for (int p = 0; p < 16; ++p) params.push_back({"w" + std::to_string(p), {n}});
  ShardConfig c = base_config();
  c.int8_grads = true;
  c.reduce_bucket_size = n;
  std::vector<float> result[2];
  for (bool overlap : {false, true}) {
    c.overlap = overlap;
    ShardedOptimizer opt(params, c, world());
    opt.init(0);
    std::vector<float> g(static_cast<size_t>(n));
    for (int s = 0; s < 2; ++s) {
      for (int p = 15; p >= 0; --p) {
        for (int64_t i = 0; i < n; ++i) g[size_t(i)] = grad_value(opt.rank(), s, 0, p, i);
        opt.grad_add(p, g.data(), DType::f32);
        opt.grad_ready(p);
      }
      opt.backward_end(true);
      opt.step();
    }
    EXPECT_LE(opt.memory().grads_peak, (overlap ? 6 : 1) * 4 * n) << (overlap ? "with" : "without") << " overlap";
    result[int(overlap)] = params_of(opt);
  }
  EXPECT_EQ(result[1], result[0]);
}

}  // namespace
}  // namespace zero8::test
