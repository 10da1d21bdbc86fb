// The sharded optimizer on a CUDA device against the same optimizer on the host, under mpirun -np K:
// fed the same gradients (written on the caller's stream, as backward does), every part of every rank's
// state is the same bits after every step (working copy, masters, codes and scales or fp32 states,
// error-feedback residuals) for AdamW with 8/32-bit states, fp32/bf16 working copies, stage 1 and 2, with
// and without int8 parameter sync and error feedback; LAMB and LARS within a tolerance (its per-tensor norms are
// summed in another order on the device). The device communicator is the MPI world (device buffers
// staged through host memory: ranks may share one GPU) and, where every rank has a GPU of its own, NCCL.
// Skips, naming why, without CUDA or a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dist_env.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/vec.h"
#include "zero8/sharded.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace zero8::test {
namespace {

using shard::Group;
using shard::ParamSpec;
using shard::ShardConfig;
using shard::ShardedOptimizer;
using Part = ShardedOptimizer::Part;

// Why the device tests cannot run on this rank, or "". Every rank computes the same answer for the
// same machine; a mixed answer would fail the collective calls of the test, not hang them.
std::string skip_reason() { return device::cuda_unavailable(); }

#define SKIP_WITHOUT_CUDA()                                               \
  do {                                                                    \
    const std::string why_ = skip_reason();                               \
    if (!why_.empty()) GTEST_SKIP() << why_;                              \
  } while (0)

std::vector<ParamSpec> twin_params() {
  return {{"embed", {37, 129}}, {"ln.w", {100}}, {"w1", {5003}}, {"w2", {3, 3001}}, {"bias", {17}},
          {"stable", {41, 101}, true}, {"w3", {4097}}};
}

ShardConfig twin_config() {
  ShardConfig c;
  c.layout.state_block = 64;
  c.layout.wire_block = 128;
  c.layout.min_8bit_size = 1000;
  c.algo = optim::Algo::adamw;
  c.hyper.lr = 1e-2f;
  c.hyper.weight_decay = 0.01f;
  c.reduce_bucket_size = 2048;
  return c;
}

float init_value(int param, int64_t i) { return (rng_uniform(77, uint64_t(param) * 1000003ull + uint64_t(i)) - 0.5f) * 0.2f; }

float grad_value(int r, int step, int micro, int param, int64_t i) {
  const float u = rng_uniform(uint64_t(1 + step * 16 + micro), uint64_t(r) * 0x9e3779b9ull + uint64_t(param) * 1000003ull + uint64_t(i));
  return (u - 0.5f) * std::ldexp(1.0f, -(param % 4));
}

// A host optimizer and a device optimizer stepping the same gradients.
struct Twins {
  // Declared first, so they outlive the device optimizer (which names the stream).
  device::Stream stream{"the caller's stream"};
  device::Buffer upload;  // one micro-batch's gradient of a group, written into the device's input
  ShardConfig cfg;
  std::unique_ptr<ShardedOptimizer> host, dev;

  // dev_overlap: the device optimizer runs the overlap thread (the host one never does here: the two
  // share the MPI world, which one thread at a time may use). host_comm: the host twin's (the world's).
  // params: twin_params() with their hyper groups (none: all in group 0).
  Twins(const ShardConfig& c, comm::Communicator& dev_comm, bool dev_overlap = false,
        comm::Communicator* host_comm = nullptr, const std::vector<int>& hyper_groups = {})
      : cfg(c) {
    std::vector<ParamSpec> params = twin_params();
    for (size_t p = 0; p < hyper_groups.size(); ++p) params[p].hyper_group = hyper_groups[p];
    host = std::make_unique<ShardedOptimizer>(params, c, host_comm ? *host_comm : world());
    ShardConfig d = c;
    d.overlap = dev_overlap;
    d.memory = MemSpace::device;
    d.stream = stream.get();
    dev = std::make_unique<ShardedOptimizer>(params, d, dev_comm);
    // The same initial weights: written into the host copy, then the whole group copied over.
    for (size_t p = 0; p < twin_params().size(); ++p) {
      void* w = host->param_working(int(p));
      for (int64_t i = 0; i < host->layout().slots[p].numel; ++i) dtype_store(w, c.working_dtype, i, init_value(int(p), i));
    }
    for (int g = 0; g < shard::kNumGroups; ++g) dev->copy_from_host(Group(g), Part::working, host->working(Group(g)));
    host->init(0);
    dev->init(0);
  }

