// Bucket collectives under real MPI processes: fp32 paths bit-exact against a serial rank-order sum,
// int8 / bf16 paths within the codec's own error bound (derived from the map's gaps), error
// feedback bounding the accumulated error, and int8 wire bytes at 25.05% of fp32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dist_env.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::test {
namespace {

using comm::Communicator;
using comm::OpKind;
using comm::WireFormat;
using comm::WireOptions;

constexpr double kEps32 = 1.0 / (1 << 23);  // float32 machine epsilon

// Owner ranges cut at block multiples: blocks split as evenly as possible, the tail on the last rank.
std::vector<int64_t> block_offsets(int64_t n, int ranks, int64_t block) {
  const int64_t blocks = (n + block - 1) / block;
  std::vector<int64_t> off(size_t(ranks) + 1);
  for (int p = 0; p <= ranks; ++p) off[size_t(p)] = std::min(n, block * (blocks * p / ranks));
  off[size_t(ranks)] = n;
  return off;
}

std::vector<float> bucket_of(int r, int64_t n, uint64_t salt) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = dist_value(salt, r, i);
  return x;
}

// Largest error nearest-rounding to the map can make at normalized value v (v in units of the block's
// absmax): half the gap of the map interval holding v, or the distance to the map's end outside it.
double map_half_gap(const quant::QuantTable& t, double v) {
  if (v <= t.values[0]) return t.values[0] - v;
  if (v >= t.values[255]) return v - t.values[255];
  int hi = 1;
  while (t.values[hi] < v) ++hi;
  return 0.5 * (double(t.values[hi]) - double(t.values[hi - 1]));
}

// Per-element bound of |decode(encode(x)) - x| for int8 blocks: the block's scale is +-absmax
// (its sign is the codec's choice, so both signs are bounded), plus a few float32 roundings of the
// normalization and the decode product.
std::vector<double> int8_error_bound(const std::vector<float>& x, int64_t begin, int64_t end, int32_t block,
                                     const quant::QuantTable& t) {
  std::vector<double> b(static_cast<size_t>(end - begin));
  for (int64_t lo = begin; lo < end; lo += block) {
    const int64_t hi = std::min(end, lo + block);
    double amax = 0;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(double(x[size_t(i)])));
    for (int64_t i = lo; i < hi; ++i) {
      const double v = amax == 0 ? 0 : double(x[size_t(i)]) / amax;
      b[size_t(i - begin)] = (std::max(map_half_gap(t, v), map_half_gap(t, -v)) + 4 * kEps32) * amax;
    }
  }
  return b;
}

struct Case {
  int64_t n;
  int32_t block;
};

// n not a multiple of anything; block 2048 (the default) and 256 (more blocks per rank).
const Case kCases[] = {{2048 * 5 + 333, 2048}, {256 * 13 + 77, 256}};

TEST(DistQuantized, F32ReduceScatterBitExactWithSerialRankOrderSum) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  for (const Case& k : kCases) {
    std::vector<int64_t> off = block_offsets(k.n, n, k.block);
    // Also an uneven cut, not at block multiples (allowed for f32), with an empty range.
    std::vector<int64_t> uneven(size_t(n) + 1, 0);
    for (int p = 1; p < n; ++p) uneven[size_t(p)] = p == 1 ? 0 : k.n * p / n + 3;
    uneven[size_t(n)] = k.n;
    for (const std::vector<int64_t>& o : {off, uneven}) {
      const std::vector<float> x = bucket_of(me, k.n, 7);
      const int64_t b = o[size_t(me)], len = o[size_t(me) + 1] - b;
      std::vector<float> out(static_cast<size_t>(len));
      WireOptions opt;
      opt.format = WireFormat::f32;
      comm::bucket_reduce_scatter(c, x.data(), k.n, o, out.data(), opt);
      std::vector<std::vector<float>> all;
      for (int q = 0; q < n; ++q) all.push_back(bucket_of(q, k.n, 7));
      for (int64_t i = 0; i < len; ++i) {
        float want = all[0][size_t(b + i)];
        for (int q = 1; q < n; ++q) want = want + all[size_t(q)][size_t(b + i)];
        ASSERT_EQ(std::memcmp(&out[size_t(i)], &want, 4), 0) << "element " << b + i;
      }
      // Communicator::reduce_scatter gives the same bits (both fold in rank order).
      std::vector<int64_t> counts(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p) counts[size_t(p)] = o[size_t(p) + 1] - o[size_t(p)];
      std::vector<float> out2(static_cast<size_t>(len));
      c.reduce_scatter(x.data(), out2.data(), counts, comm::ScalarType::f32);
      // An empty range has null data(), which memcmp must not get even for 0 bytes (UBSan).
      if (len > 0) {
        ASSERT_EQ(std::memcmp(out.data(), out2.data(), size_t(len) * 4), 0);
      }
    }
  }
}

