// NCCL backend under mpirun: collectives on device buffers checked against the obvious answer, on the
// backend's own stream and on a caller's stream, host pointers refused by name, splits, and the bucket
// collectives equal to their host runs. Every test runs twice: NCCL bootstrapped over MPI
// (comm_create("nccl")) and over a tcp world of the same processes (nccl_create_over, as zero8.initialize
// makes it under torchrun). Needs a CUDA device per rank; without one the tests skip (and the factory's
// error is checked).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist_env.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"

#if ZERO8_WITH_NCCL
#include <cuda_runtime.h>

namespace zero8::test {
namespace {

using comm::Communicator;
using comm::ReduceOp;

// Empty when a device is usable, else why not.
std::string no_device_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) return cudaGetErrorString(rc);
  return n == 0 ? "0 CUDA devices" : "";
}

// NCCL refuses two ranks on one device: empty when every rank has a GPU of its own.
std::string no_device_per_rank_reason() {
  const std::string why = no_device_reason();
  if (!why.empty()) return "no CUDA device (" + why + ")";
  if (ranks_share_a_gpu()) return "NCCL needs a GPU per rank, and ranks here share one";
  return "";
}

}  // namespace

void expect_nccl_buckets_equal_host(Communicator& nccl);  // test_comm_cuda.cpp

namespace {

// NCCL over the test's host: "mpi" (comm_create) or "tcp" (a tcp world of the same ranks, its addresses
// exchanged over MPI).
std::unique_ptr<Communicator> make_nccl(const std::string& host) {
  if (host == "mpi") return comm::comm_create("nccl");
  return comm::nccl_create_over(comm::tcp_create(world()));
}

class DistNccl : public ::testing::TestWithParam<std::string> {};

template <class T> struct DeviceVec {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceVec(const std::vector<T>& h) : n(h.size()) {
    cudaMalloc(&p, n * sizeof(T) + 1);
    cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    // A copy from pageable memory returns before its last DMA is done, on the legacy default stream, which
    // a caller's non-blocking stream does not wait for (OnTheCallersStream): wait for it here.
    cudaStreamSynchronize(nullptr);
  }
  ~DeviceVec() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

TEST_P(DistNccl, WithoutDeviceTheFactorySaysWhy) {
  const std::string why = no_device_reason();
  if (why.empty()) GTEST_SKIP() << "a CUDA device is present: covered by DistNccl.CollectivesOnDeviceBuffers";
  try {
    make_nccl(GetParam());
    FAIL() << "expected an error without a CUDA device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
}

// Ranks whose devices are one GPU: every rank fails at creation, naming the ranks, the GPU and the way out
// (NCCL's own "duplicate GPU" error names neither); "auto"'s variant gives every rank the host world instead.
TEST_P(DistNccl, RanksSharingAGpuAreRefusedByName) {
  if (!no_device_reason().empty()) GTEST_SKIP() << "no CUDA device: covered by DistNccl.WithoutDeviceTheFactorySaysWhy";
  if (!ranks_share_a_gpu()) GTEST_SKIP() << "every rank has a GPU of its own: covered by DistNccl.CollectivesOnDeviceBuffers";
  try {
    make_nccl(GetParam());
    FAIL() << "expected an error: ranks share a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    const std::string what = e.what();
    EXPECT_NE(what.find(") is also the device of rank "), std::string::npos) << what;
    EXPECT_NE(what.find("CUDA device(s) visible to each), and NCCL needs a GPU per rank"), std::string::npos) << what;
    EXPECT_NE(what.find("'" + GetParam() + "' backend"), std::string::npos) << what;
  }
  std::unique_ptr<Communicator> c = GetParam() == "mpi" ? comm::nccl_or_host_create()
                                                        : comm::nccl_create_over(comm::tcp_create(world()), true);
  EXPECT_EQ(c->backend(), GetParam());
  EXPECT_EQ(c->size(), world().size());
  EXPECT_EQ(c->all_reduce_value<int32_t>(1, ReduceOp::sum), world().size());
}

TEST_P(DistNccl, CollectivesOnDeviceBuffers) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  // "auto"'s variant makes NCCL too where nothing is shared.
  EXPECT_EQ((GetParam() == "mpi" ? comm::nccl_or_host_create()
                                 : comm::nccl_create_over(comm::tcp_create(world()), true))->backend(), "nccl");
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  const int n = c->size(), me = c->rank();
  ASSERT_EQ(c->memory(), comm::MemSpace::device);
  ASSERT_EQ(n, world().size());

  // all_reduce sum of small integers in float (exact in any order).
  std::vector<float> x(1001);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 17) + me);
  DeviceVec<float> dx(x);
  c->all_reduce(dx.p, dx.p, 1001, comm::ScalarType::f32, ReduceOp::sum);
  std::vector<float> got = dx.host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], float(n * int(i % 17) + n * (n - 1) / 2)) << i;

  // all_gather_v with unequal sizes (rank q sends q + 3 bytes).
  std::vector<int64_t> rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    rb[size_t(q)] = q + 3;
    rd[size_t(q)] = total;
    total += q + 3;
  }
  std::vector<uint8_t> mine(static_cast<size_t>(me + 3), uint8_t(me + 1)), all(static_cast<size_t>(total), 0);
  DeviceVec<uint8_t> dmine(mine), dall(all);
  c->all_gather_v(dmine.p, me + 3, dall.p, rb, rd);
  const std::vector<uint8_t> ga = dall.host();
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < q + 3; ++i) ASSERT_EQ(ga[size_t(rd[size_t(q)] + i)], uint8_t(q + 1));

  // all_to_all: byte (src, dst).
  std::vector<uint8_t> s(size_t(n) * 5), r(size_t(n) * 5, 0);
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < 5; ++i) s[size_t(p * 5 + i)] = uint8_t(me * 16 + p);
  DeviceVec<uint8_t> ds(s), dr(r);
  c->all_to_all(ds.p, dr.p, 5);
  const std::vector<uint8_t> ra = dr.host();
  for (int q = 0; q < n; ++q)
    for (int i = 0; i < 5; ++i) ASSERT_EQ(ra[size_t(q * 5 + i)], uint8_t(q * 16 + me));

  // reduce_scatter with unequal counts, and broadcast.
  std::vector<int64_t> counts(static_cast<size_t>(n));
  int64_t all_n = 0;
  for (int p = 0; p < n; ++p) all_n += (counts[size_t(p)] = 2 + p);
  std::vector<double> v(static_cast<size_t>(all_n), double(me + 1)), o(static_cast<size_t>(counts[size_t(me)]), 0.0);
  DeviceVec<double> dv(v), dout(o);
  c->reduce_scatter(dv.p, dout.p, counts, comm::ScalarType::f64);
  for (double y : dout.host()) ASSERT_EQ(y, double(n * (n + 1) / 2));
  std::vector<int32_t> b(7, me == 0 ? 42 : 0);
  DeviceVec<int32_t> db(b);
  c->broadcast(db.p, 7 * 4, 0);
  for (int32_t y : db.host()) ASSERT_EQ(y, 42);
  c->barrier();
}

