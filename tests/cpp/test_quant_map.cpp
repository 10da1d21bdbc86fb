// Quantization maps and their search tables: the dynamic maps bit-identical to the reference table,
// linear maps well formed, thresholds (and the SIMD bucket accelerator and the VBMI cells) giving the
// exact nearest value, and table_build rejecting malformed maps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "exact_nearest.h"
#include "zero8/error.h"
#include "zero8/kernels/quant_map.h"

namespace {

using zero8::f32_bits;
using zero8::f32_from_bits;
using namespace zero8::quant;

constexpr MapKind kAllMaps[] = {MapKind::dynamic_signed, MapKind::dynamic_unsigned, MapKind::linear_signed,
                                MapKind::linear_unsigned};

// Reference table: "index signed_value signed_hex unsigned_value unsigned_hex", '#' comments.
struct RefMaps {
  std::vector<uint32_t> signed_bits, unsigned_bits;
};
RefMaps read_reference_maps() {
  const std::string path = std::string(ZERO8_TEST_DATA_DIR) + "/dynamic_maps.txt";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  RefMaps r;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    int index = -1;
    std::string sv, sh, uv, uh;
    ls >> index >> sv >> sh >> uv >> uh;
    EXPECT_EQ(index, int(r.signed_bits.size())) << line;
    r.signed_bits.push_back(uint32_t(std::stoul(sh, nullptr, 16)));
    r.unsigned_bits.push_back(uint32_t(std::stoul(uh, nullptr, 16)));
    // The decimal column must agree with the hex one (guards against a misparsed file).
    EXPECT_EQ(std::stof(sv), f32_from_bits(r.signed_bits.back())) << line;
    EXPECT_EQ(std::stof(uv), f32_from_bits(r.unsigned_bits.back())) << line;
  }
  return r;
}

// Independent nearest: argmin over all 256 values of the exact distance |n - v|, ties to the even code.
uint32_t brute_nearest(float n, const float* v) { return zero8::test::exact_nearest(n, v); }

// Floats around every threshold-relevant point of a map: each value, each exact midpoint (rounded both
// ways) and their float neighbours, plus random and special values.
std::vector<float> probe_points(const float* v, uint64_t seed) {
  std::vector<float> pts;
  auto around = [&](float f) {
    float lo = f, hi = f;
    pts.push_back(f);
    for (int k = 0; k < 3; ++k) {
      lo = std::nextafter(lo, -2.0f);
      hi = std::nextafter(hi, 2.0f);
      pts.push_back(lo);
      pts.push_back(hi);
    }
  };
  for (int i = 0; i < 256; ++i) around(v[i]);
  for (int i = 0; i < 255; ++i) {
    const double m = (double(v[i]) + double(v[i + 1])) / 2.0;
    around(float(m));
    around(std::nextafter(float(m), float(m) < m ? 2.0f : -2.0f));  // the float on m's other side
  }
  for (float s : {0.0f, -0.0f, 1.0f, -1.0f, 1e-45f, -1e-45f, 1e-38f, -1e-38f, 1.5f, -1.5f}) pts.push_back(s);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-40.0f, 0.0f);
  for (int k = 0; k < 100000; ++k) pts.push_back(uni(rng));
  for (int k = 0; k < 100000; ++k) pts.push_back((k % 2 ? -1.0f : 1.0f) * std::pow(10.0f, expo(rng)));
  return pts;
}

TEST(QuantMap, DynamicMapsMatchReferenceBits) {
  const RefMaps ref = read_reference_maps();
  ASSERT_EQ(ref.signed_bits.size(), 256u);
  ASSERT_EQ(ref.unsigned_bits.size(), 256u);
  const std::vector<float> s = map_values(MapKind::dynamic_signed), u = map_values(MapKind::dynamic_unsigned);
  for (int i = 0; i < 256; ++i) {
    EXPECT_EQ(f32_bits(s[i]), ref.signed_bits[i]) << "signed index " << i;
    EXPECT_EQ(f32_bits(u[i]), ref.unsigned_bits[i]) << "unsigned index " << i;
    EXPECT_EQ(f32_bits(table_get(MapKind::dynamic_signed).values[i]), ref.signed_bits[i]) << i;
    EXPECT_EQ(f32_bits(table_get(MapKind::dynamic_unsigned).values[i]), ref.unsigned_bits[i]) << i;
  }
}