TEST(DistQuantized, Int8ReduceScatterWithinCodecErrorBound) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const quant::QuantTable& t = quant::table_get(quant::MapKind::dynamic_signed);
  for (const Case& k : kCases) {
    const std::vector<int64_t> off = block_offsets(k.n, n, k.block);
    const int64_t b = off[size_t(me)], e = off[size_t(me) + 1], len = e - b;
    const std::vector<float> x = bucket_of(me, k.n, 11);
    std::vector<float> out(static_cast<size_t>(len));
    WireOptions opt;
    opt.block = k.block;
    comm::bucket_reduce_scatter(c, x.data(), k.n, off, out.data(), opt);
    // Bound: the codec's error of every remote contribution (the owner's own is added exactly), plus
    // the float32 rounding of n additions, each at most eps * (sum of |terms| + their errors).
    std::vector<double> exact(size_t(len), 0.0), bound(size_t(len), 0.0), mag(size_t(len), 0.0);
    for (int q = 0; q < n; ++q) {
      const std::vector<float> xq = bucket_of(q, k.n, 11);
      const std::vector<double> eb = int8_error_bound(xq, b, e, k.block, t);
      for (int64_t i = 0; i < len; ++i) {
        exact[size_t(i)] += xq[size_t(b + i)];
        mag[size_t(i)] += std::fabs(double(xq[size_t(b + i)])) + eb[size_t(i)];
        if (q != me) bound[size_t(i)] += eb[size_t(i)];
      }
    }
    double worst = 0, used = 0;
    for (int64_t i = 0; i < len; ++i) {
      const double tol = bound[size_t(i)] + n * kEps32 * mag[size_t(i)];
      const double err = std::fabs(double(out[size_t(i)]) - exact[size_t(i)]);
      ASSERT_LE(err, tol) << "element " << b + i << " block " << k.block;
      worst = std::max(worst, err);
      used = std::max(used, tol > 0 ? err / tol : 0.0);
    }
    if (n > 1 && len > 0) {
      EXPECT_GT(worst, 0.0) << "int8 path looks lossless: is it really quantizing?";
    }
    RecordProperty("int8_rs_err_over_bound_block" + std::to_string(k.block), std::to_string(used));
  }
}

TEST(DistQuantized, Bf16ReduceScatterWithinRoundingBound) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int64_t total = 3001;
  std::vector<int64_t> off(size_t(n) + 1);
  for (int p = 0; p <= n; ++p) off[size_t(p)] = total * p / n;
  const int64_t b = off[size_t(me)], len = off[size_t(me) + 1] - b;
  const std::vector<float> x = bucket_of(me, total, 13);
  std::vector<float> out(static_cast<size_t>(len));
  WireOptions opt;
  opt.format = WireFormat::bf16;
  comm::bucket_reduce_scatter(c, x.data(), total, off, out.data(), opt);
  for (int64_t i = 0; i < len; ++i) {
    double exact = 0, bound = 0, mag = 0;
    for (int q = 0; q < n; ++q) {
      const double v = dist_value(13, q, b + i);
      exact += v;
      mag += 2 * std::fabs(v);
      if (q != me) bound += std::ldexp(std::fabs(v), -8);  // bf16 (8 significant bits) rounds to nearest: relative error <= 2^-8
    }
    ASSERT_LE(std::fabs(out[size_t(i)] - exact), bound + n * kEps32 * mag) << "element " << b + i;
  }
}

