// The host side of the device plumbing, which CI runs without a GPU: zero8/kernels/device.h says why CUDA
// cannot run and every entry that needs it fails naming its caller; vec.h's host operations against plain
// loops; the fixed-order sum of squares against its definition, for any thread count; the communicator's
// and the sharded optimizer's device options checked before any CUDA call. tests/cpp/test_vec_cuda.cpp
// runs the device side against these on a GPU.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/vec.h"
#include "zero8/sharded.h"

namespace zero8 {
namespace {

// The error `f` throws: its code and message.
Error error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a zero8::Error";
  return Error(ErrorCode::internal, "");
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

bool have_cuda() { return device::cuda_unavailable().empty(); }

// Values over many decades with both signs, a few exact zeros.
std::vector<float> sample(int64_t n, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float u = rng_uniform(seed, uint64_t(i)) - 0.5f;
    x[size_t(i)] = i % 97 == 5 ? 0.0f : std::ldexp(u, int(rng_u32(seed + 1, uint64_t(i)) % 40) - 20);
  }
  return x;
}

// ---- device.h without a usable device ----

TEST(Device, SaysWhyCudaCannotRunAndNamesTheCaller) {
  if (have_cuda()) GTEST_SKIP() << "a CUDA device is present: tests/cpp/test_vec_cuda.cpp covers it";
  const std::string why = device::cuda_unavailable();
  EXPECT_TRUE(contains(why, "no usable CUDA device") || why == "zero8 was not built with CUDA") << why;
  const Error e = error_of([] { device::require_cuda("my_call"); });
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_TRUE(contains(e.what(), "my_call: " + why)) << e.what();
  for (const auto& [what, f] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"the buffer", [] { device::Buffer b(64, "the buffer"); }},
           {"the stream", [] { device::Stream s("the stream"); }},
           {"the event", [] { device::Event e("the event"); }},
           {"the pinned area", [] { device::PinnedBuffer p; p.reserve(64, "the pinned area"); }},
           {"the copy", [] { float x = 0, y = 0; device::copy(&y, &x, 4, nullptr, "the copy"); }},
           {"table_get_device", [] { quant::table_get_device(quant::MapKind::dynamic_signed); }},
           {"vec::add", [] { float y = 0; vec::add(&y, DType::f32, &y, DType::f32, 1, {MemSpace::device, nullptr}); }},
           {"vec::sum_squares", [] { double o = 0; vec::sum_squares(nullptr, 0, &o, nullptr, {MemSpace::device, nullptr}); }},
       }) {
    const Error err = error_of(f);
    EXPECT_EQ(err.code(), ErrorCode::unsupported) << what << ": " << err.what();
    EXPECT_TRUE(contains(err.what(), what + ": ")) << err.what();
  }
  // Nothing to allocate, nothing to ask: an empty buffer needs no device.
  EXPECT_NO_THROW(device::Buffer(0, "empty"));
}

TEST(Device, HostPointersAreHostMemory) {
  std::vector<float> v(16);
  EXPECT_EQ(device::memory_kind(v.data()), device::MemoryKind::host);
  EXPECT_EQ(device::memory_kind(nullptr), device::MemoryKind::host);
  EXPECT_FALSE(device::on_device(v.data()));
  EXPECT_STREQ(device::memory_kind_name(device::MemoryKind::managed), "managed memory");
  EXPECT_STREQ(mem_space_name(MemSpace::device), "device");
  EXPECT_NO_THROW(device::check_device_ptr(nullptr, "x", "f"));  // null passes: the caller decides
  EXPECT_NO_THROW(device::check_stream(nullptr, "stream", "f"));  // the legacy default stream
  const Error e = error_of([&] { device::check_device_ptr(v.data(), "x", "some_kernel"); });
  if (have_cuda()) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_TRUE(contains(e.what(), "invalid argument 'x': some_kernel needs device or managed memory, got pageable "
                                   "host memory"))
        << e.what();
  } else {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_TRUE(contains(e.what(), "some_kernel: ")) << e.what();
  }
}

// ---- vec.h on the host ----