  // One micro-batch: each rank's gradient added to the input (on the caller's stream for the device), the
  // parameters reported in reverse order, backward_end; the host twin's whole micro-batch first, so that a
  // device optimizer's thread has the MPI world to itself while it reduces.
  void micro_batch(int step, int micro, bool last, bool poison = false) {
    const int r = world().rank();
    for (int g = 0; g < shard::kNumGroups; ++g) {
      const shard::GroupLayout& gl = host->layout().group(Group(g));
      std::vector<float> grad(size_t(gl.padded()), 0.0f);
      for (int p : gl.params) {
        const shard::ParamSlot& s = host->layout().slots[size_t(p)];
        for (int64_t i = 0; i < s.numel; ++i) grad[size_t(s.offset + i)] = grad_value(r, step, micro, p, i);
      }
      if (poison && g == 0 && r == world().size() - 1 && !grad.empty()) grad[grad.size() / 3] = INFINITY;
      float* h = host->grad_input(Group(g));
      for (size_t i = 0; i < grad.size(); ++i) h[i] += grad[i];
      if (grad.empty()) continue;
      upload.reserve(int64_t(grad.size() * 4), "gradient upload");
      device::copy(upload.data(), grad.data(), int64_t(grad.size() * 4), stream.get(), "gradient upload");
      vec::add(dev->grad_input(Group(g)), DType::f32, upload.data(), DType::f32, int64_t(grad.size()),
               {MemSpace::device, stream.get()});
    }
    for (int p = int(twin_params().size()) - 1; p >= 0; --p) host->grad_ready(p);
    host->backward_end(last);
    for (int p = int(twin_params().size()) - 1; p >= 0; --p) dev->grad_ready(p);
    dev->backward_end(last);
  }

  // Every part of every group, as bytes on the host.
  static std::vector<std::vector<uint8_t>> parts(ShardedOptimizer& o) {
    std::vector<std::vector<uint8_t>> out;
    for (int g = 0; g < shard::kNumGroups; ++g)
      for (Part p : {Part::working, Part::master, Part::codes1, Part::absmax1, Part::codes2, Part::absmax2,
                     Part::state1, Part::state2, Part::residual}) {
        std::vector<uint8_t> b(size_t(o.part_bytes(Group(g), p)));
        o.copy_to_host(Group(g), p, b.data());
        out.push_back(std::move(b));
      }
    return out;
  }

  // The number of parts (group, part) that differ in any bit; names them in `diff`.
  int compare(std::string* diff) {
    const auto a = parts(*host), b = parts(*dev);
    int bad = 0;
    for (size_t k = 0; k < a.size(); ++k)
      if (a[k].size() != b[k].size() || std::memcmp(a[k].data(), b[k].data(), a[k].size()) != 0) {
        ++bad;
        *diff += " group " + std::to_string(k / 9) + " " + ShardedOptimizer::part_name(Part(k % 9));
      }
    return bad;
  }
};

// exact_norm: the device communicator sums the two norm partials in rank order as the host's does (MPI,
// or NCCL's ring at 2 ranks, where a + b = b + a); else within double rounding.
void expect_same_info(const shard::StepInfo& h, const shard::StepInfo& d, bool exact_norm = true) {
  EXPECT_EQ(h.skipped, d.skipped);
  if (exact_norm)
    EXPECT_EQ(std::memcmp(&h.grad_norm, &d.grad_norm, sizeof(double)), 0) << h.grad_norm << " vs " << d.grad_norm;
  else
    EXPECT_NEAR(h.grad_norm, d.grad_norm, 1e-12 * h.grad_norm);
  EXPECT_EQ(h.clip_coef, d.clip_coef);
  EXPECT_EQ(h.step, d.step);
}

void run_twins(const ShardConfig& c, comm::Communicator& dev_comm, int steps, int gas, bool exact_norm = true) {
  Twins t(c, dev_comm);
  std::string diff;
  ASSERT_EQ(t.compare(&diff), 0) << "after init:" << diff;
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < gas; ++m) t.micro_batch(s, m, m == gas - 1);
    expect_same_info(t.host->step(), t.dev->step(), exact_norm);
    ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
  }
}