TEST(DistQuantized, ErrorFeedbackBoundsTheAccumulatedError) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  if (n < 2) GTEST_SKIP() << "one rank: its own contribution is exact, there is no quantization error to feed back";
  const int64_t total = 2048 * 4 + 100;
  const int32_t block = 2048;
  const std::vector<int64_t> off = block_offsets(total, n, block);
  const int64_t b = off[size_t(me)], len = off[size_t(me) + 1] - b;
  const std::vector<float> x = bucket_of(me, total, 17);
  const quant::QuantTable& t = quant::table_get(quant::MapKind::dynamic_signed);
  // The same gradient every round: without feedback the rounding error repeats, and adds up T times;
  // with feedback the transmitted sum telescopes to T * x - e_T, so the accumulated error stays
  // within one round's codec error (of x + e, whose scale is barely larger than x's).
  const int rounds = 16;
  WireOptions opt;
  opt.block = block;
  std::vector<double> acc_plain(size_t(len), 0), acc_fb(size_t(len), 0);
  std::vector<float> residual(size_t(total), 0.0f), out(static_cast<size_t>(len));
  comm::WireWorkspace ws;
  for (int r = 0; r < rounds; ++r) {
    comm::bucket_reduce_scatter(c, x.data(), total, off, out.data(), opt, nullptr, &ws);
    for (int64_t i = 0; i < len; ++i) acc_plain[size_t(i)] += out[size_t(i)];
    comm::bucket_reduce_scatter(c, x.data(), total, off, out.data(), opt, residual.data(), &ws);
    for (int64_t i = 0; i < len; ++i) acc_fb[size_t(i)] += out[size_t(i)];
  }
  // The owner's own range never crosses the wire: its residual stays zero.
  for (int64_t i = b; i < b + len; ++i) ASSERT_EQ(residual[size_t(i)], 0.0f);
  double err_plain = 0, err_fb = 0;
  std::vector<double> one_round(size_t(len), 0), mag(size_t(len), 0);
  for (int q = 0; q < n; ++q) {
    const std::vector<float> xq = bucket_of(q, total, 17);
    const std::vector<double> eb = int8_error_bound(xq, b, b + len, block, t);
    for (int64_t i = 0; i < len; ++i) {
      if (q != me) one_round[size_t(i)] += eb[size_t(i)];
      mag[size_t(i)] += std::fabs(double(xq[size_t(b + i)]));
    }
  }
  for (int64_t i = 0; i < len; ++i) {
    double exact = 0;
    for (int q = 0; q < n; ++q) exact += dist_value(17, q, b + i);
    const double ep = std::fabs(acc_plain[size_t(i)] - rounds * exact);
    const double ef = std::fabs(acc_fb[size_t(i)] - rounds * exact);
    // 2x one round's bound: |e_T| is bounded by the codec error of x + e (scale up to |x|max + |e|max,
    // and |e| <= that error); plus each round's float32 summation rounding.
    ASSERT_LE(ef, 2 * one_round[size_t(i)] + rounds * n * kEps32 * 2 * mag[size_t(i)]) << "element " << b + i;
    err_plain += ep;
    err_fb += ef;
  }
  // Summed over this rank's range (identical ranges on every run): feedback must cut the error by far
  // more than 4x (ideally ~T = 16x).
  if (len > 0) {
    EXPECT_LT(err_fb * 4, err_plain) << "feedback " << err_fb << " vs plain " << err_plain;
  }
}

TEST(DistQuantized, Int8WireBytesAreAQuarterOfF32) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int64_t total = 2048 * 4 * n;  // every range a whole number of 2048-blocks
  const std::vector<int64_t> off = block_offsets(total, n, 2048);
  const std::vector<float> x = bucket_of(me, total, 19);
  std::vector<float> out(static_cast<size_t>(off[size_t(me) + 1] - off[size_t(me)]));
  WireOptions opt;
  uint64_t bytes[2];
  for (int f = 0; f < 2; ++f) {
    opt.format = f == 0 ? WireFormat::int8 : WireFormat::f32;
    c.stats_reset();
    comm::bucket_reduce_scatter(c, x.data(), total, off, out.data(), opt);
    const comm::CommStats stats = c.stats();
    const comm::OpStats& s = stats.op(OpKind::all_to_all_v);
    bytes[f] = s.bytes;
    for (int p = 0; p < n; ++p) {
      const int64_t len = off[size_t(p) + 1] - off[size_t(p)];
      EXPECT_EQ(s.bytes_to_peer[size_t(p)], p == me ? 0u : uint64_t(comm::wire_bytes(opt.format, len, 2048)));
    }
  }
  if (n < 2) GTEST_SKIP() << "one rank sends nothing: no ratio to measure";
  const double ratio = double(bytes[0]) / double(bytes[1]);
  EXPECT_DOUBLE_EQ(ratio, 0.25 + 1.0 / 2048);  // codes + one 4-byte scale per 2048 elements
  EXPECT_LE(ratio, 0.255);
  RecordProperty("bytes_ratio", std::to_string(ratio));
  if (me == 0) std::printf("[rank 0] int8/f32 reduce-scatter bytes: %llu / %llu = %.6f\n", (unsigned long long)bytes[0],
                           (unsigned long long)bytes[1], ratio);
}