TEST(VecHost, ElementwiseOperationsAreTheScalarExpressions) {
  const int64_t n = 70001;  // above the OpenMP threshold, odd
  const std::vector<float> a = sample(n, 1), b = sample(n, 2);
  std::vector<uint16_t> h16(static_cast<size_t>(n)), f16(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) h16[size_t(i)] = f32_to_bf16(b[size_t(i)]), f16[size_t(i)] = f32_to_f16(b[size_t(i)]);
  const vec::Where host;

  std::vector<uint16_t> got16(static_cast<size_t>(n));
  vec::convert(got16.data(), DType::bf16, a.data(), DType::f32, n, host);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got16[size_t(i)], f32_to_bf16(a[size_t(i)])) << i;
  std::vector<float> got(static_cast<size_t>(n));
  vec::convert(got.data(), DType::f32, f16.data(), DType::f16, n, host);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], f16_to_f32(f16[size_t(i)])) << i;

  got = a;
  vec::add(got.data(), DType::f32, h16.data(), DType::bf16, n, host);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], a[size_t(i)] + bf16_to_f32(h16[size_t(i)])) << i;
  std::vector<uint16_t> w = h16;
  vec::add(w.data(), DType::bf16, a.data(), DType::f32, n, host);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(w[size_t(i)], f32_to_bf16(bf16_to_f32(h16[size_t(i)]) + a[size_t(i)])) << i;

  vec::sum(got.data(), a.data(), b.data(), n, host);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], a[size_t(i)] + b[size_t(i)]) << i;
  vec::diff(got.data(), a.data(), f16.data(), DType::f16, n, host);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], a[size_t(i)] - f16_to_f32(f16[size_t(i)])) << i;

  std::vector<float> z = a;
  vec::zero(z.data(), 4 * 10, host);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(f32_bits(z[size_t(i)]), 0u);
  EXPECT_EQ(z[10], a[10]);
}

TEST(VecHost, ResidualUpdateKeepsWhatANonFiniteEncodingLost) {
  const int64_t n = 1000;
  const int32_t block = 128;
  std::vector<float> v = sample(n, 3), d = sample(n, 4), e(size_t(n), 7.0f);
  std::vector<float> scales((n + block - 1) / block, 1.0f);
  scales[2] = std::numeric_limits<float>::quiet_NaN();
  vec::residual_update(e.data(), v.data(), d.data(), n, scales.data(), block, {});
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(e[size_t(i)], i / block == 2 ? 7.0f : v[size_t(i)] - d[size_t(i)]) << i;
  // Element-wise (bf16 wire): only the non-finite elements keep theirs.
  v[5] = std::numeric_limits<float>::infinity();
  v[6] = std::numeric_limits<float>::quiet_NaN();
  std::fill(e.begin(), e.end(), 7.0f);
  vec::residual_update(e.data(), v.data(), d.data(), n, nullptr, 0, {});
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(e[size_t(i)], i == 5 || i == 6 ? 7.0f : v[size_t(i)] - d[size_t(i)]) << i;
}

// vec.h's definition of the order, written out again: blocks of 1024, lanes strided by 256, the pairwise
// fold; then the same over the block sums until one is left.
double fixed_order_sum(const std::vector<double>& terms) {
  if (terms.empty()) return 0.0;
  std::vector<double> level = terms;
  while (true) {
    std::vector<double> next;
    for (size_t lo = 0; lo < level.size(); lo += 1024) {
      double lane[256];
      for (size_t t = 0; t < 256; ++t) {
        lane[t] = 0.0;
        for (size_t k = 0; k < 4; ++k)
          if (lo + t + 256 * k < level.size()) lane[t] = lane[t] + level[lo + t + 256 * k];
      }
      for (size_t s = 128; s > 0; s /= 2)
        for (size_t t = 0; t < s; ++t) lane[t] = lane[t] + lane[t + s];
      next.push_back(lane[0]);
    }
    if (next.size() == 1) return next[0];
    level = next;
  }
}

double sum_squares_host(const std::vector<float>& x) {
  const int64_t n = int64_t(x.size());
  std::vector<double> work(size_t(vec::sum_squares_work(n)) + 1), out(1, -1.0);
  vec::sum_squares(x.data(), n, out.data(), work.data(), {});
  return out[0];
}

TEST(VecHost, SumOfSquaresFollowsItsFixedOrderForAnyThreadCount) {
  for (int64_t n : {0, 1, 255, 1024, 1025, 70000, 1048576 + 3000}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = sample(n, 11);
    std::vector<double> sq(static_cast<size_t>(n));
    long double exact = 0.0L;
    for (int64_t i = 0; i < n; ++i) {
      sq[size_t(i)] = double(x[size_t(i)]) * double(x[size_t(i)]);
      exact += (long double)sq[size_t(i)];
    }
    const double want = fixed_order_sum(sq);
    const double got = sum_squares_host(x);
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(double)), 0) << got << " vs " << want;
    // Pairwise sums of non-negative terms: a few ulps of double from the exact sum.
    EXPECT_NEAR(double(got), double(exact), 1e-13 * double(exact));
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    const double one = sum_squares_host(x);
    omp_set_num_threads(saved);
    EXPECT_EQ(std::memcmp(&one, &want, sizeof(double)), 0);
  }
  EXPECT_EQ(vec::sum_squares_work(1024), 0);
  EXPECT_EQ(vec::sum_squares_work(1025), 2);
  EXPECT_EQ(vec::sum_squares_work(1024 * 1024 + 1), 1025 + 2);
}