// Host buffers on NCCL through the *_host calls (device scratch), as the sharded optimizer and the
// checkpoints pass their control data; and the device the backend chose, the rank's among its node's.
TEST_P(DistNccl, HostBuffersGoThroughDeviceScratch) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  const int n = c->size(), me = c->rank();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  EXPECT_EQ(c->device(), comm::node_groups(world()).local_rank % devices);
  EXPECT_EQ(world().device(), -1);

  std::vector<int64_t> rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    rb[size_t(q)] = 2 * q + 1;
    rd[size_t(q)] = total;
    total += 2 * q + 1;
  }
  const std::vector<uint8_t> mine(static_cast<size_t>(2 * me + 1), uint8_t(me + 7));
  std::vector<uint8_t> all(static_cast<size_t>(total), 0);
  comm::all_gather_v_host(*c, mine.data(), 2 * me + 1, all.data(), rb, rd);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < rb[size_t(q)]; ++i) ASSERT_EQ(all[size_t(rd[size_t(q)] + i)], uint8_t(q + 7));

  std::string text = me == n - 1 ? "from the last rank" : std::string(18, '?');
  comm::broadcast_host(*c, text.data(), int64_t(text.size()), n - 1);
  EXPECT_EQ(text, "from the last rank");
  const int64_t v = me + 1;
  std::vector<int64_t> got(static_cast<size_t>(n));
  comm::all_gather_host(*c, &v, got.data(), sizeof(v));
  for (int q = 0; q < n; ++q) EXPECT_EQ(got[size_t(q)], q + 1);
  EXPECT_EQ(comm::all_reduce_host_value<int32_t>(*c, me, ReduceOp::min), 0);
  if (n >= 2 && me < 2) {  // point to point: the pipeline's message headers
    std::string header = me == 0 ? "stage 0's header" : std::string(16, '?');
    if (me == 0) comm::send_host(*c, header.data(), int64_t(header.size()), 1, 1);
    else comm::recv_host(*c, header.data(), int64_t(header.size()), 0, 1);
    EXPECT_EQ(header, "stage 0's header");
  }
}