std::string config_name(const ShardConfig& c) {
  return "bits " + std::to_string(c.bits) + ", " + dtype_name(c.working_dtype) + ", stage " + std::to_string(c.stage) +
         (c.int8_params ? ", int8 params" : "") + (c.error_feedback ? ", error feedback" : "") +
         (c.int8_grads ? "" : c.bf16_grads ? ", bf16 grads" : ", fp32 grads") +
         (c.gradient_clipping > 0 ? ", clipping" : "") + (c.stochastic_wire ? ", stochastic" : "");
}

TEST(ShardedCuda, AdamWDeviceStepsEqualHostStepsBitwise) {
  SKIP_WITHOUT_CUDA();
  for (int bits : {8, 32})
    for (DType wt : {DType::f32, DType::bf16})
      for (int stage : {1, 2})
        for (bool int8_params : {false, true})
          for (bool feedback : {false, true}) {
            ShardConfig c = twin_config();
            c.bits = bits;
            c.working_dtype = wt;
            c.stage = stage;
            c.int8_params = int8_params;
            c.error_feedback = feedback;
            c.gradient_clipping = bits == 8 && stage == 2 ? 0.5 : 0.0;
            SCOPED_TRACE(config_name(c));
            run_twins(c, world(), 3, 2);
            if (HasFatalFailure()) return;
          }
}

// An accumulation whose boundary is learnt after its last backward_end(false) (the engine's unmanaged or
// late-set boundary): end_accumulation on the device (stage 1 reduces there, stage 2 only closes it) gives
// the host twin's bits, and the host's equal the counted accumulation's (test_sharded.cpp).
TEST(ShardedCuda, EndAccumulationOnTheDeviceEqualsTheHost) {
  SKIP_WITHOUT_CUDA();
  for (int stage : {1, 2}) {
    ShardConfig c = twin_config();
    c.stage = stage;
    c.int8_params = stage == 2;
    SCOPED_TRACE(config_name(c));
    Twins t(c, world());
    std::string diff;
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) t.micro_batch(s, m, false);
      t.host->end_accumulation();
      t.dev->end_accumulation();
      expect_same_info(t.host->step(), t.dev->step(), true);
      ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
    }
  }
}

TEST(ShardedCuda, WireFormatsAndStochasticRoundingMatchTheHost) {
  SKIP_WITHOUT_CUDA();
  for (int variant = 0; variant < 3; ++variant) {
    ShardConfig c = twin_config();
    c.int8_grads = variant == 2;
    c.bf16_grads = variant == 1;
    c.stochastic_wire = variant == 2;
    c.int8_params = variant == 2;
    c.error_feedback = variant == 2;
    c.wire_seed = 1234;
    SCOPED_TRACE(config_name(c));
    run_twins(c, world(), 2, 1);
    if (HasFatalFailure()) return;
  }
}

TEST(ShardedCuda, OverflowSkipsOnTheDeviceAsOnTheHost) {
  SKIP_WITHOUT_CUDA();
  ShardConfig c = twin_config();
  c.working_dtype = DType::f16;
  c.fp16 = true;
  c.loss_scaler.initial_scale_power = 4;
  Twins t(c, world());
  std::string diff;
  for (int s = 0; s < 3; ++s) {
    t.micro_batch(s, 0, true, /*poison=*/s == 1);
    const shard::StepInfo h = t.host->step(), d = t.dev->step();
    EXPECT_EQ(h.skipped, s == 1);
    expect_same_info(h, d);
    EXPECT_EQ(h.loss_scale, d.loss_scale);
    ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
  }
  EXPECT_EQ(t.host->loss_scale(), t.dev->loss_scale());
}