TEST(VecHost, SumOfSquaresIsFiniteExactlyWhenEveryElementIs) {
  std::vector<float> x(5000, std::numeric_limits<float>::max());  // the largest squares stay finite in double
  EXPECT_TRUE(std::isfinite(sum_squares_host(x)));
  x[4321] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(sum_squares_host(x)));
  x[17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(sum_squares_host(x)));
}

// ---- the communicator's and the optimizer's device options, before any CUDA call ----

TEST(CommDevice, StreamsNeedCudaAndAreInheritedAtSplit) {
  auto c = comm::comm_create("single");
  EXPECT_EQ(c->stream(), nullptr);
  EXPECT_NO_THROW(c->set_stream(nullptr));
  if (!have_cuda()) {
    int fake = 0;
    const Error e = error_of([&] { c->set_stream(&fake); });
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_TRUE(contains(e.what(), "Communicator::set_stream on 'world': " + device::cuda_unavailable())) << e.what();
    EXPECT_EQ(c->stream(), nullptr);
    return;
  }
  device::Stream s("test stream");
  c->set_stream(s.get());
  auto child = c->split(0, 0, "child");
  EXPECT_EQ(child->stream(), s.get());
}

// Host buffers on the host backends keep the direct path: reductions and gathers as before, and the
// host helpers are the plain calls there.
TEST(CommDevice, HostHelpersArePlainCallsOnHostBackends) {
  auto c = comm::comm_create("single");
  double v[2] = {1.5, std::numeric_limits<double>::quiet_NaN()};
  comm::all_reduce_host(*c, v, 2, comm::ScalarType::f64, comm::ReduceOp::max);
  EXPECT_EQ(v[0], 1.5);
  EXPECT_TRUE(std::isnan(v[1]));
  EXPECT_EQ(comm::all_reduce_host_value<int32_t>(*c, 7, comm::ReduceOp::sum), 7);
  const char mine[3] = {'a', 'b', 'c'};
  char all[3] = {};
  comm::all_gather_host(*c, mine, all, 3);
  EXPECT_EQ(std::string(all, 3), "abc");
  EXPECT_EQ(c->stats().op(comm::OpKind::all_reduce).calls, 2u);
}

std::vector<shard::ParamSpec> small_params() { return {{"w", {5000}}, {"b", {70}}}; }

shard::ShardConfig small_config() {
  shard::ShardConfig cfg;
  cfg.layout.state_block = 64;
  cfg.layout.wire_block = 128;
  cfg.layout.min_8bit_size = 1000;
  cfg.error_feedback = true;
  return cfg;
}

TEST(ShardedDevice, DeviceConfigIsCheckedBeforeAnyCudaCall) {
  auto c = comm::comm_create("single");
  shard::ShardConfig cfg = small_config();
  int fake = 0;
  cfg.stream = &fake;
  Error e = error_of([&] { shard::ShardedOptimizer(small_params(), cfg, *c); });
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(contains(e.what(), "invalid argument 'stream': a CUDA stream was given for host memory")) << e.what();

  cfg.stream = nullptr;
  cfg.memory = MemSpace::device;
  cfg.release_grads = true;
  e = error_of([&] { shard::ShardedOptimizer(small_params(), cfg, *c); });
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(contains(e.what(), "invalid argument 'release_grads'")) << e.what();

  cfg.release_grads = false;
  cfg.memory = MemSpace(7);
  e = error_of([&] { shard::ShardedOptimizer(small_params(), cfg, *c); });
  EXPECT_TRUE(contains(e.what(), "invalid argument 'memory': unknown MemSpace 7")) << e.what();

  if (have_cuda()) return;  // test_vec_cuda.cpp builds device optimizers
  cfg.memory = MemSpace::device;
  e = error_of([&] { shard::ShardedOptimizer(small_params(), cfg, *c); });
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_TRUE(contains(e.what(), "ShardedOptimizer (ShardConfig::memory = device): " + device::cuda_unavailable()))
      << e.what();
  e = error_of([&] { optim::State(optim::StateLayout(optim::Algo::adamw, 1000), 0.0f, quant::MapKind::dynamic_signed,
                                  quant::MapKind::dynamic_unsigned, MemSpace::device); });
  EXPECT_EQ(e.code(), ErrorCode::unsupported);
  EXPECT_TRUE(contains(e.what(), "optim::State (adamw, 8-bit, 1000 elements) on the device: ")) << e.what();
}

