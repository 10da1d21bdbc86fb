// Device buffers under mpirun -np K on a GPU: the MPI backend stages them through page-locked memory
// (ranks may share one GPU), on a non-default stream, and every collective gives the bits the same call
// gives on host buffers; the bucket collectives (int8 blocks with error feedback and stochastic rounding,
// bf16, fp32) on device buffers equal their host runs bit for bit. Skips, naming why, without CUDA or a
// device. (NCCL: test_comm_nccl.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../cpp/device_test_util.h"
#include "dist_env.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"

namespace zero8::test {
namespace {

using comm::Communicator;
using comm::ReduceOp;
using comm::ScalarType;

using zero8::test::Dev;
using zero8::test::same_bits;

// Restores the world's stream when a test ends, however it ends.
struct StreamOf {
  Communicator& c;
  device::Stream s{"test stream"};
  explicit StreamOf(Communicator& comm) : c(comm) { c.set_stream(s.get()); }
  ~StreamOf() { c.set_stream(nullptr); }
};

std::vector<float> values(int r, int64_t n, uint64_t salt) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = dist_value(salt, r, i);
  return x;
}

TEST(DistCommCuda, MpiStagesDeviceBuffersToTheHostResults) {
  SKIP_WITHOUT_CUDA();
  Communicator& c = world();
  StreamOf stream(c);
  const int n = c.size(), me = c.rank();
  const int64_t chunk = 1001;
  const std::vector<float> x = values(me, chunk * n, 1);
  // all_to_all
  std::vector<float> h(x.size());
  c.all_to_all(x.data(), h.data(), chunk * 4);
  Dev<float> dx(x), dy(std::vector<float>(x.size()));
  c.all_to_all(dx.p(), dy.p(), chunk * 4);
  EXPECT_TRUE(same_bits(dy.get(), h));
  // all_reduce sum (the rank-order fold), in place and not
  std::vector<float> sum = x;
  c.all_reduce(sum.data(), sum.data(), int64_t(sum.size()), ScalarType::f32, ReduceOp::sum);
  Dev<float> dsum(x), dout(std::vector<float>(x.size()));
  c.all_reduce(dsum.p(), dsum.p(), int64_t(x.size()), ScalarType::f32, ReduceOp::sum);
  c.all_reduce(dx.p(), dout.p(), int64_t(x.size()), ScalarType::f32, ReduceOp::sum);
  EXPECT_TRUE(same_bits(dsum.get(), sum));
  EXPECT_TRUE(same_bits(dout.get(), sum));
  // reduce_scatter with unequal counts
  std::vector<int64_t> counts(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) counts[size_t(p)] = chunk - 3 * p;
  std::vector<float> rs(static_cast<size_t>(counts[size_t(me)]));
  c.reduce_scatter(x.data(), rs.data(), counts, ScalarType::f32);
  Dev<float> drs(std::vector<float>(rs.size()));
  c.reduce_scatter(dx.p(), drs.p(), counts, ScalarType::f32);
  EXPECT_TRUE(same_bits(drs.get(), rs));
  // all_gather_v in place, a mixed host send and device receive, broadcast, send/recv
  std::vector<int64_t> rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) rb[size_t(p)] = 4 * counts[size_t(p)], rd[size_t(p)] = 4 * chunk * p;
  std::vector<float> g = x;
  c.all_gather_v(g.data() + chunk * me, rb[size_t(me)], g.data(), rb, rd);
  Dev<float> dg(x);
  c.all_gather_v(dg.p() + chunk * me, rb[size_t(me)], dg.p(), rb, rd);
  EXPECT_TRUE(same_bits(dg.get(), g));
  Dev<float> dg2(std::vector<float>(x.size()));
  std::vector<float> mine(x.begin() + chunk * me, x.begin() + chunk * me + counts[size_t(me)]);
  c.all_gather_v(mine.data(), rb[size_t(me)], dg2.p(), rb, rd);
  std::vector<float> got = dg2.get();
  for (int p = 0; p < n; ++p)
    EXPECT_EQ(std::memcmp(got.data() + chunk * p, g.data() + chunk * p, size_t(rb[size_t(p)])), 0) << p;
  Dev<float> db(x);
  c.broadcast(db.p(), chunk * 4, n - 1);
  const std::vector<float> root = values(n - 1, chunk * n, 1);
  got = db.get();
  EXPECT_EQ(std::memcmp(got.data(), root.data(), size_t(chunk) * 4), 0);
  if (n >= 2 && me < 2) {
    Dev<float> dp(x);
    if (me == 0) c.send(dp.p(), chunk * 4, 1, 3);
    if (me == 1) c.recv(dp.p(), chunk * 4, 0, 3);
    if (me == 1) {
      const std::vector<float> r0 = values(0, chunk * n, 1);
      got = dp.get();
      EXPECT_EQ(std::memcmp(got.data(), r0.data(), size_t(chunk) * 4), 0);
    }
  }
  // The payload counters count what was sent, not the staging copies.
  const comm::CommStats st = c.stats();
  EXPECT_GT(st.op(comm::OpKind::all_to_all).calls, 1u);
}