// Two hyper groups (no weight decay for the vectors, as engines group them) and all-gather pieces of a few
// hundred elements: each group's partition steps in several runs of several pieces, whose segments and
// trust ratios the device reads from one array per step.
ShardConfig lamb_config(optim::Algo algo) {
  ShardConfig c = twin_config();
  c.algo = algo;
  c.hyper.lr = 1e-3f;
  c.group_hypers = {c.hyper, c.hyper};
  c.group_hypers[1].weight_decay = 0.0f;
  c.allgather_bucket_size = 1024;
  return c;
}
const std::vector<int> kLambHyperGroups = {0, 1, 0, 0, 1, 0, 0};  // twin_params(): ln.w and bias apart

TEST(ShardedCuda, LambAndLarsOnTheDeviceFollowTheHost) {
  SKIP_WITHOUT_CUDA();
  for (optim::Algo algo : {optim::Algo::lamb, optim::Algo::lars}) {
    SCOPED_TRACE(optim::algo_name(algo));
    Twins t(lamb_config(algo), world(), false, nullptr, kLambHyperGroups);
    for (int s = 0; s < 3; ++s) {
      t.micro_batch(s, 0, true);
      const shard::StepInfo h = t.host->step(), d = t.dev->step();
      EXPECT_EQ(std::memcmp(&h.grad_norm, &d.grad_norm, sizeof(double)), 0);
    }
    // The trust ratios may differ in their last bits (the norms' order): the masters stay within a few
    // ulps of a step of lr.
    for (int g = 0; g < shard::kNumGroups; ++g) {
      const int64_t n = t.host->part_bytes(Group(g), Part::master) / 4;
      std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      t.host->copy_to_host(Group(g), Part::master, a.data());
      t.dev->copy_to_host(Group(g), Part::master, b.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(a[size_t(i)], b[size_t(i)], 1e-6f) << "group " << g << " element " << i;
    }
  }
}

// grad_add on a device: each parameter's gradient, written on the caller's stream, goes into the device
// bucket that carries it (buffers cleared on the reduction stream and reused); the host twin takes the
// same gradients in its full buffer. The same bits, stage 1 and 2, over accumulated micro-batches.
TEST(ShardedCuda, GradAddIntoDeviceBucketsEqualsTheHost) {
  SKIP_WITHOUT_CUDA();
  for (int stage : {1, 2}) {
    ShardConfig c = twin_config();
    c.stage = stage;
    c.int8_grads = true;
    c.error_feedback = stage == 2;
    SCOPED_TRACE(config_name(c));
    Twins t(c, world());
    const int r = world().rank(), n = int(twin_params().size());
    int64_t most = 0;
    for (int p = 0; p < n; ++p) most = std::max(most, t.host->layout().slots[size_t(p)].numel);
    t.upload.reserve(most * 4, "gradient upload");  // once: a later reserve could free it under a queued add
    std::string diff;
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) {
        for (int p = n - 1; p >= 0; --p) {
          const int64_t numel = t.host->layout().slots[size_t(p)].numel;
          std::vector<float> grad(static_cast<size_t>(numel));
          for (int64_t i = 0; i < numel; ++i) grad[size_t(i)] = grad_value(r, s, m, p, i);
          float* h = t.host->param_grad(p);
          for (int64_t i = 0; i < numel; ++i) h[i] += grad[size_t(i)];
          device::copy(t.upload.data(), grad.data(), numel * 4, t.stream.get(), "gradient upload");
          t.dev->grad_add(p, t.upload.data(), DType::f32);
          t.host->grad_ready(p);
          t.dev->grad_ready(p);
        }
        t.host->backward_end(m == 1);
        t.dev->backward_end(m == 1);
      }
      expect_same_info(t.host->step(), t.dev->step());
      ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
    }
  }
}