// The checkpoint accessors of a host optimizer are the buffers the pointers show.
TEST(ShardedDevice, HostCopiesOfEveryPartAreTheBuffers) {
  using Part = shard::ShardedOptimizer::Part;
  auto c = comm::comm_create("single");
  shard::ShardedOptimizer opt(small_params(), small_config(), *c);
  for (size_t p = 0; p < 2; ++p) {
    float* w = static_cast<float*>(opt.param_working(int(p)));
    for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) w[i] = float(i % 13) * 0.25f - 1.0f;
  }
  opt.init();
  for (int s = 0; s < 2; ++s) {
    for (size_t p = 0; p < 2; ++p) {
      float* g = opt.param_grad(int(p));
      for (int64_t i = 0; i < opt.layout().slots[p].numel; ++i) g[i] = float((i * 7 + s) % 11) * 1e-2f - 0.05f;
      opt.grad_ready(int(p));
    }
    opt.backward_end(true);
    opt.step();
  }
  const shard::Group q8 = shard::Group::q8, f32 = shard::Group::fp32;
  optim::State* st = opt.state(q8);
  const int64_t valid = opt.layout().group(q8).part_valid(0);
  EXPECT_EQ(opt.part_bytes(q8, Part::master), 4 * valid);
  EXPECT_EQ(opt.part_bytes(q8, Part::codes1), valid);
  EXPECT_EQ(opt.part_bytes(q8, Part::absmax2), 4 * st->layout().num_blocks());
  EXPECT_EQ(opt.part_bytes(q8, Part::state1), 0);  // 8-bit states have codes
  EXPECT_EQ(opt.part_bytes(f32, Part::codes1), 0);  // and 32-bit ones floats
  EXPECT_EQ(opt.part_bytes(f32, Part::state2), 4 * opt.layout().group(f32).part_valid(0));
  // error_feedback is on, but one rank quantizes no gradients and keeps no residual (sharded.h, WirePlan).
  EXPECT_EQ(opt.part_bytes(q8, Part::residual), 0);
  EXPECT_EQ(opt.part_data(q8, Part::residual), nullptr);
  EXPECT_TRUE(opt.residual(q8).empty());
  EXPECT_STREQ(shard::ShardedOptimizer::part_name(Part::absmax1), "absmax1");

  auto check = [&](shard::Group g, Part p, const void* where) {
    EXPECT_EQ(opt.part_data(g, p), where) << shard::ShardedOptimizer::part_name(p);
    std::vector<uint8_t> got(size_t(opt.part_bytes(g, p)));
    opt.copy_to_host(g, p, got.data());
    EXPECT_EQ(std::memcmp(got.data(), where, got.size()), 0) << shard::ShardedOptimizer::part_name(p);
    // A piece of it (as checkpoints stage a device optimizer's parts): the same bytes at the same offset.
    const int64_t off = int64_t(got.size()) / 3, n = int64_t(got.size()) / 2;
    std::vector<uint8_t> piece(static_cast<size_t>(n));
    opt.copy_to_host(g, p, off, n, piece.data());
    EXPECT_EQ(std::memcmp(piece.data(), got.data() + off, size_t(n)), 0) << shard::ShardedOptimizer::part_name(p);
    for (uint8_t& x : got) x = uint8_t(x ^ 0x5a);
    opt.copy_from_host(g, p, got.data());
    EXPECT_EQ(std::memcmp(got.data(), where, got.size()), 0) << shard::ShardedOptimizer::part_name(p);
  };
  check(q8, Part::working, opt.working(q8));
  check(q8, Part::master, opt.master(q8));
  check(q8, Part::codes1, st->codes(1));
  check(q8, Part::absmax1, st->absmax(1));
  check(q8, Part::codes2, st->codes(2));
  check(q8, Part::absmax2, st->absmax(2));
  check(f32, Part::state1, opt.state(f32)->fp32(1));
  check(f32, Part::state2, opt.state(f32)->fp32(2));
  std::vector<uint8_t> none;
  EXPECT_NO_THROW(opt.copy_to_host(q8, Part::state1, none.data()));  // 0 bytes: nothing to do
  EXPECT_EQ(opt.part_data(q8, Part::state1), nullptr);                // not held
  std::vector<uint8_t> buf(8);
  const int64_t whole = opt.part_bytes(q8, Part::master);
  for (const auto& [off, n] : {std::pair<int64_t, int64_t>{whole - 4, 8}, {-1, 4}, {0, -4}}) {
    try {
      opt.copy_to_host(q8, Part::master, off, n, buf.data());
      ADD_FAILURE() << "a range outside the part: [" << off << ", +" << n << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not within the " + std::to_string(whole) + " bytes of master"),
                std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace zero8