TEST(QuantMap, DynamicMapShape) {
  const QuantTable& s = table_get(MapKind::dynamic_signed);
  const QuantTable& u = table_get(MapKind::dynamic_unsigned);
  // Signed: 127 negative values, one zero, 128 positive ending at exactly 1 (no -1, hence the signed scale).
  EXPECT_EQ(s.values[255], 1.0f);
  EXPECT_GT(s.values[0], -1.0f);
  EXPECT_FALSE(s.has_neg_one);
  EXPECT_EQ(s.values[s.zero_code], 0.0f);
  EXPECT_EQ(s.nonneg_first, s.zero_code);
  EXPECT_EQ(s.nonpos_last, s.zero_code);
  EXPECT_EQ(s.zero_code, 127);
  // Unsigned: starts at 0, ends at 1.
  EXPECT_EQ(u.values[0], 0.0f);
  EXPECT_EQ(u.values[255], 1.0f);
  EXPECT_TRUE(u.is_unsigned);
  EXPECT_EQ(u.zero_code, 0);
  for (int i = 0; i + 1 < 256; ++i) {
    EXPECT_LT(s.values[i], s.values[i + 1]) << i;
    EXPECT_LT(u.values[i], u.values[i + 1]) << i;
  }
}

TEST(QuantMap, LinearMapsAreEvenlySpaced) {
  for (const bool is_signed : {true, false}) {
    const std::vector<float> v = map_values(is_signed ? MapKind::linear_signed : MapKind::linear_unsigned);
    ASSERT_EQ(v.size(), 256u);
    EXPECT_EQ(v[0], is_signed ? -1.0f : 0.0f);
    EXPECT_EQ(v[255], 1.0f);
    const double step = (is_signed ? 2.0 : 1.0) / 255.0;
    for (int i = 0; i + 1 < 256; ++i) {
      // Each value is one float32 rounding of the exact grid point (error <= 2^-25 for |v| <= 1),
      // so a step differs from the exact one by at most 2^-24.
      EXPECT_NEAR(double(v[i + 1]) - double(v[i]), step, std::ldexp(1.0, -24)) << i;
      EXPECT_NEAR(double(v[i]), (is_signed ? -1.0 : 0.0) + step * i, std::ldexp(1.0, -25)) << i;
    }
  }
  // The signed linear map has no zero: zero blocks take the even code of the two values around 0.
  const QuantTable& t = table_get(MapKind::linear_signed);
  EXPECT_TRUE(t.has_neg_one);
  EXPECT_EQ(t.zero_code, 128);
  EXPECT_EQ(t.values[127], -t.values[128]);
}

TEST(QuantMap, ThresholdsGiveExactNearestIncludingMidpoints) {
  for (MapKind kind : kAllMaps) {
    const QuantTable& t = table_get(kind);
    int64_t bad = 0, bad_lut = 0;
    for (float n : probe_points(t.values, 7 + uint64_t(kind))) {
      const uint32_t want = brute_nearest(n, t.values);
      const uint32_t got = quant_code_nearest(n, t), got_lut = quant_code_nearest_lut(n, t);
      if (got != want && bad++ < 5) ADD_FAILURE() << map_kind_name(kind) << " n=" << n << " want " << want << " got " << got;
      if (got_lut != want && bad_lut++ < 5)
        ADD_FAILURE() << map_kind_name(kind) << " (accelerator) n=" << n << " want " << want << " got " << got_lut;
      // The VBMI cells serve |n| <= 1 (what x / scale can be).
      const uint32_t got_cells = std::fabs(n) <= 1.0f ? quant_code_nearest_cells(n, t) : want;
      if (got_cells != want && bad_lut++ < 5)
        ADD_FAILURE() << map_kind_name(kind) << " (cells) n=" << n << " want " << want << " got " << got_cells;
    }
    EXPECT_EQ(bad, 0) << map_kind_name(kind);
    EXPECT_EQ(bad_lut, 0) << map_kind_name(kind);
  }
}