// With overlap the device optimizer reduces each bucket on its thread (the caller's thread, as autograd's,
// only posts it), on the side stream, after the mark recorded when the bucket was posted: the caller keeps
// writing the next gradients on its stream meanwhile, into fresh bucket buffers and into buffers a
// reduction cleared. Stage 2 with grad_add (the engine's way) and with the full input; the same bits as the
// host optimizer reducing in the caller's thread. The host twin finishes each micro-batch first, so the
// device thread has the MPI world to itself.
TEST(ShardedCuda, OverlapThreadReducesDeviceBucketsAsTheCaller) {
  SKIP_WITHOUT_CUDA();
  if (world().size() < 2) GTEST_SKIP() << "one rank reduces nothing, so runs no thread";
  for (bool add : {true, false}) {
    ShardConfig c = twin_config();
    c.stage = 2;
    c.int8_grads = true;
    c.error_feedback = true;
    c.int8_params = true;
    SCOPED_TRACE(std::string(add ? "grad_add, " : "full input, ") + config_name(c));
    Twins t(c, world(), true);
    ASSERT_TRUE(t.dev->overlap_stats().threaded);
    ASSERT_FALSE(t.host->overlap_stats().threaded);
    const int r = world().rank(), n = int(twin_params().size());
    std::vector<device::Buffer> grads;  // one per parameter: the caller's stream reads each after posting it
    for (int p = 0; p < n; ++p) grads.emplace_back(std::max<int64_t>(t.host->layout().slots[size_t(p)].numel, 1) * 4, "gradient");
    std::string diff;
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) {
        std::vector<std::vector<float>> grad(static_cast<size_t>(n));
        for (int p = n - 1; p >= 0; --p) {
          const int64_t numel = t.host->layout().slots[size_t(p)].numel;
          for (int64_t i = 0; i < numel; ++i) grad[size_t(p)].push_back(grad_value(r, s, m, p, i));
          float* h = t.host->param_grad(p);
          for (int64_t i = 0; i < numel; ++i) h[i] += grad[size_t(p)][size_t(i)];
          t.host->grad_ready(p);
        }
        t.host->backward_end(m == 1);
        // As backward: each gradient written on the caller's stream and reported at once, while the
        // thread reduces the buckets posted before.
        for (int p = n - 1; p >= 0; --p) {
          const int64_t numel = int64_t(grad[size_t(p)].size());
          device::copy(grads[size_t(p)].data(), grad[size_t(p)].data(), numel * 4, t.stream.get(), "gradient upload");
          if (add)
            t.dev->grad_add(p, grads[size_t(p)].data(), DType::f32);
          else
            vec::add(t.dev->param_grad(p), DType::f32, grads[size_t(p)].data(), DType::f32, numel,
                     {MemSpace::device, t.stream.get()});
          t.dev->grad_ready(p);
        }
        t.dev->backward_end(m == 1);
      }
      expect_same_info(t.host->step(), t.dev->step());
      ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
    }
    EXPECT_GT(t.dev->overlap_stats().reductions, 0);
  }
}

// The step's all-gather on a device with the optimizer's thread: each piece runs on the side stream after the
// event its piece's step recorded on the caller's stream. Deferred (step(true), as the engine's
// zero8.overlap_param_gather), the step returns with the pieces still queued; wait_param(p) makes the
// caller's stream wait for the pieces holding p, wait_gather() for all of them, and step(false) does so
// before it returns. The weights are read as a caller would, by a copy queued on the caller's stream
// (copy_to_host orders itself), and the simulator runs a stream's work only when something waits for it,
// so any missing wait reads old weights. Over several pieces per group, with the int8 sync and the exact
// gather, in three rounds: parameters settled one by one in forward order (one of them never), the whole
// gather waited for, and a step that does not defer; then every part matches the host twin's bits.
TEST(ShardedCuda, DeviceGatherOnTheSideStreamEqualsTheHost) {
  SKIP_WITHOUT_CUDA();
  if (world().size() < 2) GTEST_SKIP() << "one rank gathers nothing, so runs no thread";
  for (bool int8_params : {true, false}) {
    ShardConfig c = twin_config();
    c.stage = 2;
    c.int8_grads = true;
    c.int8_params = int8_params;
    c.error_feedback = int8_params;
    c.allgather_bucket_size = 4096;  // several pieces per group
    SCOPED_TRACE(config_name(c));
    Twins t(c, world(), true);
    ASSERT_TRUE(t.dev->defers_gather());
    const int n = int(twin_params().size());
    auto expect_working = [&](int p, const char* when) {
      const int64_t bytes = t.host->layout().slots[size_t(p)].numel * dtype_size(c.working_dtype);
      std::vector<uint8_t> got(static_cast<size_t>(bytes));
      device::copy(got.data(), t.dev->param_working(p), bytes, t.stream.get(), "working copy of a parameter");
      device::synchronize(t.stream.get(), "working copy of a parameter");
      EXPECT_EQ(std::memcmp(got.data(), t.host->param_working(p), size_t(bytes)), 0)
          << "parameter " << twin_params()[size_t(p)].name << " " << when;
    };
    std::string diff;
    for (int s = 0; s < 3; ++s) {
      t.micro_batch(s, 0, true);
      const int64_t gathers = t.dev->overlap_stats().gathers;
      const shard::StepInfo h = t.host->step();  // first: its collectives would wait for the device's gather
      expect_same_info(h, t.dev->step(/*defer_gather=*/s < 2));
      ASSERT_EQ(t.dev->gather_pending(), s < 2);
      if (s == 0) {
        for (int p = 0; p < n; ++p)
          if (p != 2) {
            t.dev->wait_param(p);
            expect_working(p, "after wait_param");
          }
      } else {
        if (s == 1) t.dev->wait_gather();
        for (int p = 0; p < n; ++p) expect_working(p, s == 1 ? "after wait_gather" : "after step(false)");
      }
      ASSERT_EQ(t.compare(&diff), 0) << "after step " << s << ":" << diff;
      EXPECT_FALSE(t.dev->gather_pending());
      EXPECT_GT(t.dev->overlap_stats().gathers, gathers + 2);
    }
  }
}

