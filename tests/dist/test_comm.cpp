// Communicator ops under real MPI processes (mpirun -np K, K = 1..4): every op against the obvious
// answer on odd sizes (bit-exact rank-order sums), exact byte counters (comm_op_checks.h, shared with the
// tcp backend's tests), split / topology / node groups, and a fork()ed child's refused calls.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../cpp/comm_op_checks.h"
#include "dist_env.h"
#include "zero8/error.h"

namespace zero8::test {
namespace {

using comm::Communicator;
using comm::OpKind;
using comm::ReduceOp;
using comm::ScalarType;

TEST(DistComm, WorldBasics) {
  Communicator& c = world();
  const char* env = std::getenv("OMPI_COMM_WORLD_SIZE");
  ASSERT_NE(env, nullptr) << "run under mpirun";
  EXPECT_EQ(c.size(), std::atoi(env));
  EXPECT_EQ(c.rank(), std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  EXPECT_STREQ(c.backend(), "mpi");
  EXPECT_EQ(c.memory(), comm::MemSpace::host);
  EXPECT_EQ(c.name(), "world");
  for (int r = 0; r < c.size(); ++r) EXPECT_EQ(c.world_rank(r), r);
  EXPECT_NE(c.description().find("rank " + std::to_string(c.rank())), std::string::npos) << c.description();
}

// The op checks every host backend runs (tests/cpp/comm_op_checks.h).
TEST(DistComm, AllToAllEqualChunks) { check_all_to_all(world()); }
TEST(DistComm, AllToAllVVariableSizesWithGaps) { check_all_to_all_v(world()); }
TEST(DistComm, AllGatherAndAllGatherV) { check_all_gather(world()); }
TEST(DistComm, BroadcastFromEveryRoot) { check_broadcast_from_every_root(world()); }
TEST(DistComm, ReductionsEveryTypeAndOpBitExact) { check_reductions(world()); }
TEST(DistComm, AllReduceMaxMinAndSumPropagateNaN) { check_nan_propagation(world()); }

TEST(DistComm, BarrierCountsCallsNotBytes) {
  Communicator& c = world();
  c.stats_reset();
  c.barrier();
  c.barrier();
  EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 2u);
  EXPECT_EQ(c.stats().bytes(), 0u);
  EXPECT_GE(c.stats().op(OpKind::barrier).seconds, 0.0);
}

TEST(DistComm, SendRecvRingBothDirections) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  if (n < 2) GTEST_SKIP() << "point-to-point needs 2 ranks";
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  auto size_of = [](int src) { return int64_t(777 + src); };
  std::vector<uint8_t> out(static_cast<size_t>(size_of(me))), in(static_cast<size_t>(size_of(prev)));
  for (int64_t i = 0; i < size_of(me); ++i) out[size_t(i)] = byte_of(me, next, i);
  c.stats_reset();
  // Blocking send: even ranks send first, odd ranks receive first, so the ring cannot deadlock.
  for (int tag : {3, 4}) {
    if (me % 2 == 0) {
      c.send(out.data(), size_of(me), next, tag);
      c.recv(in.data(), size_of(prev), prev, tag);
    } else {
      c.recv(in.data(), size_of(prev), prev, tag);
      c.send(out.data(), size_of(me), next, tag);
    }
    for (int64_t i = 0; i < size_of(prev); ++i) ASSERT_EQ(in[size_t(i)], byte_of(prev, me, i));
  }
  std::vector<uint64_t> want(static_cast<size_t>(n), 0);
  want[size_t(next)] = 2 * uint64_t(size_of(me));
  if (next == me) want[size_t(next)] = 0;
  expect_peer_bytes(c, OpKind::send, want);
  EXPECT_EQ(c.stats().op(OpKind::recv).calls, 2u);
  EXPECT_EQ(c.stats().op(OpKind::recv).bytes, 0u);
}

TEST(DistComm, SplitOrdersByKeyAndWorks) { check_split(world()); }

TEST(DistComm, TopologyGroupsForEveryPipelineSize) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  for (int pp = 1; pp <= n; ++pp) {
    if (n % pp != 0) continue;
    comm::Topology t = comm::topology_split(c, pp);
    const int dp = n / pp;
    EXPECT_EQ(t.pp, pp);
    EXPECT_EQ(t.dp, dp);
    EXPECT_EQ(t.pp_stage * dp + t.dp_rank, me);
    ASSERT_EQ(t.dp_group->size(), dp);
    ASSERT_EQ(t.pp_group->size(), pp);
    EXPECT_EQ(t.dp_group->rank(), t.dp_rank);
    EXPECT_EQ(t.pp_group->rank(), t.pp_stage);
    for (int d = 0; d < dp; ++d) EXPECT_EQ(t.dp_group->world_rank(d), t.pp_stage * dp + d);
    for (int s = 0; s < pp; ++s) EXPECT_EQ(t.pp_group->world_rank(s), s * dp + t.dp_rank);
    EXPECT_EQ(t.dp_group->name(), "dp[stage " + std::to_string(t.pp_stage) + "]");
    // A sum inside each group equals the sum of its world ranks.
    int64_t want_dp = 0, want_pp = 0;
    for (int d = 0; d < dp; ++d) want_dp += t.pp_stage * dp + d;
    for (int s = 0; s < pp; ++s) want_pp += s * dp + t.dp_rank;
    EXPECT_EQ(t.dp_group->all_reduce_value<int64_t>(me, ReduceOp::sum), want_dp);
    EXPECT_EQ(t.pp_group->all_reduce_value<int64_t>(me, ReduceOp::sum), want_pp);
  }
  EXPECT_THROW(comm::topology_split(c, n + 1), Error);
}

