// The op checks every multi-rank host backend runs (the MPI backend under mpirun, tests/dist/test_comm.cpp;
// the tcp backend with ranks as threads, test_comm_tcp.cpp): each op against the obvious answer on odd
// sizes, sums bit for bit equal to a serial left fold in rank order, and the byte counters' formulas
// (communicator.h, "Byte counters"). Each function is collective: every rank of `c` calls it.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/kernels/hd.h"

namespace zero8::test {

inline uint8_t byte_of(int src, int dst, int64_t i) { return uint8_t((src * 131 + dst * 31 + i * 7 + 1) & 0xff); }

// The bytes-to-peer vector of one op kind, entry by entry, and its total.
inline void expect_peer_bytes(const comm::Communicator& c, comm::OpKind k, const std::vector<uint64_t>& want) {
  const comm::CommStats stats = c.stats();
  const comm::OpStats& s = stats.op(k);
  ASSERT_EQ(s.bytes_to_peer.size(), want.size());
  uint64_t total = 0;
  for (size_t p = 0; p < want.size(); ++p) {
    EXPECT_EQ(s.bytes_to_peer[p], want[p])
        << comm::op_kind_name(k) << " bytes to peer " << p << " (rank " << c.rank() << ")";
    total += want[p];
  }
  EXPECT_EQ(s.bytes, total) << comm::op_kind_name(k);
}

inline void check_all_to_all(comm::Communicator& c) {
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
  expect_peer_bytes(c, comm::OpKind::all_to_all, want);
  EXPECT_EQ(c.stats().op(comm::OpKind::all_to_all).calls, 1u);
}

// Variable sizes (zeros among them) with gaps between the chunks, which must stay untouched.
inline void check_all_to_all_v(comm::Communicator& c) {
  const int n = c.size(), me = c.rank();
  auto count = [](int src, int dst) { return int64_t((src * 7 + dst * 3 + 1) % 11); };
  std::vector<int64_t> sb(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rb(static_cast<size_t>(n)),
      rd(static_cast<size_t>(n));
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
  expect_peer_bytes(c, comm::OpKind::all_to_all_v, want);
}

// all_gather, then all_gather_v in place (rank 0 contributing nothing) and out of place.
inline void check_all_gather(comm::Communicator& c) {
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
  expect_peer_bytes(c, comm::OpKind::all_gather, want);

  // v: rank q contributes (q * 5) % 9 bytes, in place into the gathered buffer.
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
  expect_peer_bytes(c, comm::OpKind::all_gather_v, want);

  std::vector<uint8_t> src(static_cast<size_t>(rb[size_t(me)]));
  for (int64_t i = 0; i < rb[size_t(me)]; ++i) src[size_t(i)] = byte_of(me, 2, i);
  std::vector<uint8_t> out(size_t(total), 0);
  c.all_gather_v(src.data(), rb[size_t(me)], out.data(), rb, rd);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < rb[size_t(q)]; ++i) ASSERT_EQ(out[size_t(rd[size_t(q)] + i)], byte_of(q, 2, i));
}

inline void check_broadcast_from_every_root(comm::Communicator& c) {
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
    expect_peer_bytes(c, comm::OpKind::broadcast, want);
  }
}

template <class T>
T fold_ref(T a, T b, comm::ReduceOp op) {
  if (op == comm::ReduceOp::sum) return T(a + b);
  if (a != a) return a;
  if (b != b) return b;
  return op == comm::ReduceOp::max ? (b > a ? b : a) : (b < a ? b : a);
}