// The device accessors: pointers into device memory, host copies that round-trip, and the host-only
// residual() refused by name.
TEST(ShardedCuda, DeviceBuffersAndTheirHostCopies) {
  SKIP_WITHOUT_CUDA();
  ShardConfig c = twin_config();
  c.error_feedback = true;
  Twins t(c, world());
  EXPECT_EQ(device::memory_kind(t.dev->working(Group::q8)), device::MemoryKind::device);
  EXPECT_EQ(device::memory_kind(t.dev->grad_input(Group::q8)), device::MemoryKind::device);
  EXPECT_EQ(device::memory_kind(t.dev->master(Group::q8)), device::MemoryKind::device);
  EXPECT_EQ(device::memory_kind(t.dev->state(Group::q8)->codes(1)), device::MemoryKind::device);
  try {
    t.dev->residual(Group::q8);
    ADD_FAILURE() << "residual() of a device optimizer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid argument 'residual'"), std::string::npos) << e.what();
  }
  std::vector<float> m(size_t(t.dev->part_bytes(Group::q8, Part::master) / 4));
  for (size_t i = 0; i < m.size(); ++i) m[i] = float(i) * 0.5f;
  t.dev->copy_from_host(Group::q8, Part::master, m.data());
  std::vector<float> back(m.size());
  t.dev->copy_to_host(Group::q8, Part::master, back.data());
  EXPECT_EQ(std::memcmp(m.data(), back.data(), m.size() * 4), 0);
  EXPECT_EQ(t.dev->memory().state, t.host->memory().state);
}