// On a caller's (non-default) stream: the work is ordered after what the stream already holds (here a
// copy the test queues there without waiting) and complete when the call returns.
TEST_P(DistNccl, OnTheCallersStream) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  c->set_stream(s);
  const int n = c->size(), me = c->rank();
  std::vector<uint8_t> src(size_t(n) * 4096);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(me * 31 + int(i / 4096) * 7 + int(i % 251));
  DeviceVec<uint8_t> staged(std::vector<uint8_t>(src.size(), 0)), out(std::vector<uint8_t>(src.size(), 0));
  ASSERT_EQ(cudaMemcpyAsync(staged.p, src.data(), src.size(), cudaMemcpyHostToDevice, s), cudaSuccess);
  c->all_to_all(staged.p, out.p, 4096);
  const std::vector<uint8_t> got = out.host();
  for (int q = 0; q < n; ++q)
    for (int i = 0; i < 4096; ++i)
      ASSERT_EQ(got[size_t(q) * 4096 + size_t(i)], uint8_t(q * 31 + me * 7 + (me * 4096 + i) % 251)) << q << " " << i;
  // all_gather and reduce_scatter on the same stream
  std::vector<float> mine(300, float(me + 1)), all(300 * size_t(n), 0.0f);
  DeviceVec<float> dm(mine), da(all);
  c->all_gather(dm.p, da.p, 300 * 4);
  const std::vector<float> ga = da.host();
  for (int q = 0; q < n; ++q) ASSERT_EQ(ga[size_t(q) * 300 + 7], float(q + 1));
  std::vector<float> rs(300, 0.0f);
  DeviceVec<float> drs(rs);
  c->reduce_scatter(da.p, drs.p, std::vector<int64_t>(size_t(n), 300), comm::ScalarType::f32);
  for (float y : drs.host()) ASSERT_EQ(y, float(n * (me + 1)));
  // Host memory where device memory is required: named, before anything is sent.
  try {
    c->all_gather(mine.data(), da.p, 300 * 4);
    ADD_FAILURE() << "a host buffer reached NCCL";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("invalid argument 'send': all_gather on 'world' (nccl"), std::string::npos)
        << e.what();
  }
  c->set_stream(nullptr);
  cudaStreamDestroy(s);
}

// Calls made while another device is current (a script that switched devices after making the
// communicator): the communicator works on its own device and leaves the caller's current, as torch's
// process groups do. Without that, the work it orders after the legacy default stream would record its
// event on another device's legacy stream, which CUDA refuses on a machine with several GPUs (the
// simulator's devices; a machine with one GPU skips it).
TEST_P(DistNccl, CallsWhileAnotherDeviceIsCurrent) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "one visible CUDA device: no other device can be current";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  const int n = c->size(), me = c->rank(), mine = c->device(), other = (mine + 1) % devices;
  ASSERT_EQ(cudaSetDevice(mine), cudaSuccess);
  std::vector<float> x(257, float(me + 1));
  DeviceVec<float> dx(x), dy(std::vector<float>(size_t(n) * 257, 0.0f));
  ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
  c->all_reduce(dx.p, dx.p, 257, comm::ScalarType::f32, ReduceOp::sum);
  c->all_gather(dx.p, dy.p, 257 * 4);
  if (n >= 2) {
    const int peer = me ^ 1;
    if (peer < n) {
      c->send_queued(dx.p, 4 * 257, peer, 0);
      c->recv_queued(dy.p, 4 * 257, peer, 0);
      c->sync();
    }
  }
  // Host buffers go through scratch on the communicator's device, not the current one.
  double sum = me + 1.0;
  comm::all_reduce_host(*c, &sum, 1, comm::ScalarType::f64, ReduceOp::sum);
  EXPECT_EQ(sum, double(n * (n + 1) / 2));
  std::vector<int32_t> ranks(size_t(n), -1);
  comm::all_gather_host(*c, &me, ranks.data(), 4);
  for (int q = 0; q < n; ++q) EXPECT_EQ(ranks[size_t(q)], q);
  int32_t root_value = me == 0 ? 7 : 0;
  comm::broadcast_host(*c, &root_value, 4, 0);
  EXPECT_EQ(root_value, 7);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, other) << "the communicator changed the caller's current device";
  ASSERT_EQ(cudaSetDevice(mine), cudaSuccess);
  for (float v : dx.host()) ASSERT_EQ(v, float(n * (n + 1) / 2));
  for (float v : dy.host()) ASSERT_EQ(v, float(n * (n + 1) / 2));
  c->barrier();
}