// The accelerator must agree with the threshold search over every float, which (the code being
// monotone in n) is settled at each bucket's two ends and at every threshold's two sides.
void expect_accelerator_exact(const QuantTable& t, const char* what) {
  int64_t bad = 0;
  auto check = [&](float n) {
    if (quant_code_nearest_lut(n, t) != quant_code_nearest(n, t) && bad++ < 5)
      ADD_FAILURE() << what << ": n=" << n << " lut " << quant_code_nearest_lut(n, t) << " search "
                    << quant_code_nearest(n, t);
  };
  for (uint32_t q = 0; q <= 0x7fffu; ++q) {  // every upper-16-bit pattern of a finite |n|, both ends
    if (q >= 0x7f80u) break;
    for (uint32_t sign : {0u, 0x80000000u}) {
      check(f32_from_bits(sign | (q << 16)));
      check(f32_from_bits(sign | (q << 16) | 0xffffu));
      check(f32_from_bits(sign | (q << 16) | 0x8000u));
    }
  }
  for (int i = 0; i < 255; ++i) {
    const float th = t.thresholds[i];
    check(th);
    check(std::nextafter(th, 2.0f));
    check(std::nextafter(th, -2.0f));
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(QuantMap, AcceleratorIsExactForStandardMaps) {
  for (MapKind kind : kAllMaps) {
    const QuantTable& t = table_get(kind);
    EXPECT_EQ(t.lut_steps, 1) << map_kind_name(kind);  // one threshold per bucket at most
    expect_accelerator_exact(t, map_kind_name(kind));
  }
  // The dynamic maps (optimizer states, wire data) take the one-read path.
  EXPECT_TRUE(table_get(MapKind::dynamic_signed).lut_packed);
  EXPECT_TRUE(table_get(MapKind::dynamic_unsigned).lut_packed);
}

std::vector<float> linspace(double a, double b, int k) {
  std::vector<float> v(k);
  for (int i = 0; i < k; ++i) v[i] = float(a + (b - a) * i / (k - 1));
  return v;
}

TEST(QuantMap, AcceleratorFallsBackForUnusualMaps) {
  {  // a dense cluster: several thresholds per bucket, refined by compare-and-increment steps
    std::vector<float> v = linspace(-1.0, 0.5, 200), c = linspace(0.5 + 1e-3, 0.6, 56);
    v.insert(v.end(), c.begin(), c.end());
    const QuantTable t = table_build(v);
    EXPECT_GE(t.lut_steps, 2);
    EXPECT_LE(t.lut_steps, 7);
    EXPECT_FALSE(t.lut_packed);
    expect_accelerator_exact(t, "dense cluster");
  }
  {  // three equal values in a row: thresholds not monotone, plain binary search
    std::vector<float> v = linspace(-1.0, 1.0, 256);
    v[100] = v[101] = v[102];
    const QuantTable t = table_build(v);
    EXPECT_EQ(t.lut_steps, kQuantLutNoSteps);
    expect_accelerator_exact(t, "triple value");
  }
  {  // values far below the accelerator's finest binade share its first bucket
    std::vector<float> v = linspace(-1.0, 1.0, 256);
    v[128] = 1e-30f;
    v[129] = 2e-30f;
    const QuantTable t = table_build(v);
    EXPECT_FALSE(t.lut_packed);
    expect_accelerator_exact(t, "tiny values");
  }
}

// The VBMI cells must agree with the threshold search for every |n| <= 1, which (the code being monotone
// in n, and a cell an interval) is settled at both ends of every 16-bit bucket, inside it, and on both
// sides of every threshold. Returns the number of cells used.
uint32_t expect_cells_exact(const QuantTable& t, const char* what) {
  int64_t bad = 0;
  auto check = [&](float n) {
    if (!(std::fabs(n) <= 1.0f)) return;
    if (quant_code_nearest_cells(n, t) != quant_code_nearest(n, t) && bad++ < 5)
      ADD_FAILURE() << what << ": n=" << n << " (0x" << std::hex << f32_bits(n) << std::dec << ") cells "
                    << quant_code_nearest_cells(n, t) << " search " << quant_code_nearest(n, t);
  };
  for (uint32_t q = 0; q <= 0x3f80u; ++q) {  // every upper-16-bit pattern of |n| <= 1
    for (uint32_t sign : {0u, 0x80000000u}) {
      check(f32_from_bits(sign | (q << 16)));
      check(f32_from_bits(sign | (q << 16) | 0xffffu));
      check(f32_from_bits(sign | (q << 16) | 0x8000u));
    }
  }
  for (int i = 0; i < 255; ++i) {
    for (const float th : {t.thresholds[i], -t.thresholds[i]}) {
      check(th);
      check(std::nextafter(th, 2.0f));
      check(std::nextafter(th, -2.0f));
    }
  }
  EXPECT_EQ(bad, 0) << what;
  // Cells used: the end of the last cell of any level-1 slot (slots of binades 103..127, both signs).
  uint32_t cells = 0;
  for (uint32_t e = kQuantLutLo >> 7; e <= kQuantLutHi >> 7; ++e) {
    for (const uint32_t slot : {e - 64, e - 103}) cells = std::max(cells, t.cell_base[slot] + (128u >> t.cell_shift[slot]));
  }
  return cells;
}

// The standard maps all have cells (so the VBMI variant encodes them with byte permutes), within the
// 512 that four 128-entry permutes hold; the byte planes of values and thresholds are theirs.
TEST(QuantMap, CellsAreExactForStandardMaps) {
  for (MapKind kind : kAllMaps) {
    const QuantTable& t = table_get(kind);
    ASSERT_TRUE(t.cells_ok) << map_kind_name(kind);
    const uint32_t cells = expect_cells_exact(t, map_kind_name(kind));
    EXPECT_LE(cells, kQuantCellsMax) << map_kind_name(kind);
    for (int c = 0; c < 256; ++c) {
      uint32_t v = 0, th = 0;
      for (int k = 0; k < 4; ++k) {
        v |= uint32_t(t.value_bytes[k][c]) << (8 * k);
        th |= uint32_t(t.threshold_bytes[k][c]) << (8 * k);
      }
      ASSERT_EQ(v, f32_bits(t.values[c])) << map_kind_name(kind) << " value " << c;
      ASSERT_EQ(th, f32_bits(t.thresholds[c])) << map_kind_name(kind) << " threshold " << c;
    }
  }
  // The dynamic maps (optimizer states) as measured when the cells were designed: 438 and 466 cells.
  EXPECT_EQ(expect_cells_exact(table_get(MapKind::dynamic_signed), "dynamic"), 438u);
  EXPECT_EQ(expect_cells_exact(table_get(MapKind::dynamic_unsigned), "dynamic_unsigned"), 466u);
}

// Custom maps: cells wherever every bucket holds at most one threshold and they fit in 512; thresholds
// inside the shared smallest bucket (tiny values, the cubic map's threshold just below 0) are fine.
// Not monotone, or needing more cells: cells_ok is 0 and the VBMI encoder uses the lut instead.
TEST(QuantMap, CellsForCustomMaps) {
  std::vector<float> cubic(256), tiny = linspace(-1.0, 1.0, 256);
  for (int i = 0; i < 256; ++i) cubic[size_t(i)] = float(std::pow(-1.0 + 2.0 * i / 255, 3));
  tiny[128] = 1e-30f;
  tiny[129] = 2e-30f;
  for (const auto& [name, values] : {std::pair<const char*, std::vector<float>>{"cubic", cubic},
                                     {"tiny values", tiny},
                                     {"dynamic, 4 exponent bits", map_dynamic_values(true, 4, 8)},
                                     {"dynamic, 6 exponent bits", map_dynamic_values(true, 6, 8)}}) {
    const QuantTable t = table_build(values);
    ASSERT_TRUE(t.cells_ok) << name;
    EXPECT_LE(expect_cells_exact(t, name), kQuantCellsMax) << name;
  }
  EXPECT_FALSE(table_build(map_dynamic_values(true, 2, 8)).cells_ok);  // more than 512 cells
  std::vector<float> triple = linspace(-1.0, 1.0, 256);
  triple[100] = triple[101] = triple[102];
  EXPECT_FALSE(table_build(triple).cells_ok);  // thresholds not monotone
  std::vector<float> dense = linspace(-1.0, 0.5, 200), c = linspace(0.5 + 1e-3, 0.6, 56);
  dense.insert(dense.end(), c.begin(), c.end());
  EXPECT_FALSE(table_build(dense).cells_ok);  // two thresholds in one bucket
}

// quant_quotient_fma (the SIMD encoders' division-free x / scale) is the correctly rounded quotient:
// every mantissa of x against divisors with special mantissas (1, 1 + ulp, all ones, 1/3- and 2/3-like)
// and random ones; then scales at every exponent of [2^-64, 2^126] with quotients down to 2^-33, either
// sign. Smaller quotients stay below 2^-32, where tables with fma_quotient_ok have no threshold.
TEST(QuantMap, FmaQuotientIsTheDivision) {
  std::mt19937 rng(11);
  std::vector<uint32_t> mantissas = {0, 1, 2, 0x7fffff, 0x7ffffe, 0x400000, 0x3fffff, 0x555555, 0x2aaaab};
  for (int i = 0; i < 3; ++i) mantissas.push_back(rng() & 0x7fffffu);
  int64_t bad = 0;
  for (uint32_t m : mantissas) {
    const float s = f32_from_bits((127u << 23) | m), r = 1.0f / s;  // s in [1, 2)
    for (uint32_t e : {126u, 127u}) {                                   // quotients in [0.25, 2)
      for (uint32_t xm = 0; xm < (1u << 23); ++xm) {
        const float x = f32_from_bits((e << 23) | xm);
        if (f32_bits(quant_quotient_fma(x, s, r)) != f32_bits(x / s) && bad++ < 3)
          ADD_FAILURE() << x << " / " << s << ": " << quant_quotient_fma(x, s, r) << " vs " << x / s;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  for (int e = -64; e <= 125; ++e) {
    for (int k = 0; k < 2000; ++k) {
      const float s = std::ldexp(1.0f + float(rng() & 0x7fffffu) * 0x1p-23f, e) * (k % 2 ? -1.0f : 1.0f);
      const float f = std::ldexp(1.0f + float(rng() & 0x7fffffu) * 0x1p-23f, -int(rng() % 40) - 1);
      const float x = (k % 4 < 2 ? f : -f) * s, r = 1.0f / s;
      ASSERT_TRUE(quant_quotient_fma_ok(s, table_get(MapKind::dynamic_signed))) << s;
      const float q = quant_quotient_fma(x, s, r), d = x / s;
      if (std::fabs(d) >= 0x1p-33f)
        ASSERT_EQ(f32_bits(q), f32_bits(d)) << x << " / " << s;
      else
        ASSERT_LT(std::fabs(q), 0x1p-32f) << x << " / " << s;
    }
  }
  // Out of range, the encoders divide.
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  for (float s : {0x1p-65f, -0x1.fffffep-65f, 0x1.000002p126f, 3e38f, 1e-40f})
    EXPECT_FALSE(quant_quotient_fma_ok(s, t)) << s;
  for (MapKind kind : kAllMaps)  // the signed linear map has no 0: its middle threshold is 0
    EXPECT_EQ(table_get(kind).fma_quotient_ok, kind != MapKind::linear_signed) << map_kind_name(kind);
  std::vector<float> tiny = linspace(-1.0, 1.0, 256);  // values near 0 put thresholds below 2^-32
  tiny[127] = -1e-30f;
  tiny[128] = 1e-30f;
  EXPECT_FALSE(table_build(tiny).fma_quotient_ok);
}

// The CUDA warp step's encode (quant_encode_accel: the accelerator, and the multiply-add quotient where the
// map has an exact 0) against the full rule, for every standard map and two unusual ones, over block
// scales of both signs from 2^-70 to 2^127 (and 0, NaN) and elements anywhere in the block's range,
// at the thresholds and next to them, tiny ones and signed zeros among them.
TEST(QuantMap, AcceleratedEncodeIsTheFullRule) {
  std::vector<std::pair<std::string, QuantTable>> tables;
  for (MapKind kind : kAllMaps) tables.emplace_back(map_kind_name(kind), table_get(kind));
  std::vector<float> cluster = linspace(-1.0, 0.5, 200), c = linspace(0.5 + 1e-3, 0.6, 56);
  cluster.insert(cluster.end(), c.begin(), c.end());
  tables.emplace_back("dense cluster", table_build(cluster));
  std::vector<float> tiny = linspace(-1.0, 1.0, 256);
  tiny[127] = -1e-30f;
  tiny[128] = 1e-30f;
  tables.emplace_back("values near 0", table_build(tiny));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (const auto& [name, t] : tables) {
    std::vector<float> scales = {0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f, -1.0f, 0x1p-70f, 0x1p127f,
                                 -0x1p-65f, 0x1.fffffep-65f, 0x1p126f, 0x1.000002p126f};
    for (int e = -70; e <= 126; e += 7) scales.push_back(std::ldexp(1.0f + 0.5f * (unit(rng) + 1.0f), e) * (e % 2 ? -1.0f : 1.0f));
    int64_t bad = 0;
    for (float scale : scales) {
      const QuantBlockDivisor d = quant_block_divisor(scale, t);
      std::vector<float> xs = {0.0f, -0.0f, scale, -scale, 1e-45f, -1e-45f, 1e-38f * scale, -1e-38f * scale};
      for (int i = 0; i < 255; ++i) {
        for (float n : {t.thresholds[i], std::nextafter(t.thresholds[i], 2.0f), std::nextafter(t.thresholds[i], -2.0f)})
          xs.push_back(n * scale);
      }
      for (int i = 0; i < 2000; ++i) xs.push_back(unit(rng) * std::ldexp(1.0f, -int(rng() % 40)) * scale);
      for (float x : xs) {
        if (!(std::fabs(x) <= std::fabs(scale))) continue;  // a block's elements lie within its scale
        const uint32_t want = quant_encode_one(x, scale, t, false, 0.0f);
        const uint32_t got = quant_encode_accel(x, d, t, t.lut, t.thresholds, t.lut_steps, t.lut_packed != 0);
        if (got != want && bad++ < 5)
          ADD_FAILURE() << name << ": x " << x << " scale " << scale << ": " << got << " vs " << want;
      }
    }
    EXPECT_EQ(bad, 0) << name;
  }
}

void expect_values_error(const std::vector<float>& v, const char* what) {
  try {
    table_build(v);
    ADD_FAILURE() << what << ": no error";
  } catch (const zero8::Error& e) {
    EXPECT_EQ(e.code(), zero8::ErrorCode::invalid_argument) << what;
    EXPECT_NE(std::string(e.what()).find("'values'"), std::string::npos) << what << ": " << e.what();
  }
}

TEST(QuantMap, TableBuildRejectsMalformedMaps) {
  const std::vector<float> good = map_values(MapKind::dynamic_signed);
  EXPECT_NO_THROW(table_build(good));
  expect_values_error(std::vector<float>(good.begin(), good.end() - 1), "255 values");
  std::vector<float> v = good;
  v.push_back(1.0f);
  expect_values_error(v, "257 values");
  v = good;
  std::swap(v[10], v[11]);
  expect_values_error(v, "unsorted");
  v = good;
  v[3] = std::numeric_limits<float>::quiet_NaN();
  expect_values_error(v, "NaN");
  v = good;
  v[255] = std::numeric_limits<float>::infinity();
  expect_values_error(v, "Inf");
  v = good;
  v[255] = 1.5f;
  expect_values_error(v, "outside [-1, 1]");
}

}  // namespace
