// Communicator ops under real MPI processes (mpirun -np K, K = 1..4): every op against the obvious
// answer on odd sizes (bit-exact rank-order sums), exact byte counters, split / topology / node groups,
// and a fork()ed child's refused calls.
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

#include "dist_env.h"
#include "zero8/error.h"

namespace zero8::test {
namespace {

using comm::Communicator;
using comm::OpKind;
using comm::ReduceOp;
using comm::ScalarType;

uint8_t byte_of(int src, int dst, int64_t i) { return uint8_t((src * 131 + dst * 31 + i * 7 + 1) & 0xff); }

// Expected bytes-to-peer vector of one op kind, compared entry by entry.
void expect_peer_bytes(const Communicator& c, OpKind k, const std::vector<uint64_t>& want) {
  const comm::CommStats stats = c.stats();
  const comm::OpStats& s = stats.op(k);
  ASSERT_EQ(s.bytes_to_peer.size(), want.size());
  uint64_t total = 0;
  for (size_t p = 0; p < want.size(); ++p) {
    EXPECT_EQ(s.bytes_to_peer[p], want[p]) << comm::op_kind_name(k) << " bytes to peer " << p;
    total += want[p];
  }
  EXPECT_EQ(s.bytes, total) << comm::op_kind_name(k);
}

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

TEST(DistComm, AllToAllEqualChunks) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int64_t bytes = 13;  // odd on purpose
  std::vector<uint8_t> send(static_cast<size_t>(n * bytes)), recv(size_t(n * bytes), 0);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < bytes; ++i) send[size_t(p * bytes + i)] = byte_of(me, p, i);
  c.stats_reset();
  c.all_to_all(send.data(), recv.data(), bytes);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(recv[size_t(q * bytes + i)], byte_of(q, me, i)) << "from " << q;
  std::vector<uint64_t> want(static_cast<size_t>(n), uint64_t(bytes));
  want[size_t(me)] = 0;
  expect_peer_bytes(c, OpKind::all_to_all, want);
  EXPECT_EQ(c.stats().op(OpKind::all_to_all).calls, 1u);
}

TEST(DistComm, AllToAllVVariableSizesWithGaps) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  auto count = [](int src, int dst) { return int64_t((src * 7 + dst * 3 + 1) % 11); };  // includes zeros
  std::vector<int64_t> sb(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  int64_t st = 0, rt = 0;
  for (int p = 0; p < n; ++p) {
    sd[size_t(p)] = st + 3;  // a 3-byte gap before every chunk
    sb[size_t(p)] = count(me, p);
    st = sd[size_t(p)] + sb[size_t(p)];
    rd[size_t(p)] = rt + 5;
    rb[size_t(p)] = count(p, me);
    rt = rd[size_t(p)] + rb[size_t(p)];
  }
  std::vector<uint8_t> send(size_t(st), 0xEE), recv(size_t(rt), 0xAA);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < sb[size_t(p)]; ++i) send[size_t(sd[size_t(p)] + i)] = byte_of(me, p, i);
  c.stats_reset();
  c.all_to_all_v(send.data(), sb, sd, recv.data(), rb, rd);
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < rb[size_t(q)]; ++i) ASSERT_EQ(recv[size_t(rd[size_t(q)] + i)], byte_of(q, me, i));
    for (int64_t g = 1; g <= 5; ++g) ASSERT_EQ(recv[size_t(rd[size_t(q)] - g)], 0xAA) << "gap overwritten";
  }
  std::vector<uint64_t> want(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) want[size_t(p)] = p == me ? 0 : uint64_t(count(me, p));
  expect_peer_bytes(c, OpKind::all_to_all_v, want);
}