// Stream-ordered point-to-point (a pipeline stage's messages), on a caller's stream and without one (the
// legacy default stream, torch's default): the calls return before the peer takes part (rank 0 queues a
// send and the receive of its echo, then meets rank 1 in a host barrier that rank 1 passes before it
// receives: blocking calls would wait there until the timeout), the stream's later work sees the data,
// and sync() waits for the transfers.
TEST_P(DistNccl, QueuedPointToPointReturnsBeforeThePeer) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  const int me = c->rank();
  if (c->size() < 2) GTEST_SKIP() << "point to point needs 2 ranks";
  EXPECT_TRUE(c->queues_p2p());
  c->set_timeout(30);
  if (me < 2) {  // NCCL connects a pair at its first transfers, which wait for the peer: blocking ones first
    DeviceVec<uint8_t> w(std::vector<uint8_t>(100, uint8_t(me)));
    if (me == 0) {
      c->send(w.p, 100, 1, 3);
      c->recv(w.p, 100, 1, 3);
    } else {
      c->recv(w.p, 100, 0, 3);
      c->send(w.p, 100, 0, 3);
    }
    EXPECT_EQ(w.host(), std::vector<uint8_t>(100, 0));
  }
  device::Stream callers("the test's stream");
  const size_t n = 65536 + 7;
  for (void* s : {static_cast<void*>(nullptr), callers.get()}) {
    SCOPED_TRACE(s == nullptr ? "the legacy default stream" : "a caller's stream");
    c->set_stream(s);
    std::vector<uint8_t> a(n);
    for (size_t i = 0; i < n; ++i) a[i] = uint8_t(i * 7 + i / 251 + (s == nullptr ? 0 : 1));
    DeviceVec<uint8_t> da(me == 0 ? a : std::vector<uint8_t>(n, 0)), echo(std::vector<uint8_t>(n, 0));
    if (me == 0) {
      c->send_queued(da.p, int64_t(n), 1, 1);
      c->recv_queued(echo.p, int64_t(n), 1, 2);
    }
    c->barrier();  // over the host, not ordered after the queued transfers
    std::vector<uint8_t> seen(n, 0);
    if (me == 1) {
      c->recv_queued(da.p, int64_t(n), 0, 1);
      device::copy(seen.data(), da.p, int64_t(n), s, "the test's copy");  // after the receive on s
      c->send_queued(da.p, int64_t(n), 0, 2);                            // the received bytes back
    }
    c->sync();
    c->sync();  // nothing queued: returns at once
    if (me == 1) {
      EXPECT_EQ(seen, a);
    } else if (me == 0) {
      EXPECT_EQ(echo.host(), a);
    }
  }
  const comm::CommStats st = c->stats();
  if (me < 2) {
    EXPECT_EQ(st.op(comm::OpKind::send).bytes, uint64_t(2 * n + 100));
    EXPECT_EQ(st.op(comm::OpKind::sync).calls, 4u);
  }
  c->set_stream(nullptr);
  c->barrier();
}

TEST_P(DistNccl, BucketCollectivesEqualTheHost) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  c->set_stream(s);
  expect_nccl_buckets_equal_host(*c);
  c->set_stream(nullptr);
  cudaStreamDestroy(s);
}

// Splits carry over: the children bootstrap their own NCCL communicators over the host's children, and
// ranks outside a color get none.
TEST_P(DistNccl, SplitsMakeNcclChildren) {
  const std::string why = no_device_per_rank_reason();
  if (!why.empty()) GTEST_SKIP() << why << ": the NCCL backend cannot run here";
  std::unique_ptr<Communicator> c = make_nccl(GetParam());
  const int n = c->size(), me = c->rank();
  // Even and odd ranks; the last rank of three or more sits out.
  const bool out = n >= 3 && me == n - 1;
  std::unique_ptr<Communicator> half = c->split(out ? Communicator::kNoColor : me % 2, -me, "half");
  if (out) {
    EXPECT_EQ(half, nullptr);
  } else {
    ASSERT_NE(half, nullptr);
    EXPECT_STREQ(half->backend(), "nccl");
    EXPECT_EQ(half->device(), c->device());
    int members = 0, sum = 0;
    for (int p = 0; p < n; ++p)
      if (p % 2 == me % 2 && !(n >= 3 && p == n - 1)) {
        ++members;
        sum += p;
      }
    ASSERT_EQ(half->size(), members);
    std::vector<int32_t> v(33, me);
    DeviceVec<int32_t> dv(v);
    half->all_reduce(dv.p, dv.p, 33, comm::ScalarType::i32, ReduceOp::sum);
    for (int32_t y : dv.host()) ASSERT_EQ(y, sum);
    half->barrier();
  }
  c->barrier();
}

std::string host_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }
INSTANTIATE_TEST_SUITE_P(Host, DistNccl, ::testing::Values("mpi", "tcp"), host_name);

}  // namespace
}  // namespace zero8::test

#endif  // ZERO8_WITH_NCCL
