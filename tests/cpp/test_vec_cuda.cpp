// The device side of the plumbing on a GPU, against the host side bit for bit: vec.h's operations and the
// fixed-order sum of squares, pointer kinds and their errors, the single-process communicator and the
// bucket collectives on device buffers with a non-default stream, and device optimizer states. Skips,
// naming why, without CUDA or a device (test_device.cpp covers that case).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "device_test_util.h"
#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/vec.h"
#include "zero8/optim.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace zero8 {
namespace {

#if ZERO8_WITH_CUDA

using test::Dev;
using test::same_bits;

std::vector<float> sample(int64_t n, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float u = rng_uniform(seed, uint64_t(i)) - 0.5f;
    x[size_t(i)] = i % 97 == 5 ? 0.0f : std::ldexp(u, int(rng_u32(seed + 1, uint64_t(i)) % 40) - 20);
  }
  return x;
}

std::vector<uint16_t> as16(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = t == DType::bf16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
  return h;
}

TEST(VecCuda, ElementwiseOperationsEqualTheHostBitwise) {
  SKIP_WITHOUT_CUDA();
  device::Stream stream("test stream");
  const vec::Where host, dev{MemSpace::device, stream.get()};
  const int64_t n = 300001;
  const std::vector<float> a = sample(n, 1), b = sample(n, 2);
  for (DType t : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    const std::vector<uint16_t> b16 = as16(b, t);
    // convert both ways
    std::vector<uint16_t> h16(static_cast<size_t>(n));
    vec::convert(h16.data(), t, a.data(), DType::f32, n, host);
    Dev<float> da(a);
    Dev<uint16_t> d16(static_cast<size_t>(n));
    vec::convert(d16.p(), t, da.p(), DType::f32, n, dev);
    device::synchronize(stream.get(), "test");
    ASSERT_TRUE(same_bits(d16.get(), h16));
    std::vector<float> h32(static_cast<size_t>(n));
    vec::convert(h32.data(), DType::f32, b16.data(), t, n, host);
    Dev<uint16_t> db16(b16);
    Dev<float> d32(static_cast<size_t>(n));
    vec::convert(d32.p(), DType::f32, db16.p(), t, n, dev);
    device::synchronize(stream.get(), "test");
    ASSERT_TRUE(same_bits(d32.get(), h32));
    // add into 16 bits and into 32 bits
    std::vector<uint16_t> y16 = b16;
    vec::add(y16.data(), t, a.data(), DType::f32, n, host);
    Dev<uint16_t> dy16(b16);
    vec::add(dy16.p(), t, da.p(), DType::f32, n, dev);
    std::vector<float> y32 = a;
    vec::add(y32.data(), DType::f32, b16.data(), t, n, host);
    Dev<float> dy32(a);
    vec::add(dy32.p(), DType::f32, db16.p(), t, n, dev);
    // diff against 16 bits
    std::vector<float> z(static_cast<size_t>(n));
    vec::diff(z.data(), a.data(), b16.data(), t, n, host);
    Dev<float> dz(static_cast<size_t>(n));
    vec::diff(dz.p(), da.p(), db16.p(), t, n, dev);
    device::synchronize(stream.get(), "test");
    ASSERT_TRUE(same_bits(dy16.get(), y16));
    ASSERT_TRUE(same_bits(dy32.get(), y32));
    ASSERT_TRUE(same_bits(dz.get(), z));
  }
  std::vector<float> s(static_cast<size_t>(n));
  vec::sum(s.data(), a.data(), b.data(), n, host);
  Dev<float> da(a), db(b), ds(static_cast<size_t>(n));
  vec::sum(ds.p(), da.p(), db.p(), n, dev);
  // residual updates, block-wise (a NaN scale keeps its block) and element-wise (non-finite v keeps)
  std::vector<float> v = a, e(size_t(n), 3.0f);
  v[100] = std::numeric_limits<float>::infinity();
  std::vector<float> scales(size_t((n + 127) / 128), 1.0f);
  scales[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> e1 = e, e2 = e;
  vec::residual_update(e1.data(), v.data(), b.data(), n, scales.data(), 128, host);
  vec::residual_update(e2.data(), v.data(), b.data(), n, nullptr, 0, host);
  Dev<float> dv(v), de1(e), de2(e), dscales(scales);
  vec::residual_update(de1.p(), dv.p(), db.p(), n, dscales.p(), 128, dev);
  vec::residual_update(de2.p(), dv.p(), db.p(), n, nullptr, 0, dev);
  device::synchronize(stream.get(), "test");
  ASSERT_TRUE(same_bits(ds.get(), s));
  ASSERT_TRUE(same_bits(de1.get(), e1));
  ASSERT_TRUE(same_bits(de2.get(), e2));
}

TEST(VecCuda, SumOfSquaresEqualsTheHostBitwise) {
  SKIP_WITHOUT_CUDA();
  device::Stream stream("test stream");
  for (int64_t n : {0, 1, 1000, 1024, 1025, 300000, (1 << 20) + 777, 3 * (1 << 20) + 5}) {
    SCOPED_TRACE(n);
    std::vector<float> x = sample(n, 9);
    if (n > 2000) x[1999] = 3.0e38f;  // a square far above float's range: double keeps it
    const int64_t work = vec::sum_squares_work(n);
    std::vector<double> hw(size_t(work) + 1), hout(1);
    vec::sum_squares(x.data(), n, hout.data(), hw.data(), {});
    Dev<float> dx(x);
    Dev<double> dw(size_t(work) + 1), dout(std::vector<double>{-1.0});
    vec::sum_squares(dx.p(), n, dout.p(), dw.p(), {MemSpace::device, stream.get()});
    device::synchronize(stream.get(), "test");
    ASSERT_TRUE(same_bits(dout.get(), hout)) << dout.get()[0] << " vs " << hout[0];
  }
}

TEST(DeviceCuda, PointerKindsAndTheirErrors) {
  SKIP_WITHOUT_CUDA();
  device::Buffer d(256, "test");
  EXPECT_EQ(device::memory_kind(d.data()), device::MemoryKind::device);
  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 256), cudaSuccess);
  EXPECT_EQ(device::memory_kind(managed), device::MemoryKind::managed);
  device::PinnedBuffer pinned;
  void* ph = pinned.reserve(256, "test");
  EXPECT_EQ(device::memory_kind(ph), device::MemoryKind::pinned);
  std::vector<float> pageable(64);
  EXPECT_EQ(device::memory_kind(pageable.data()), device::MemoryKind::host);
  EXPECT_NO_THROW(device::check_device_ptr(d.data(), "x", "f"));
  EXPECT_NO_THROW(device::check_device_ptr(managed, "x", "f"));
  try {
    device::check_device_ptr(ph, "codes", "some_kernel");
    ADD_FAILURE() << "page-locked host memory passed as device memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("invalid argument 'codes': some_kernel needs device or managed memory, got "
                                         "page-locked host memory"),
              std::string::npos)
        << e.what();
  }
  // A device kernel entry given a host vector names the argument.
  try {
    vec::sum(pageable.data(), pageable.data(), pageable.data(), 64, {MemSpace::device, nullptr});
    ADD_FAILURE() << "host memory passed to a device operation";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid argument 'z': vec::sum"), std::string::npos) << e.what();
  }
  device::Stream s("test");
  EXPECT_NO_THROW(device::check_stream(s.get(), "stream", "f"));
  EXPECT_GE(device::current_device("test"), 0);
  cudaFree(managed);
}