// Rank r's value at i: floats over ~6 decades with both signs, so a sum in another order differs in bits.
template <class T>
T value_of(int r, int64_t i, uint64_t salt) {
  if (std::is_floating_point<T>::value) {
    const float u = rng_uniform(salt * 1000003ull + uint64_t(r), uint64_t(i)) - 0.5f;
    return T(std::ldexp(u, int((uint64_t(i) * 7 + uint64_t(r) * 3 + salt) % 20) - 10));
  }
  return T(int64_t(rng_u32(salt + uint64_t(r) * 7919, uint64_t(i)) % 2001) - 1000);
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Reduce-scatter of T: counts of rank p are odd, one rank owns nothing; the result must be the left fold
// in rank order bit for bit, and the counters the direct algorithm's bytes.
template <class T>
void check_reduce_scatter(comm::Communicator& c, comm::ReduceOp op, uint64_t salt) {
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
  expect_peer_bytes(c, comm::OpKind::reduce_scatter, want);
}

template <class T>
void check_all_reduce(comm::Communicator& c, int64_t count, comm::ReduceOp op, bool in_place, uint64_t salt) {
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
  expect_peer_bytes(c, comm::OpKind::all_reduce, want);
}

// Every type and op of reduce_scatter and all_reduce (in and out of place, empty to odd-sized).
inline void check_reductions(comm::Communicator& c) {
  using comm::ReduceOp;
  uint64_t salt = 10;
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
    check_reduce_scatter<float>(c, op, ++salt);
    check_reduce_scatter<double>(c, op, ++salt);
    check_reduce_scatter<int32_t>(c, op, ++salt);
    check_reduce_scatter<int64_t>(c, op, ++salt);
  }
  for (int64_t count : {0, 1, 3, 1001}) {
    for (bool in_place : {false, true}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
        check_all_reduce<float>(c, count, op, in_place, ++salt);
        check_all_reduce<double>(c, count, op, in_place, ++salt);
        check_all_reduce<int64_t>(c, count, op, in_place, ++salt);
        check_all_reduce<int32_t>(c, count, op, in_place, ++salt);
      }
    }
  }
  check_all_reduce<uint8_t>(c, 37, ReduceOp::max, false, 99);
}

// A NaN on one rank is the max, the min and the sum of every rank.
inline void check_nan_propagation(comm::Communicator& c) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v = {1.0f, float(c.rank()), -2.0f};
  if (c.rank() == c.size() - 1) v[1] = nan;
  std::vector<float> mx = v, mn = v, sm = v;
  c.all_reduce(mx.data(), 3, comm::ReduceOp::max);
  c.all_reduce(mn.data(), 3, comm::ReduceOp::min);
  c.all_reduce(sm.data(), 3, comm::ReduceOp::sum);
  EXPECT_TRUE(std::isnan(mx[1]));
  EXPECT_TRUE(std::isnan(mn[1]));
  EXPECT_TRUE(std::isnan(sm[1]));
  EXPECT_EQ(mx[0], 1.0f);
  EXPECT_EQ(sm[2], -2.0f * float(c.size()));
  EXPECT_EQ(c.all_reduce_value<double>(0.5, comm::ReduceOp::sum), 0.5 * c.size());
  EXPECT_EQ(c.all_reduce_value<int64_t>(c.rank(), comm::ReduceOp::max), c.size() - 1);
}

// Children ordered by (key, rank) with their world ranks mapped, kNoColor opting out, and a grandchild
// that outlives its parent.
inline void check_split(comm::Communicator& c) {
  const int n = c.size(), me = c.rank();
  // Two colors; key = -rank reverses the order inside each child.
  std::unique_ptr<comm::Communicator> child = c.split(me % 2, -me, "parity");
  ASSERT_NE(child, nullptr);
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  ASSERT_EQ(child->size(), int(members.size()));
  EXPECT_EQ(child->world_rank(child->rank()), c.world_rank(me));
  for (int r = 0; r < child->size(); ++r) EXPECT_EQ(child->world_rank(r), c.world_rank(members[size_t(r)]));
  EXPECT_EQ(child->name(), "parity");
  EXPECT_EQ(child->timeout(), c.timeout());
  const int64_t sum = child->all_reduce_value<int64_t>(me, comm::ReduceOp::sum);
  EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), int64_t(0)));

  // Opting out: rank 0 gets no communicator, the others one of size n - 1.
  std::unique_ptr<comm::Communicator> rest = c.split(me == 0 ? comm::Communicator::kNoColor : 7, me);
  if (me == 0) {
    EXPECT_EQ(rest, nullptr);
  } else {
    ASSERT_NE(rest, nullptr);
    EXPECT_EQ(rest->size(), n - 1);
    EXPECT_EQ(rest->rank(), me - 1);
    EXPECT_EQ(rest->all_reduce_value<int64_t>(1, comm::ReduceOp::sum), n - 1);
  }
  // A grandchild still works after its parent is gone.
  std::unique_ptr<comm::Communicator> grand = child->split(0, 0, "grand");
  child.reset();
  EXPECT_EQ(grand->all_reduce_value<int64_t>(1, comm::ReduceOp::sum), int64_t(members.size()));
}

}  // namespace zero8::test