#if ZERO8_WITH_CUDA_SIM
// What the CUDA simulator counts (tests/cudasim): the device optimizer's micro-batches and step queue
// nothing on the legacy default stream (everything goes on the caller's), the micro-batches never wait on
// the host, and a step reads the device from the host once and waits once: the gradient norm and overflow
// verdict. Its communicator is the single-process one, whose
// device collectives are device copies (MPI's stage through host memory, by design).
TEST(ShardedCuda, AStepUsesTheCallersStreamAndOneHostRead) {
  std::unique_ptr<comm::Communicator> single = comm::comm_create("single"), host_single = comm::comm_create("single");
  for (bool overflow : {false, true}) {
    ShardConfig c = twin_config();
    c.gradient_clipping = 0.5;
    c.int8_params = true;
    c.error_feedback = true;
    c.working_dtype = overflow ? DType::f16 : DType::f32;
    c.fp16 = overflow;
    SCOPED_TRACE(config_name(c) + (overflow ? ", fp16 with an overflow" : ""));
    Twins t(c, *single, false, host_single.get());  // the twins' layouts agree: both of one rank
    t.micro_batch(0, 0, true);
    t.host->step();
    t.dev->step();
    const zero8_cudasim_counts before = zero8_cudasim_get_counts();
    t.micro_batch(1, 0, false);
    t.micro_batch(1, 1, true, /*poison=*/overflow);
    const zero8_cudasim_counts mid = zero8_cudasim_get_counts();
    t.host->step();
    const shard::StepInfo info = t.dev->step();
    const zero8_cudasim_counts after = zero8_cudasim_get_counts();
    EXPECT_EQ(info.skipped, overflow && world().rank() == world().size() - 1);
    EXPECT_GT(after.kernels, mid.kernels);
    EXPECT_EQ(after.ops_legacy_stream, before.ops_legacy_stream) << "work queued on the legacy default stream";
    EXPECT_EQ(after.copies_to_host - mid.copies_to_host, 1u) << "host reads of the device in one step";
    EXPECT_EQ(after.host_waits - mid.host_waits, 1u) << "host waits in one step";
    EXPECT_EQ(mid.host_waits - before.host_waits, 0u) << "host waits in the micro-batches";
    EXPECT_EQ(mid.copies_to_host - before.copies_to_host, 0u) << "host reads in the micro-batches";
  }
}

// LAMB and LARS read the device twice per step, whatever the runs and pieces: the gradient norm (which
// the per-tensor norms need for clipping), then every segment's norms in one array; the segments and
// trust ratios go to the device in one copy per array.
TEST(ShardedCuda, LambAndLarsStepsReadTheDeviceTwice) {
  std::unique_ptr<comm::Communicator> single = comm::comm_create("single"), host_single = comm::comm_create("single");
  for (optim::Algo algo : {optim::Algo::lamb, optim::Algo::lars}) {
    ShardConfig c = lamb_config(algo);
    c.gradient_clipping = 0.5;
    SCOPED_TRACE(optim::algo_name(algo));
    Twins t(c, *single, false, host_single.get(), kLambHyperGroups);
    t.micro_batch(0, 0, true);
    t.host->step();
    t.dev->step();
    t.micro_batch(1, 0, true);
    const zero8_cudasim_counts before = zero8_cudasim_get_counts();
    t.dev->step();
    const zero8_cudasim_counts after = zero8_cudasim_get_counts();
    t.host->step();
    EXPECT_EQ(after.ops_legacy_stream, before.ops_legacy_stream) << "work queued on the legacy default stream";
    EXPECT_EQ(after.copies_to_host - before.copies_to_host, 2u) << "host reads of the device in one step";
    EXPECT_EQ(after.host_waits - before.host_waits, 2u) << "host waits in one step";
    EXPECT_EQ(after.copies_to_device - before.copies_to_device, 3u)
        << "copies to the device in one step (the norms' segments, the step's segments and trust ratios)";
  }
}
#endif

#if ZERO8_WITH_NCCL
// NCCL needs a GPU per rank: where each rank has one of its own (as many as ranks, or each its own as
// device 0), the device twins run over NCCL too, bootstrapped over MPI and over a tcp world of the same
// ranks (as under torchrun).
TEST(ShardedCuda, OverNcclEqualsTheHost) {
  SKIP_WITHOUT_CUDA();
  if (ranks_share_a_gpu()) GTEST_SKIP() << "NCCL needs one GPU per rank, and ranks here share one";
  for (const std::string host : {"mpi", "tcp"}) {
    std::unique_ptr<comm::Communicator> nccl =
        host == "mpi" ? comm::comm_create("nccl") : comm::nccl_create_over(comm::tcp_create(world()));
    for (int stage : {1, 2}) {
      ShardConfig c = twin_config();
      c.stage = stage;
      c.int8_params = stage == 2;
      c.error_feedback = stage == 2;
      SCOPED_TRACE("NCCL over " + host + ", " + config_name(c));
      // Clipping off: the step does not use the norm, which NCCL sums in its ring's order.
      run_twins(c, *nccl, 2, 2, world().size() <= 2);
      if (HasFatalFailure()) return;
    }
  }
}
#endif

}  // namespace
}  // namespace zero8::test