TEST(DistComm, NodeGroupsFromHostnameAndOverride) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  {
    // All ranks of this test run on one machine.
    comm::NodeGroups g = comm::node_groups(c);
    EXPECT_EQ(g.nodes, 1);
    EXPECT_EQ(g.node, 0);
    EXPECT_EQ(g.local_rank, me);
    EXPECT_EQ(g.local_size, n);
    EXPECT_EQ(g.intra->size(), n);
    EXPECT_EQ(g.inter->size(), 1);
  }
  // Pretend ranks [0, h) are on node "a" and [h, n) on node "b".
  const int h = (n + 1) / 2;
  setenv("ZERO8_COMM_NODE", me < h ? "a" : "b", 1);
  comm::NodeGroups g = comm::node_groups(c);
  unsetenv("ZERO8_COMM_NODE");
  const bool first = me < h;
  EXPECT_EQ(g.nodes, n > 1 ? 2 : 1);
  EXPECT_EQ(g.node, first ? 0 : 1);
  EXPECT_EQ(g.local_rank, first ? me : me - h);
  EXPECT_EQ(g.local_size, first ? h : n - h);
  ASSERT_EQ(g.intra->size(), g.local_size);
  EXPECT_EQ(g.intra->world_rank(0), first ? 0 : h);
  // inter: the ranks with my local rank, one per node.
  const int inter_size = (g.local_rank < n - h) ? (n > 1 ? 2 : 1) : 1;
  ASSERT_EQ(g.inter->size(), inter_size);
  EXPECT_EQ(g.inter->world_rank(0), g.local_rank);
}

TEST(DistComm, StatsResetAndTimeoutSetting) {
  Communicator& c = world();
  c.all_reduce_value<float>(1.0f, ReduceOp::sum);
  EXPECT_GT(c.stats().op(OpKind::all_reduce).calls, 0u);
  c.stats_reset();
  EXPECT_EQ(c.stats().op(OpKind::all_reduce).calls, 0u);
  EXPECT_EQ(c.stats().bytes(), 0u);
  EXPECT_EQ(c.stats().bytes_to_peer(), std::vector<uint64_t>(size_t(c.size()), 0));
  const double old = c.timeout();
  EXPECT_THROW(c.set_timeout(0.0), Error);
  EXPECT_THROW(c.set_timeout(-1.0), Error);
  c.set_timeout(12.5);
  EXPECT_EQ(c.timeout(), 12.5);
  c.set_timeout(old);
}