std::vector<int64_t> block_offsets(int64_t n, int ranks, int64_t block) {
  const int64_t blocks = (n + block - 1) / block;
  std::vector<int64_t> off(size_t(ranks) + 1);
  for (int p = 0; p <= ranks; ++p) off[size_t(p)] = std::min(n, block * (blocks * p / ranks));
  off[size_t(ranks)] = n;
  return off;
}

// The device collectives against the host ones, over communicator `c` (whose stream is set).
void expect_device_buckets_equal_host(Communicator& host_comm, Communicator& dev_comm) {
  const int n = host_comm.size(), me = host_comm.rank();
  const int64_t total = 2048 * 3 + 333;
  const std::vector<int64_t> off = block_offsets(total, n, 256);
  const std::vector<float> x = values(me, total, 7);
  const int64_t mine = off[size_t(me) + 1] - off[size_t(me)];
  for (comm::WireFormat f : {comm::WireFormat::int8, comm::WireFormat::bf16, comm::WireFormat::f32}) {
    SCOPED_TRACE(comm::wire_format_name(f));
    comm::WireOptions opt;
    opt.format = f;
    opt.block = 256;
    opt.stochastic = f == comm::WireFormat::int8;
    opt.seed = 5;
    std::vector<float> out(size_t(std::max<int64_t>(mine, 1))), res(size_t(total), 0.0f);
    comm::WireWorkspace ws;
    Dev<float> dx(x), dout(out), dres(res);
    for (int rep = 0; rep < 2; ++rep) {  // twice: the residual of the first call feeds the second
      comm::bucket_reduce_scatter(host_comm, x.data(), total, off, out.data(), opt, res.data());
      comm::bucket_reduce_scatter(dev_comm, dx.p(), total, off, dout.p(), opt, dres.p(), &ws);
      device::synchronize(dev_comm.stream(), "test");
      ASSERT_TRUE(same_bits(dout.get(), out)) << "call " << rep;
      ASSERT_TRUE(same_bits(dres.get(), res)) << "call " << rep;
    }
    std::vector<float> gathered(static_cast<size_t>(total));
    comm::bucket_all_gather(host_comm, x.data() + off[size_t(me)], total, off, gathered.data(), opt);
    Dev<float> dg(std::vector<float>(static_cast<size_t>(total)));
    comm::bucket_all_gather(dev_comm, dx.p() + off[size_t(me)], total, off, dg.p(), opt, &ws);
    device::synchronize(dev_comm.stream(), "test");
    ASSERT_TRUE(same_bits(dg.get(), gathered));
  }
}

TEST(DistQuantizedCuda, DeviceBucketsThroughMpiEqualHostBucketsBitwise) {
  SKIP_WITHOUT_CUDA();
  StreamOf stream(world());
  expect_device_buckets_equal_host(world(), world());
}

}  // namespace

// For test_comm_nccl.cpp: the same comparison over an NCCL communicator.
void expect_nccl_buckets_equal_host(Communicator& nccl) { expect_device_buckets_equal_host(world(), nccl); }

}  // namespace zero8::test