// The single-process backend copies device buffers itself, on the communicator's stream.
TEST(CommCuda, SingleBackendOnDeviceBuffersAndAStream) {
  SKIP_WITHOUT_CUDA();
  auto c = comm::comm_create("single");
  device::Stream stream("test stream");
  c->set_stream(stream.get());
  const std::vector<float> x = sample(1000, 5);
  Dev<float> dx(x), dy(static_cast<size_t>(1000));
  c->all_to_all(dx.p(), dy.p(), 4000);
  EXPECT_TRUE(same_bits(dy.get(), x));
  Dev<float> dz(static_cast<size_t>(1000));
  c->all_reduce(dx.p(), dz.p(), 1000, comm::ScalarType::f32, comm::ReduceOp::max);
  EXPECT_TRUE(same_bits(dz.get(), x));
  Dev<float> dr(static_cast<size_t>(400));
  c->reduce_scatter(dx.p(), dr.p(), {400}, comm::ScalarType::f32);
  EXPECT_TRUE(same_bits(dr.get(), std::vector<float>(x.begin(), x.begin() + 400)));
  Dev<float> dg(static_cast<size_t>(1000));
  c->all_gather_v(dx.p(), 4000, dg.p(), {4000}, {0});
  EXPECT_TRUE(same_bits(dg.get(), x));
  c->broadcast(dg.p(), 4000, 0);
  EXPECT_TRUE(same_bits(dg.get(), x));
}