TEST(DistComm, InvalidArgumentsThrowBeforeCommunicating) {
  Communicator& c = world();
  std::vector<int64_t> wrong(size_t(c.size()) + 1, 0);
  uint8_t b = 0;
  EXPECT_THROW(c.all_to_all_v(&b, wrong, wrong, &b, wrong, wrong), Error);
  EXPECT_THROW(c.broadcast(&b, 1, c.size()), Error);
  EXPECT_THROW(c.send(&b, 1, c.rank(), 0), Error);
  EXPECT_THROW(c.all_reduce(&b, &b, -1, ScalarType::u8, ReduceOp::sum), Error);
  try {
    c.recv(&b, 1, c.size() + 3, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("peer"), std::string::npos) << e.what();
  }
  // The communicator still works afterwards (argument errors do not poison it).
  EXPECT_EQ(c.all_reduce_value<int32_t>(1, ReduceOp::sum), c.size());
}

// The forked child's status after `run` in it, waited for up to 30 s (then killed: a failure).
int fork_and_wait(const std::function<void()>& run) {
  const pid_t child = fork();
  if (child == 0) {
    run();
    _exit(100);
  }
  if (child < 0) return -1;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  pid_t got = 0;
  while ((got = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (got == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    return -2;
  }
  return status;
}

// A fork()ed child (a data-loader worker) inherits the communicator but not its connections: the
// mesh's sockets are closed there, and files the child opens reuse their numbers. A call in the child
// must throw, saying whose communicator it is, and write nothing to those files.
TEST(DistComm, ForkedChildCannotUseTheCommunicator) {
  Communicator& c = world();
  c.barrier();
  const pid_t parent = getpid();
  const int status = fork_and_wait([&] {
    // Exit codes: 0 ok, 1 no error, 2 wrong error, 3 a file was written.
    std::vector<int> files;
    for (int i = 0; i < 64; ++i) files.push_back(memfd_create("zero8_fork_test", 0));
    c.set_timeout(3);  // without the check, the call would wait for peers that never come
    int code = 1;
    try {
      c.barrier();
    } catch (const Error& e) {
      const std::string want = "this communicator belongs to process " + std::to_string(parent) +
                               " and cannot be used after fork() (this is its child, process " +
                               std::to_string(getpid()) + ")";
      code = std::string(e.what()).find(want) != std::string::npos && e.code() == ErrorCode::comm ? 0 : 2;
      if (code != 0) std::fprintf(stderr, "forked child: unexpected error: %s\n", e.what());
    }
    for (int fd : files)
      if (fd >= 0 && lseek(fd, 0, SEEK_END) != 0) code = 3;
    _exit(code);
  });
  ASSERT_NE(status, -1) << "fork() failed";
  ASSERT_NE(status, -2) << "the forked child's call did not return within 30 s";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: no error, 2: another error, 3: the child wrote into its own files";
  // The parent's communicator is untouched.
  EXPECT_EQ(c.all_reduce_value<int32_t>(1, ReduceOp::sum), c.size());
}

// A forked child that ends without using the communicator still runs its destructors (a normal
// exit), or aborts on an error: neither may act on the parent's MPI state. MPI_Finalize in the child
// would join the parent's runtime (it blocks there), and MPI_Abort would end the parent's whole job.
TEST(DistComm, ForkedChildLeavesTheParentsMpiAlone) {
  Communicator& c = world();
  c.barrier();
  // The child destroys its copy of the world communicator (freeing the communicators, the mesh
  // and, as the last user, MPI), as static destructors at exit would.
  int status = fork_and_wait([&] {
    delete &c;
    _exit(0);
  });
  ASSERT_NE(status, -2) << "the forked child's communicator destructor did not return within 30 s";
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // abort() in the child ends the child only, with its exit code.
  status = fork_and_wait([&] { c.abort(3); });
  ASSERT_NE(status, -2) << "the forked child's abort() did not return within 30 s";
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 3);
  // The parent's job goes on.
  EXPECT_EQ(c.all_reduce_value<int32_t>(1, ReduceOp::sum), c.size());
}

}  // namespace
}  // namespace zero8::test