TEST(DistComm, AllGatherAndAllGatherV) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int64_t bytes = 7;
  std::vector<uint8_t> mine(bytes), all(size_t(n * bytes), 0);
  for (int64_t i = 0; i < bytes; ++i) mine[size_t(i)] = byte_of(me, 0, i);
  c.stats_reset();
  c.all_gather(mine.data(), all.data(), bytes);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(all[size_t(q * bytes + i)], byte_of(q, 0, i));
  std::vector<uint64_t> want(static_cast<size_t>(n), uint64_t(bytes));
  want[size_t(me)] = 0;
  expect_peer_bytes(c, OpKind::all_gather, want);

  // v: rank q contributes (q * 5) % 9 bytes (rank 0: none), in place into the gathered buffer.
  std::vector<int64_t> rb(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    rb[size_t(q)] = (q * 5) % 9;
    rd[size_t(q)] = total;
    total += rb[size_t(q)] + 1;  // 1-byte gap
  }
  std::vector<uint8_t> buf(size_t(total), 0x55);
  for (int64_t i = 0; i < rb[size_t(me)]; ++i) buf[size_t(rd[size_t(me)] + i)] = byte_of(me, 1, i);
  c.stats_reset();
  c.all_gather_v(buf.data() + rd[size_t(me)], rb[size_t(me)], buf.data(), rb, rd);
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < rb[size_t(q)]; ++i) ASSERT_EQ(buf[size_t(rd[size_t(q)] + i)], byte_of(q, 1, i));
    ASSERT_EQ(buf[size_t(rd[size_t(q)] + rb[size_t(q)])], 0x55) << "gap overwritten";
  }
  for (int p = 0; p < n; ++p) want[size_t(p)] = p == me ? 0 : uint64_t(rb[size_t(me)]);
  expect_peer_bytes(c, OpKind::all_gather_v, want);

  // Out of place.
  std::vector<uint8_t> src(static_cast<size_t>(rb[size_t(me)]));
  for (int64_t i = 0; i < rb[size_t(me)]; ++i) src[size_t(i)] = byte_of(me, 2, i);
  std::vector<uint8_t> out(size_t(total), 0);
  c.all_gather_v(src.data(), rb[size_t(me)], out.data(), rb, rd);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < rb[size_t(q)]; ++i) ASSERT_EQ(out[size_t(rd[size_t(q)] + i)], byte_of(q, 2, i));
}

TEST(DistComm, BroadcastFromEveryRoot) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int64_t bytes = 1001;
  for (int root = 0; root < n; ++root) {
    std::vector<uint8_t> buf(bytes, 0);
    if (me == root)
      for (int64_t i = 0; i < bytes; ++i) buf[size_t(i)] = byte_of(root, 9, i);
    c.stats_reset();
    c.broadcast(buf.data(), bytes, root);
    for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(buf[size_t(i)], byte_of(root, 9, i)) << "root " << root;
    std::vector<uint64_t> want(static_cast<size_t>(n), me == root ? uint64_t(bytes) : 0);
    want[size_t(me)] = 0;
    expect_peer_bytes(c, OpKind::broadcast, want);
  }
}

template <class T> T fold_ref(T a, T b, ReduceOp op) {
  if (op == ReduceOp::sum) return T(a + b);
  if (a != a) return a;
  if (b != b) return b;
  return op == ReduceOp::max ? (b > a ? b : a) : (b < a ? b : a);
}

template <class T> T value_of(int r, int64_t i, uint64_t salt) {
  if (std::is_floating_point<T>::value) return T(dist_value(salt, r, i));
  return T(int64_t(rng_u32(salt + uint64_t(r) * 7919, uint64_t(i)) % 2001) - 1000);
}

template <class T> bool same_bits(T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

// Reduce-scatter of T: counts of rank p are odd, one rank owns nothing; the result must be the
// left fold in rank order bit for bit, and the counters the direct algorithm's bytes.
template <class T> void check_reduce_scatter(ReduceOp op, uint64_t salt) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  std::vector<int64_t> counts(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) counts[size_t(p)] = (n > 1 && p == 1) ? 0 : 5 + 3 * p;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  int64_t begin = 0;
  for (int p = 0; p < me; ++p) begin += counts[size_t(p)];
  std::vector<T> send(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) send[size_t(i)] = value_of<T>(me, i, salt);
  std::vector<T> out(size_t(counts[size_t(me)]) + 1, T(0));
  c.stats_reset();
  c.reduce_scatter(send.data(), out.data(), counts, comm::scalar_type_of<T>(), op);
  for (int64_t i = 0; i < counts[size_t(me)]; ++i) {
    T want = value_of<T>(0, begin + i, salt);
    for (int q = 1; q < n; ++q) want = fold_ref(want, value_of<T>(q, begin + i, salt), op);
    ASSERT_TRUE(same_bits(out[size_t(i)], want)) << "element " << i << ": " << out[size_t(i)] << " vs " << want;
  }
  std::vector<uint64_t> want(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) want[size_t(p)] = p == me ? 0 : uint64_t(counts[size_t(p)]) * sizeof(T);
  expect_peer_bytes(c, OpKind::reduce_scatter, want);
}

TEST(DistComm, ReduceScatterRankOrderBitExact) {
  check_reduce_scatter<float>(ReduceOp::sum, 1);
  check_reduce_scatter<double>(ReduceOp::sum, 2);
  check_reduce_scatter<int64_t>(ReduceOp::sum, 3);
  check_reduce_scatter<float>(ReduceOp::max, 4);
  check_reduce_scatter<int32_t>(ReduceOp::min, 5);
}