// Device buckets give the host's bits, in every wire format, with error feedback and stochastic rounding.
TEST(CommCuda, BucketCollectivesOnDeviceEqualTheHostBitwise) {
  SKIP_WITHOUT_CUDA();
  auto c = comm::comm_create("single");
  device::Stream stream("test stream");
  c->set_stream(stream.get());
  const int64_t n = 10000;
  const std::vector<float> x = sample(n, 21);
  for (comm::WireFormat f : {comm::WireFormat::int8, comm::WireFormat::bf16, comm::WireFormat::f32}) {
    for (bool stochastic : {false, true}) {
      SCOPED_TRACE(std::string(comm::wire_format_name(f)) + (stochastic ? " stochastic" : ""));
      comm::WireOptions opt;
      opt.format = f;
      opt.block = 256;
      opt.stochastic = stochastic;
      opt.seed = 99;
      std::vector<float> out(static_cast<size_t>(n)), res(size_t(n), 0.0f);
      comm::bucket_reduce_scatter(*c, x.data(), n, {0, n}, out.data(), opt, res.data());
      Dev<float> dx(x), dout(static_cast<size_t>(n)), dres(std::vector<float>(size_t(n), 0.0f));
      comm::WireWorkspace ws;
      comm::bucket_reduce_scatter(*c, dx.p(), n, {0, n}, dout.p(), opt, dres.p(), &ws);
      device::synchronize(stream.get(), "test");
      ASSERT_TRUE(same_bits(dout.get(), out));
      ASSERT_TRUE(same_bits(dres.get(), res));
      std::vector<float> gathered(static_cast<size_t>(n));
      comm::bucket_all_gather(*c, x.data(), n, {0, n}, gathered.data(), opt);
      Dev<float> dg(static_cast<size_t>(n));
      comm::bucket_all_gather(*c, dx.p(), n, {0, n}, dg.p(), opt, &ws);
      device::synchronize(stream.get(), "test");
      ASSERT_TRUE(same_bits(dg.get(), gathered));
    }
  }
  // A host buffer among device ones is named.
  std::vector<float> host_out(static_cast<size_t>(n));
  Dev<float> dx(x);
  try {
    comm::bucket_reduce_scatter(*c, dx.p(), n, {0, n}, host_out.data(), comm::WireOptions{});
    ADD_FAILURE() << "a host output for a device bucket";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid argument 'out': bucket_reduce_scatter (device buffers) needs "
                                         "device or managed memory"),
              std::string::npos)
        << e.what();
  }
}

TEST(OptimCuda, DeviceStatesHoldTheHostValues) {
  SKIP_WITHOUT_CUDA();
  for (int bits : {8, 32}) {
    const optim::StateLayout lay(optim::Algo::adagrad, 1000, bits, 256);
    optim::State host(lay, 0.25f), dev(lay, 0.25f, quant::MapKind::dynamic_signed, quant::MapKind::dynamic_unsigned,
                                       MemSpace::device);
    EXPECT_EQ(dev.memory(), MemSpace::device);
    EXPECT_TRUE(same_bits(dev.values(1), host.values(1)));
    const optim::State copy = dev;
    EXPECT_TRUE(same_bits(copy.values(1), host.values(1)));
    optim::StepArgs a;
    dev.bind(a);
    EXPECT_EQ(device::memory_kind(bits == 8 ? static_cast<const void*>(a.code1) : a.state1), device::MemoryKind::device);
    if (bits == 8) {
      EXPECT_EQ(a.map1, quant::table_get_device(quant::MapKind::dynamic_signed));
    }
  }
}

#else  // !ZERO8_WITH_CUDA

TEST(VecCuda, ElementwiseOperationsEqualTheHostBitwise) { GTEST_SKIP() << "zero8 was built without CUDA"; }

#endif

}  // namespace
}  // namespace zero8