TEST(DistQuantized, AllGatherReplicasIdenticalAndWithinBound) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const quant::QuantTable& t = quant::table_get(quant::MapKind::dynamic_signed);
  for (WireFormat f : {WireFormat::f32, WireFormat::bf16, WireFormat::int8}) {
    for (const Case& k : kCases) {
      const std::vector<int64_t> off = block_offsets(k.n, n, k.block);
      const int64_t b = off[size_t(me)], len = off[size_t(me) + 1] - b;
      // Rank q's range holds rank q's values; in place for int8, out of place otherwise.
      std::vector<float> truth(static_cast<size_t>(k.n));
      for (int q = 0; q < n; ++q) {
        const std::vector<float> xq = bucket_of(q, k.n, 23);
        for (int64_t i = off[size_t(q)]; i < off[size_t(q) + 1]; ++i) truth[size_t(i)] = xq[size_t(i)];
      }
      std::vector<float> bucket(size_t(k.n), -7.0f);
      std::vector<float> part(truth.begin() + b, truth.begin() + b + len);
      WireOptions opt;
      opt.format = f;
      opt.block = k.block;
      c.stats_reset();
      if (f == WireFormat::int8) {
        std::copy(part.begin(), part.end(), bucket.begin() + b);
        comm::bucket_all_gather(c, bucket.data() + b, k.n, off, bucket.data(), opt);
      } else {
        comm::bucket_all_gather(c, part.data(), k.n, off, bucket.data(), opt);
      }
      const std::vector<double> eb = int8_error_bound(truth, 0, k.n, k.block, t);
      for (int64_t i = 0; i < k.n; ++i) {
        const double err = std::fabs(double(bucket[size_t(i)]) - truth[size_t(i)]);
        const double tol = f == WireFormat::f32    ? 0.0
                           : f == WireFormat::bf16 ? std::ldexp(std::fabs(double(truth[size_t(i)])), -8)
                                                   : eb[size_t(i)];
        ASSERT_LE(err, tol) << comm::wire_format_name(f) << " element " << i;
      }
      // Identical on every rank: compare with rank 0's copy bit for bit.
      std::vector<float> ref = bucket;
      c.broadcast(ref.data(), k.n * 4, 0);
      ASSERT_EQ(std::memcmp(ref.data(), bucket.data(), size_t(k.n) * 4), 0) << comm::wire_format_name(f);
      const uint64_t want = uint64_t(comm::wire_bytes(f, len, k.block)) * uint64_t(n - 1);
      EXPECT_EQ(c.stats().op(OpKind::all_gather_v).bytes, want) << comm::wire_format_name(f);
    }
  }
}

TEST(DistQuantized, NonFiniteReachesTheOwnerAndSparesTheResidual) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  const int32_t block = 256;
  const int64_t total = block * 3 * n;
  const std::vector<int64_t> off = block_offsets(total, n, block);
  std::vector<float> x = bucket_of(me, total, 29);
  // Rank 0 puts a NaN into the first block of the last rank's range.
  const int owner = n - 1;
  const int64_t bad = off[size_t(owner)] + 5;
  if (me == 0) x[size_t(bad)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> residual(size_t(total), 0.25f);
  std::vector<float> out(static_cast<size_t>(off[size_t(me) + 1] - off[size_t(me)]));
  WireOptions opt;
  opt.block = block;
  comm::bucket_reduce_scatter(c, x.data(), total, off, out.data(), opt, residual.data());
  if (me == owner) {
    EXPECT_TRUE(std::isnan(out[size_t(bad - off[size_t(me)])]));
  }
  if (me == 0 && owner != 0) {
    const int64_t blk = (bad / block) * block;
    for (int64_t i = blk; i < blk + block; ++i) ASSERT_EQ(residual[size_t(i)], 0.25f) << "residual of the NaN block changed";
    ASSERT_NE(residual[size_t(blk + block)], 0.25f) << "a finite block's residual was not updated";
  }
}

TEST(DistQuantized, LayoutErrorsAreInvalidArguments) {
  Communicator& c = world();
  const int n = c.size();
  std::vector<float> x(4096, 1.0f), out(4096);
  WireOptions opt;
  opt.block = 2048;
  std::vector<int64_t> off(size_t(n) + 1, 4096);
  off[0] = 0;
  if (n > 1) off[1] = 100;  // not a multiple of the block
  if (n > 1) {
    EXPECT_THROW(comm::bucket_reduce_scatter(c, x.data(), 4096, off, out.data(), opt), Error);
  }
  std::vector<int64_t> short_off(size_t(n), 0);
  EXPECT_THROW(comm::bucket_reduce_scatter(c, x.data(), 4096, short_off, out.data(), opt), Error);
  opt.block = 100;
  std::vector<int64_t> ok = block_offsets(4096, n, 2048);
  EXPECT_THROW(comm::bucket_all_gather(c, x.data(), 4096, ok, out.data(), opt), Error);
}

}  // namespace
}  // namespace zero8::test