template <class T> void check_all_reduce(int64_t count, ReduceOp op, bool in_place, uint64_t salt) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  std::vector<T> send(size_t(count) + 1), recv(size_t(count) + 1, T(0));
  for (int64_t i = 0; i < count; ++i) send[size_t(i)] = value_of<T>(me, i, salt);
  c.stats_reset();
  if (in_place) {
    c.all_reduce(send.data(), count, op);
    recv = send;
  } else {
    c.all_reduce(send.data(), recv.data(), count, comm::scalar_type_of<T>(), op);
  }
  for (int64_t i = 0; i < count; ++i) {
    T want = value_of<T>(0, i, salt);
    for (int q = 1; q < n; ++q) want = fold_ref(want, value_of<T>(q, i, salt), op);
    ASSERT_TRUE(same_bits(recv[size_t(i)], want))
        << comm::scalar_type_name(comm::scalar_type_of<T>()) << " " << comm::reduce_op_name(op) << " count " << count
        << " element " << i << ": " << double(recv[size_t(i)]) << " vs " << double(want);
  }
  // Byte model: reduce-scatter of near-equal parts + all-gather of mine.
  auto part = [&](int p) { return count * (p + 1) / n - count * p / n; };
  std::vector<uint64_t> want(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) want[size_t(p)] = p == me ? 0 : uint64_t(part(p) + part(me)) * sizeof(T);
  expect_peer_bytes(c, OpKind::all_reduce, want);
}

TEST(DistComm, AllReduceEveryTypeAndOpBitExact) {
  uint64_t salt = 10;
  for (int64_t count : {0, 1, 3, 1001}) {
    for (bool in_place : {false, true}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
        check_all_reduce<float>(count, op, in_place, ++salt);
        check_all_reduce<double>(count, op, in_place, ++salt);
        check_all_reduce<int64_t>(count, op, in_place, ++salt);
        check_all_reduce<int32_t>(count, op, in_place, ++salt);
      }
    }
  }
  check_all_reduce<uint8_t>(37, ReduceOp::max, false, 99);
}

TEST(DistComm, AllReduceMaxAndSumPropagateNaN) {
  Communicator& c = world();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v = {1.0f, float(c.rank()), -2.0f};
  if (c.rank() == c.size() - 1) v[1] = nan;
  std::vector<float> mx = v, sm = v;
  c.all_reduce(mx.data(), 3, ReduceOp::max);
  c.all_reduce(sm.data(), 3, ReduceOp::sum);
  EXPECT_TRUE(std::isnan(mx[1]));
  EXPECT_TRUE(std::isnan(sm[1]));
  EXPECT_EQ(mx[0], 1.0f);
  EXPECT_EQ(sm[2], -2.0f * float(c.size()));
  EXPECT_EQ(c.all_reduce_value<double>(0.5, ReduceOp::sum), 0.5 * c.size());
  EXPECT_EQ(c.all_reduce_value<int64_t>(c.rank(), ReduceOp::max), c.size() - 1);
}

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

TEST(DistComm, SplitOrdersByKeyAndWorks) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  // Two colors; key = -rank reverses the order inside each child.
  std::unique_ptr<Communicator> child = c.split(me % 2, -me, "parity");
  ASSERT_NE(child, nullptr);
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  ASSERT_EQ(child->size(), int(members.size()));
  EXPECT_EQ(child->world_rank(child->rank()), me);
  for (int r = 0; r < child->size(); ++r) EXPECT_EQ(child->world_rank(r), members[size_t(r)]);
  EXPECT_EQ(child->name(), "parity");
  EXPECT_EQ(child->timeout(), c.timeout());
  const int64_t sum = child->all_reduce_value<int64_t>(me, ReduceOp::sum);
  EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), int64_t(0)));

  // Opting out: rank 0 gets no communicator, the others one of size n - 1.
  std::unique_ptr<Communicator> rest = c.split(me == 0 ? Communicator::kNoColor : 7, me);
  if (me == 0) {
    EXPECT_EQ(rest, nullptr);
  } else {
    ASSERT_NE(rest, nullptr);
    EXPECT_EQ(rest->size(), n - 1);
    EXPECT_EQ(rest->rank(), me - 1);
    EXPECT_EQ(rest->all_reduce_value<int64_t>(1, ReduceOp::sum), n - 1);
  }
  // A grandchild still works after its parent is gone.
  std::unique_ptr<Communicator> grand = child->split(0, 0, "grand");
  child.reset();
  EXPECT_EQ(grand->all_reduce_value<int64_t>(1, ReduceOp::sum), int64_t(members.size()));
}

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
