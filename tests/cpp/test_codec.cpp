// Block-wise codec: every CPU variant this machine runs (the avx512 one with and without its VBMI code),
// for fp32/bf16/fp16, against an independent brute-force encoder (codes and scales compared exactly) on
// many input distributions and lengths; decode bit-exact; stochastic rounding reproducible and
// unbiased; thread counts; bad arguments; and the ZERO8_ISA and ZERO8_AVX512_VBMI overrides.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../../kernels/src/codec_internal.h"  // the per-ISA single-block helpers the optimizers use
#include "exact_nearest.h"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/quant.h"

namespace {

using namespace zero8;
using namespace zero8::quant;

// Child mode for the IsaEnvironment tests: report isa_active() (or, with ZERO8_TEST_VBMI_CHILD,
// isa_avx512_vbmi()) and exit before any test runs.
const bool g_isa_child = [] {
  if (!std::getenv("ZERO8_TEST_ISA_CHILD")) return false;
  try {
    if (std::getenv("ZERO8_TEST_VBMI_CHILD"))
      std::printf("%d\n", isa_avx512_vbmi() ? 1 : 0);
    else
      std::printf("%s\n", isa_name(isa_active()));
    std::fflush(stdout);
    std::_Exit(0);
  } catch (const Error& e) {
    std::printf("error: %s\n", e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}();

constexpr Isa kAllIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512};

// A CPU variant as the tests run it: an Isa, and for avx512 whether its VBMI code is on.
struct Variant {
  Isa isa;
  bool vbmi;
};
constexpr Variant kAllVariants[] = {{Isa::scalar, false}, {Isa::avx2, false}, {Isa::avx512, false}, {Isa::avx512, true}};
std::string variant_name(const Variant& v) { return v.vbmi ? "avx512vbmi" : isa_name(v.isa); }
void PrintTo(const Variant& v, std::ostream* os) { *os << variant_name(v); }
constexpr DType kAllDtypes[] = {DType::f32, DType::bf16, DType::f16};
constexpr MapKind kAllMaps[] = {MapKind::dynamic_signed, MapKind::dynamic_unsigned, MapKind::linear_signed,
                                MapKind::linear_unsigned};
constexpr int32_t kAllBlocks[] = {64, 128, 256, 512, 1024, 2048, 4096};

// ---- tensors of any dtype ----

struct Tensor {
  DType dtype = DType::f32;
  int64_t n = 0;
  std::vector<uint32_t> storage;  // 4-byte aligned backing store for either element size

  Tensor(DType dt, int64_t count) : dtype(dt), n(count), storage(size_t((count * dtype_size(dt) + 3) / 4 + 1)) {}
  void* data() { return storage.data(); }
  const void* data() const { return storage.data(); }
  float get(int64_t i) const { return dtype_load(data(), dtype, i); }
  void set(int64_t i, float v) { dtype_store(data(), dtype, i, v); }
  uint32_t bits(int64_t i) const {
    return dtype == DType::f32 ? f32_bits(get(i)) : static_cast<const uint16_t*>(data())[i];
  }
};

// ---- inputs ----

enum class Dist { uniform, gaussian, cauchy, student_t, zeros, subnormal, huge, mixed, nonfinite };
constexpr Dist kAllDists[] = {Dist::uniform, Dist::gaussian, Dist::cauchy,  Dist::student_t, Dist::zeros,
                              Dist::subnormal, Dist::huge,   Dist::mixed, Dist::nonfinite};
const char* dist_name(Dist d) {
  static const char* names[] = {"uniform", "gaussian", "cauchy", "student_t", "zeros",
                                "subnormal", "huge", "mixed", "nonfinite"};
  return names[int(d)];
}

// log2 of the smallest subnormal and of the largest finite value of a dtype.
double dtype_min_log2(DType t) { return t == DType::f16 ? -24.0 : -149.0; }
double dtype_max_log2(DType t) { return t == DType::f16 ? 15.99 : 127.99; }

// Values are generated in double and rounded to the dtype (what a caller would pass).
Tensor make_input(Dist d, DType dt, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(-1.0, 1.0), unit(0.0, 1.0);
  std::normal_distribution<double> gauss(0.0, 1.0);
  std::cauchy_distribution<double> cauchy(0.0, 1.0);
  std::student_t_distribution<double> student(3.0);
  auto log_uniform = [&](double lo2, double hi2) {
    const double m = std::exp2(lo2 + (hi2 - lo2) * unit(rng));
    return rng() % 2 ? m : -m;
  };
  Tensor x(dt, n);
  for (int64_t i = 0; i < n; ++i) {
    double v = 0.0;
    switch (d) {
      case Dist::uniform: v = uni(rng) * 3.0; break;
      case Dist::gaussian: v = gauss(rng); break;
      case Dist::cauchy: v = cauchy(rng); break;
      case Dist::student_t: v = student(rng); break;
      case Dist::zeros: v = (i % 3 == 1) ? -0.0 : 0.0; break;
      case Dist::subnormal:  // below the smallest normal of the dtype (2^-126 or, for fp16, 2^-14)
        v = log_uniform(dtype_min_log2(dt), dt == DType::f16 ? -14.0 : -126.0);
        break;
      case Dist::huge:  // 1e30..3e38 (fp16: 1e3..6.5e4, its own top range)
        v = dt == DType::f16 ? log_uniform(std::log2(1e3), std::log2(6.5e4)) : log_uniform(std::log2(1e30), std::log2(3e38));
        break;
      case Dist::mixed: v = log_uniform(dtype_min_log2(dt), dtype_max_log2(dt)); break;
      case Dist::nonfinite: {
        v = gauss(rng);
        const uint64_t r = rng() % 97;
        if (r == 0) v = std::numeric_limits<double>::quiet_NaN();
        if (r == 1) v = std::numeric_limits<double>::infinity();
        if (r == 2) v = -std::numeric_limits<double>::infinity();
        break;
      }
    }
    x.set(i, float(v));  // double -> float -> dtype: both roundings to nearest even
  }
  return x;
}

// ---- the independent brute-force encoder (the documented rule, written out) ----

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

uint32_t brute_nearest(float n, const float* v) { return zero8::test::exact_nearest(n, v); }

// Stochastic: between the largest value <= n and the next, up with probability (n - a) / (b - a).
uint32_t brute_stochastic(float n, float u, const float* v) {
  if (!(n > v[0])) return 0;
  if (n >= v[255]) return 255;
  uint32_t lo = 0;
  for (uint32_t i = 0; i < 256; ++i)
    if (v[i] <= n) lo = i;
  const float p = (n - v[lo]) / (v[lo + 1] - v[lo]);
  return u < p ? lo + 1 : lo;
}

// scale = the block's absmax; negated when the extreme element is negative and the map lacks -1;
// 0 for an all-zero block, NaN with any non-finite element (codes: the code nearest to 0).
// code = nearest map value to x / scale, ties to the even code; a nonzero value never changes sign.
Quantized brute_encode(const Tensor& x, int32_t block, const float* v, bool stochastic = false, uint64_t seed = 0,
                       uint64_t index_base = 0) {
  Quantized q;
  q.codes.resize(size_t(x.n));
  const uint32_t zero_code = brute_nearest(0.0f, v);
  uint32_t nonneg_first = 255, nonpos_last = 0;
  for (int i = 255; i >= 0; --i)
    if (v[i] >= 0.0f) nonneg_first = uint32_t(i);
  for (int i = 0; i < 256; ++i)
    if (v[i] <= 0.0f) nonpos_last = uint32_t(i);
  for (int64_t lo = 0; lo < x.n; lo += block) {
    const int64_t hi = std::min<int64_t>(x.n, lo + block);
    bool finite = true;
    float vmin = 0.0f, vmax = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      const float e = x.get(i);
      finite = finite && std::isfinite(e);
      if (e < vmin) vmin = e;
      if (e > vmax) vmax = e;
    }
    float scale = vmax >= -vmin ? vmax : (v[0] == -1.0f ? -vmin : vmin);
    if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
    q.scales.push_back(scale);
    for (int64_t i = lo; i < hi; ++i) {
      if (!finite || scale == 0.0f) {
        q.codes[size_t(i)] = uint8_t(zero_code);
        continue;
      }
      const float n = x.get(i) / scale;
      uint32_t c = stochastic ? brute_stochastic(n, rng_uniform(seed, index_base + uint64_t(i)), v) : brute_nearest(n, v);
      const float xi = x.get(i);
      const bool want_positive = (xi > 0.0f) == (scale > 0.0f);  // the decode's sign must be x's
      if (xi != 0.0f && want_positive && v[c] < 0.0f) c = nonneg_first;
      if (xi != 0.0f && !want_positive && v[c] > 0.0f) c = nonpos_last;
      q.codes[size_t(i)] = uint8_t(c);
    }
  }
  return q;
}

// ---- running a variant ----

Quantized run_encode(const Tensor& x, int32_t block, const QuantTable& t, Isa isa, int threads = 1,
                     bool stochastic = false, uint64_t seed = 0, uint64_t index_base = 0) {
  Quantized q;
  q.codes.assign(size_t(x.n), 0xAA);
  q.scales.assign(size_t((x.n + block - 1) / block), -7.0f);
  EncodeArgs a;
  a.x = x.data();
  a.dtype = x.dtype;
  a.n = x.n;
  a.block = block;
  a.table = &t;
  a.codes = q.codes.data();
  a.absmax = q.scales.data();
  a.stochastic = stochastic;
  a.seed = seed;
  a.index_base = index_base;
  quant_encode(a, isa, threads);
  return q;
}

Tensor run_decode(const Quantized& q, int64_t n, int32_t block, const QuantTable& t, Isa isa, DType out,
                  int threads = 1, const Tensor* accumulate_into = nullptr) {
  Tensor y = accumulate_into ? *accumulate_into : Tensor(out, n);
  DecodeArgs a;
  a.codes = q.codes.data();
  a.absmax = q.scales.data();
  a.n = n;
  a.block = block;
  a.table = &t;
  a.y = y.data();
  a.dtype = out;
  a.accumulate = accumulate_into != nullptr;
  quant_decode(a, isa, threads);
  return y;
}

bool same_bits(float a, float b) { return f32_bits(a) == f32_bits(b); }

// Compare codes and scales exactly; report the first few differences.
void expect_same(const Quantized& want, const Quantized& got, const std::string& what) {
  ASSERT_EQ(want.codes.size(), got.codes.size()) << what;
  ASSERT_EQ(want.scales.size(), got.scales.size()) << what;
  int bad = 0;
  for (size_t b = 0; b < want.scales.size(); ++b) {
    const bool ok = same_bits(want.scales[b], got.scales[b]) || (std::isnan(want.scales[b]) && std::isnan(got.scales[b]));
    if (!ok && bad++ < 3) ADD_FAILURE() << what << ": scale " << b << " want " << want.scales[b] << " got " << got.scales[b];
  }
  for (size_t i = 0; i < want.codes.size(); ++i)
    if (want.codes[i] != got.codes[i] && bad++ < 8)
      ADD_FAILURE() << what << ": code " << i << " want " << int(want.codes[i]) << " got " << int(got.codes[i]);
  EXPECT_EQ(bad, 0) << what;
}

std::vector<int64_t> test_lengths(int32_t block) {
  return {1, 37, block - 1, 2 * int64_t(block) + block / 3 + 5};  // n < block, n = block - 1, partial last block
}

// ---- variant-parameterised tests ----

// Runs each test with the variant's VBMI setting and restores the default afterwards.
class CodecIsa : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    const Variant v = GetParam();
    if (!isa_supported(v.isa) || (v.vbmi && !isa_avx512_vbmi_supported()))
      GTEST_SKIP() << "this CPU/OS or build cannot run the " << variant_name(v) << " variant";
    saved_vbmi_ = isa_avx512_vbmi();
    isa_set_avx512_vbmi(v.vbmi);
  }
  void TearDown() override { isa_set_avx512_vbmi(saved_vbmi_); }
  std::string name() const { return variant_name(GetParam()); }

 private:
  bool saved_vbmi_ = false;
};

// Nearest rounding: codes and scales equal the brute-force encoder for every dtype, distribution, map,
// block size and length; the block's extreme element decodes exactly; no decoded value flips sign.
TEST_P(CodecIsa, NearestMatchesBruteForce) {
  const Isa isa = GetParam().isa;
  uint64_t seed = 1;
  for (DType dt : kAllDtypes) {
    for (Dist d : kAllDists) {
      for (MapKind kind : kAllMaps) {
        // Each (dtype, distribution) runs all maps at a few block sizes and one map at all of them.
        for (int32_t block : kAllBlocks) {
          if (kind != MapKind::dynamic_signed && block != 64 && block != 256 && block != 4096) continue;
          const QuantTable& t = table_get(kind);
          for (int64_t n : test_lengths(block)) {
            const Tensor x = make_input(d, dt, n, ++seed);
            const std::string what = name() + " " + dtype_name(dt) + " " + dist_name(d) + " " +
                                     map_kind_name(kind) + " block " + std::to_string(block) + " n " + std::to_string(n);
            const Quantized want = brute_encode(x, block, t.values);
            const Quantized got = run_encode(x, block, t, isa);
            expect_same(want, got, what);
            if (HasFailure()) return;
            // Decode in float32: the extreme element of each finite block comes back exactly, and a
            // decoded value is never of the opposite sign to its input.
            const Tensor y = run_decode(got, n, block, t, isa, DType::f32);
            for (int64_t lo = 0; lo < n; lo += block) {
              const int64_t hi = std::min<int64_t>(n, lo + block);
              const float scale = got.scales[size_t(lo / block)];
              if (std::isnan(scale)) continue;
              // The extreme element has n = +1 (or -1 when the map holds -1): it decodes exactly.
              int exact = 0;
              for (int64_t i = lo; i < hi; ++i) {
                const float xi = x.get(i), yi = y.get(i);
                if (scale != 0.0f && (xi == scale || (xi == -scale && t.has_neg_one))) {
                  EXPECT_EQ(yi, xi) << what << " extreme element " << i;
                  ++exact;
                }
                EXPECT_FALSE((xi > 0.0f && yi < 0.0f) || (xi < 0.0f && yi > 0.0f)) << what << " sign flip at " << i;
              }
              if (scale != 0.0f) {
                EXPECT_GT(exact, 0) << what << " block at " << lo << " has no extreme element";
              }
            }
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// Every SIMD variant equals the scalar reference byte for byte: codes, scales, and decoded output
// (float32, bfloat16, float16 and float32 accumulate) bit for bit, on large mixed inputs.
TEST_P(CodecIsa, MatchesScalarReferenceBitwise) {
  const Isa isa = GetParam().isa;
  for (MapKind kind : kAllMaps) {
    const QuantTable& t = table_get(kind);
    for (DType dt : kAllDtypes) {
      for (int32_t block : {64, 256, 2048}) {
        const int64_t n = 40 * int64_t(block) + 19;
        for (Dist d : {Dist::gaussian, Dist::mixed, Dist::cauchy, Dist::nonfinite}) {
          const Tensor x = make_input(d, dt, n, 1000 + uint64_t(block) + uint64_t(d));
          const std::string what = name() + " " + map_kind_name(kind) + " " + dtype_name(dt) +
                                   " " + dist_name(d) + " block " + std::to_string(block);
          const Quantized ref = run_encode(x, block, t, Isa::scalar);
          const Quantized got = run_encode(x, block, t, isa);
          expect_same(ref, got, what);
          for (DType out : kAllDtypes) {
            const Tensor yr = run_decode(ref, n, block, t, Isa::scalar, out), yg = run_decode(ref, n, block, t, isa, out);
            int bad = 0;
            for (int64_t i = 0; i < n; ++i)
              if (yr.bits(i) != yg.bits(i) && bad++ < 3)
                ADD_FAILURE() << what << " decode to " << dtype_name(out) << " at " << i << ": " << yr.get(i) << " vs " << yg.get(i);
          }
          Tensor base(DType::f32, n);
          for (int64_t i = 0; i < n; ++i) base.set(i, float(i % 17) * 0.25f - 2.0f);
          const Tensor ar = run_decode(ref, n, block, t, Isa::scalar, DType::f32, 1, &base);
          const Tensor ag = run_decode(ref, n, block, t, isa, DType::f32, 1, &base);
          int bad = 0;
          for (int64_t i = 0; i < n; ++i)
            if (ar.bits(i) != ag.bits(i) && bad++ < 3) ADD_FAILURE() << what << " accumulate at " << i;
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The VBMI encoder normalizes by quant_quotient_fma (no division) where the block's scale lies in
// [2^-64, 2^126], and divides elsewhere: blocks on both sides of both bounds, with quotients on the map's
// thresholds and their neighbours, and quotients down to 2^-45, give the scalar reference's codes.
TEST_P(CodecIsa, ScalesAroundTheQuotientBoundsMatchReference) {
  const Isa isa = GetParam().isa;
  const float scales[] = {0x1p-66f, std::nextafter(0x1p-64f, 0.0f), 0x1p-64f, 0x1.8p-64f, 0x1.234568p-40f, 1.0f,
                          0x1.fffffep-1f, 0x1.5p100f, 0x1p126f, std::nextafter(0x1p126f, 1e38f), 0x1.fp127f};
  constexpr int32_t kBlock = 256;
  std::mt19937_64 rng(77);
  for (MapKind kind : kAllMaps) {
    const QuantTable& t = table_get(kind);
    Tensor x(DType::f32, int64_t(std::size(scales)) * kBlock);
    for (size_t b = 0; b < std::size(scales); ++b) {
      const float s = scales[b];
      for (int32_t i = 0; i < kBlock; ++i) {
        float f;
        if (i == 0) {
          f = 1.0f;  // the block's extreme element: the scale is s
        } else if (i % 2) {  // on a threshold (t.thresholds[c] < 1), or one ulp either side
          const float th = t.thresholds[rng() % 255];
          f = i % 3 == 0 ? th : std::nextafter(th, i % 3 == 1 ? -2.0f : 2.0f);
        } else {  // |f| log-uniform in [2^-45, 1], either sign
          f = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, -int(rng() % 45) - 1) * (rng() % 2 ? 1.0f : -1.0f);
        }
        if (t.is_unsigned) f = std::fabs(f);
        x.set(int64_t(b) * kBlock + i, std::fmin(std::fmax(f * s, -s), s));
      }
    }
    const std::string what = name() + " " + map_kind_name(kind);
    expect_same(run_encode(x, kBlock, t, Isa::scalar), run_encode(x, kBlock, t, isa), what);
    if (HasFailure()) return;
  }
}

// Decode is y = values[code] * scale (rounded once to the output dtype), or y += that in float32,
// for any scale: negative, zero, subnormal, huge, NaN.
TEST_P(CodecIsa, DecodeMatchesDefinition) {
  const Isa isa = GetParam().isa;
  std::mt19937_64 rng(99);
  const float scales[] = {1.0f, -0.37f, 0.0f, 1e-40f, -3e38f, 7.5e4f, std::numeric_limits<float>::quiet_NaN(), 2.5e-3f};
  for (MapKind kind : {MapKind::dynamic_signed, MapKind::dynamic_unsigned}) {
    const QuantTable& t = table_get(kind);
    for (int32_t block : {64, 4096}) {
      const int64_t n = 8 * int64_t(block) + 13;
      Quantized q;
      for (int64_t i = 0; i < n; ++i) q.codes.push_back(uint8_t(rng()));
      for (int64_t b = 0; b < (n + block - 1) / block; ++b) q.scales.push_back(scales[b % 8]);
      Tensor base(DType::f32, n);
      for (int64_t i = 0; i < n; ++i) base.set(i, float(int64_t(rng() % 2001) - 1000) * 1e-3f);
      for (DType out : kAllDtypes) {
        const Tensor y = run_decode(q, n, block, t, isa, out);
        Tensor want(out, n);
        for (int64_t i = 0; i < n; ++i) want.set(i, t.values[q.codes[size_t(i)]] * q.scales[size_t(i / block)]);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.bits(i), want.bits(i)) << dtype_name(out) << " at " << i;
      }
      const Tensor acc = run_decode(q, n, block, t, isa, DType::f32, 1, &base);
      for (int64_t i = 0; i < n; ++i) {
        const float want = base.get(i) + t.values[q.codes[size_t(i)]] * q.scales[size_t(i / block)];
        ASSERT_TRUE(same_bits(acc.get(i), want) || (std::isnan(want) && std::isnan(acc.get(i)))) << "accumulate at " << i;
      }
    }
  }
}

// Maps outside the accelerator's fast path: a dense cluster (several threshold steps per bucket),
// a triple value (non-monotone thresholds and repeated values: binary searches), and the signed
// linear map (a threshold at 0 in the shared smallest bucket); nearest and stochastic rounding.
TEST_P(CodecIsa, UnusualMapsMatchScalarReference) {
  const Isa isa = GetParam().isa;
  std::vector<QuantTable> tables;
  std::vector<float> dense(256), triple(256);
  for (int i = 0; i < 200; ++i) dense[i] = float(-1.0 + 1.5 * i / 199);
  for (int i = 200; i < 256; ++i) dense[i] = float(0.501 + 0.099 * (i - 200) / 55);
  for (int i = 0; i < 256; ++i) triple[i] = float(-1.0 + 2.0 * i / 255);
  triple[100] = triple[101] = triple[102];
  tables.push_back(table_build(dense));
  tables.push_back(table_build(triple));
  tables.push_back(table_get(MapKind::linear_signed));
  ASSERT_TRUE(tables[0].lut_steps >= 2 && tables[0].lut_steps <= 7);
  ASSERT_EQ(tables[1].lut_steps, kQuantLutNoSteps);
  ASSERT_FALSE(tables[2].lut_packed);
  for (size_t k = 0; k < tables.size(); ++k) {
    for (DType dt : kAllDtypes) {
      const Tensor x = make_input(Dist::uniform, dt, 10 * 256 + 7, 555 + k);
      for (bool stochastic : {false, true}) {
        // Stochastic rounding on the triple-value map takes the reference's search instead of the
        // nearest-code shortcut (which needs strictly increasing values).
        expect_same(run_encode(x, 256, tables[k], Isa::scalar, 1, stochastic, 9, 3),
                    run_encode(x, 256, tables[k], isa, 1, stochastic, 9, 3),
                    "map " + std::to_string(k) + " " + dtype_name(dt) + (stochastic ? " stochastic" : " nearest"));
      }
    }
  }
}

// Custom sorted maps, with and without the VBMI encoder's cells (QuantTable::cells_ok; without them the
// VBMI variant encodes as the avx512 one): nearest codes and scales equal the scalar reference for every
// dtype, block sizes 64..4096 with partial last blocks, and blocks of zeros, subnormals, huge values,
// NaN and Inf. The maps put thresholds in the accelerator's shared smallest bucket (cubic, tiny
// values), lack an exact 0 (the no-sign-flip rule acts: cubic, tiny values), or need more than the
// 512 cells the byte permutes hold (bitsandbytes' dynamic map with 2 exponent bits).
TEST_P(CodecIsa, CustomMapsMatchScalarReference) {
  const Isa isa = GetParam().isa;
  std::vector<float> cubic(256), tiny(256), square(256);
  for (int i = 0; i < 256; ++i) {
    const double x = -1.0 + 2.0 * i / 255;
    cubic[size_t(i)] = float(x * x * x);
    tiny[size_t(i)] = float(x);
    square[size_t(i)] = float(double(i) * i / (255.0 * 255.0));
  }
  tiny[128] = 1e-30f;
  tiny[129] = 2e-30f;
  const struct {
    const char* name;
    std::vector<float> values;
    bool cells;
  } maps[] = {{"cubic", cubic, true},
              {"tiny values", tiny, true},
              {"square (unsigned)", square, true},
              {"dynamic, 4 exponent bits", map_dynamic_values(true, 4, 8), true},
              {"dynamic, 6 exponent bits", map_dynamic_values(true, 6, 8), true},
              {"dynamic, 2 exponent bits", map_dynamic_values(true, 2, 8), false}};
  uint64_t seed = 4000;
  for (const auto& m : maps) {
    const QuantTable t = table_build(m.values);
    ASSERT_EQ(bool(t.cells_ok), m.cells) << m.name;
    for (DType dt : kAllDtypes) {
      for (int32_t block : kAllBlocks) {
        const int64_t n = 3 * int64_t(block) + block / 2 + 7;
        for (Dist d : {Dist::uniform, Dist::gaussian, Dist::mixed, Dist::zeros, Dist::subnormal, Dist::huge,
                       Dist::nonfinite}) {
          if (block > 256 && d != Dist::mixed && d != Dist::nonfinite) continue;  // large blocks: two inputs
          const Tensor x = make_input(d, dt, n, ++seed);
          expect_same(run_encode(x, block, t, Isa::scalar), run_encode(x, block, t, isa),
                      name() + " map " + m.name + " " + dtype_name(dt) + " " + dist_name(d) + " block " +
                          std::to_string(block));
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The single-block helpers the fused optimizers call: same codes, scale and decode as the reference.
TEST_P(CodecIsa, BlockHelpersMatchReference) {
  const Isa isa = GetParam().isa;
  const bool vbmi = GetParam().vbmi;
  auto encode = vbmi ? quant_block_encode_f32_avx512vbmi
                : isa == Isa::avx512 ? quant_block_encode_f32_avx512
                : isa == Isa::avx2 ? quant_block_encode_f32_avx2 : quant_block_encode_f32_ref;
  auto decode = vbmi ? quant_block_decode_f32_avx512vbmi
                : isa == Isa::avx512 ? quant_block_decode_f32_avx512
                : isa == Isa::avx2 ? quant_block_decode_f32_avx2 : quant_block_decode_f32_ref;
  for (MapKind kind : {MapKind::dynamic_signed, MapKind::dynamic_unsigned}) {
    const QuantTable& t = table_get(kind);
    for (int32_t len : {1, 5, 16, 17, 64, 100, 256, 1000, 4096}) {
      for (Dist d : {Dist::gaussian, Dist::mixed, Dist::zeros, Dist::nonfinite}) {
        const Tensor x = make_input(d, DType::f32, len, 77 + uint64_t(len));
        const float* xp = static_cast<const float*>(x.data());
        std::vector<uint8_t> cr(static_cast<size_t>(len)), cg(static_cast<size_t>(len));
        const float sr = quant_block_encode_f32_ref(xp, len, t, cr.data());
        const float sg = encode(xp, len, t, cg.data());
        EXPECT_TRUE(same_bits(sr, sg)) << len << " " << dist_name(d);
        EXPECT_EQ(cr, cg) << len << " " << dist_name(d);
        std::vector<float> yr(static_cast<size_t>(len)), yg(static_cast<size_t>(len));
        quant_block_decode_f32_ref(cr.data(), len, sr, t, yr.data());
        decode(cr.data(), len, sr, t, yg.data());
        EXPECT_EQ(0, std::memcmp(yr.data(), yg.data(), size_t(len) * 4)) << len << " " << dist_name(d);
      }
    }
  }
}

// OpenMP: 1, 2 and 3 threads give identical codes, scales and decodes (also stochastic).
TEST_P(CodecIsa, ThreadCountsGiveIdenticalResults) {
  const Isa isa = GetParam().isa;
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  for (int32_t block : {64, 2048}) {
    const int64_t n = 50 * int64_t(block) + 33;
    const Tensor x = make_input(Dist::student_t, DType::f32, n, 4242);
    for (bool stochastic : {false, true}) {
      const Quantized q1 = run_encode(x, block, t, isa, 1, stochastic, 5, 11);
      for (int threads : {2, 3}) {
        expect_same(q1, run_encode(x, block, t, isa, threads, stochastic, 5, 11),
                    std::to_string(threads) + " threads, stochastic " + std::to_string(stochastic));
        const Tensor y1 = run_decode(q1, n, block, t, isa, DType::f32, 1);
        const Tensor yt = run_decode(q1, n, block, t, isa, DType::f32, threads);
        EXPECT_EQ(y1.storage, yt.storage) << threads << " threads decode";
      }
    }
  }
}

// The variants' bf16/fp16 conversions are hd.h's, bit for bit. Loads: every 16-bit pattern, read
// back as the scale of a block holding it alone (scale = the element itself). Stores: for every
// 16-bit value, the value, the midpoint to the next one and the floats beside that midpoint (the
// rounding boundaries), plus NaN payloads, written as values[255] (= 1) * scale.
TEST_P(CodecIsa, ConversionsMatchHdBitwise) {
  const Isa isa = GetParam().isa;
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  ASSERT_EQ(t.values[255], 1.0f);
  const int32_t block = 64;
  for (DType dt : {DType::bf16, DType::f16}) {
    const int64_t n = 65536 * int64_t(block);
    Tensor x(dt, n);
    for (uint32_t h = 0; h < 65536; ++h) static_cast<uint16_t*>(x.data())[h * block] = uint16_t(h);
    const Quantized q = run_encode(x, block, t, isa);
    int bad = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
      const float f = x.get(int64_t(h) * block), s = q.scales[h];
      const bool ok = std::isfinite(f) ? same_bits(s, f == 0.0f ? 0.0f : f) : std::isnan(s);
      if (!ok && bad++ < 5) ADD_FAILURE() << dtype_name(dt) << " load of 0x" << std::hex << h << ": scale " << s << " value " << f;
    }

    std::vector<float> probes;
    for (uint32_t h = 0; h < 65536; ++h) {
      const float f = x.get(int64_t(h) * block), next = x.get(int64_t((h + 1) & 0xffff) * block);
      probes.push_back(f);
      if (!std::isfinite(f) || !std::isfinite(next) || (h & 0x7fff) == 0x7fff) continue;
      const float mid = f + (next - f) / 2.0f;  // exact: one more bit than the 16-bit format holds
      probes.push_back(mid);
      probes.push_back(std::nextafter(mid, -INFINITY));
      probes.push_back(std::nextafter(mid, INFINITY));
    }
    for (uint32_t nan : {0x7f800001u, 0xffc00001u, 0x7fffffffu, 0x7fa00000u, 0xff801234u, 0x7f802000u})
      probes.push_back(f32_from_bits(nan));
    for (float big : {65519.0f, 65520.0f, 65504.0f, 3.4e38f, -3.4e38f, 1e-8f, 2.98e-8f, 2.99e-8f, 3e-45f})
      probes.push_back(big);
    Quantized qp;
    qp.scales = probes;
    qp.codes.assign(probes.size() * block, 255);
    const int64_t np = int64_t(qp.codes.size());
    const Tensor y = run_decode(qp, np, block, t, isa, dt);
    Tensor want(dt, int64_t(probes.size()));
    for (size_t b = 0; b < probes.size(); ++b) want.set(int64_t(b), probes[b]);
    bad = 0;
    for (int64_t i = 0; i < np; ++i)
      if (y.bits(i) != want.bits(i / block) && bad++ < 5)
        ADD_FAILURE() << dtype_name(dt) << " store of " << probes[size_t(i / block)] << " (0x" << std::hex
                      << f32_bits(probes[size_t(i / block)]) << "): got 0x" << y.bits(i) << " want 0x" << want.bits(i / block);
  }
}

// Tensors large enough for the decode's streaming-store path (8 MiB of output per call) on 64-byte
// aligned buffers: codes, scales and decodes still equal the reference.
TEST_P(CodecIsa, LargeAlignedTensorsMatchReference) {
  const Isa isa = GetParam().isa;
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  const int64_t n = (int64_t(1) << 23) + 4099;
  const int32_t block = 2048;
  const int64_t nb = (n + block - 1) / block;
  auto aligned = [](size_t bytes) { return std::unique_ptr<void, decltype(&std::free)>(std::aligned_alloc(64, (bytes + 63) / 64 * 64), &std::free); };
  const Tensor x = make_input(Dist::gaussian, DType::f32, n, 2024);
  auto c_ref = aligned(static_cast<size_t>(n)), c_got = aligned(static_cast<size_t>(n)), s_ref = aligned(size_t(nb) * 4), s_got = aligned(size_t(nb) * 4);
  EncodeArgs a;
  a.x = x.data();
  a.n = n;
  a.block = block;
  a.table = &t;
  a.codes = static_cast<uint8_t*>(c_ref.get());
  a.absmax = static_cast<float*>(s_ref.get());
  quant_encode(a, Isa::scalar, 1);
  a.codes = static_cast<uint8_t*>(c_got.get());
  a.absmax = static_cast<float*>(s_got.get());
  quant_encode(a, isa, 1);
  EXPECT_EQ(0, std::memcmp(c_ref.get(), c_got.get(), size_t(n)));
  EXPECT_EQ(0, std::memcmp(s_ref.get(), s_got.get(), size_t(nb) * 4));
  for (DType out : {DType::f32, DType::bf16}) {
    const size_t bytes = size_t(n) * size_t(dtype_size(out));
    auto y_ref = aligned(bytes), y_got = aligned(bytes);
    DecodeArgs d;
    d.codes = static_cast<const uint8_t*>(c_ref.get());
    d.absmax = static_cast<const float*>(s_ref.get());
    d.n = n;
    d.block = block;
    d.table = &t;
    d.dtype = out;
    d.y = y_ref.get();
    quant_decode(d, Isa::scalar, 1);
    d.y = y_got.get();
    quant_decode(d, isa, 1);  // one part: the whole output in one call
    EXPECT_EQ(0, std::memcmp(y_ref.get(), y_got.get(), bytes)) << dtype_name(out);
  }
}

// Stochastic rounding follows its definition exactly (the same draws rng_uniform(seed, index_base + i)
// in every variant), for several seeds and index bases.
TEST_P(CodecIsa, StochasticMatchesDefinition) {
  const Isa isa = GetParam().isa;
  for (MapKind kind : {MapKind::dynamic_signed, MapKind::dynamic_unsigned, MapKind::linear_signed}) {
    const QuantTable& t = table_get(kind);
    for (DType dt : kAllDtypes) {
      for (int32_t block : {64, 256, 2048}) {
        const int64_t n = 3 * int64_t(block) + 21;
        for (Dist d : {Dist::gaussian, Dist::mixed, Dist::zeros}) {
          const Tensor x = make_input(d, dt, n, 31 + uint64_t(block));
          for (uint64_t seed : {uint64_t(1), uint64_t(0x123456789abcdefull)}) {
            for (uint64_t base : {uint64_t(0), uint64_t(1000000000007ull)}) {
              const std::string what = name() + " " + map_kind_name(kind) + " " + dtype_name(dt) +
                                       " " + dist_name(d) + " block " + std::to_string(block);
              expect_same(brute_encode(x, block, t.values, true, seed, base), run_encode(x, block, t, isa, 1, true, seed, base),
                          what);
              if (HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

// The draw u is compared with u < p: an element exactly on a map value (p = 0) keeps its code even
// when u = 0. Found by search: an index whose draw is exactly 0 (one in 2^24), placed on such an element.
TEST_P(CodecIsa, StochasticZeroDrawOnMapValueKeepsCode) {
  const Isa isa = GetParam().isa;
  const uint64_t seed = 3;
  uint64_t zero_index = 1000;
  while (rng_uniform(seed, zero_index) != 0.0f) ++zero_index;
  std::vector<float> triple(256);  // repeated values: the variants' general stochastic search
  for (int i = 0; i < 256; ++i) triple[size_t(i)] = float(-1.0 + 2.0 * i / 255);
  triple[100] = triple[101] = triple[102];
  const QuantTable tables[] = {table_get(MapKind::dynamic_signed), table_get(MapKind::dynamic_unsigned), table_build(triple)};
  const char* names[] = {"dynamic", "dynamic_unsigned", "triple value"};
  for (int k = 0; k < 3; ++k) {
    const QuantTable& t = tables[k];
    const char* name = names[k];
    for (int pos : {5, 100}) {  // in a full 16-lane vector, and in the block's tail lanes
      Tensor x(DType::f32, 107);
      x.set(0, 1.0f);  // scale 1: n = x
      for (int i = 1; i < 107; ++i) x.set(i, t.values[(i * 37) % 256]);
      const Quantized q = run_encode(x, 256, t, isa, 1, true, seed, zero_index - uint64_t(pos));
      EXPECT_EQ(q.scales[0], 1.0f);
      EXPECT_EQ(int(q.codes[size_t(pos)]), (pos * 37) % 256) << name << " position " << pos;
      expect_same(brute_encode(x, 256, t.values, true, seed, zero_index - uint64_t(pos)), q, name);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CodecIsa, ::testing::ValuesIn(kAllVariants),
                         [](const ::testing::TestParamInfo<Variant>& info) { return variant_name(info.param); });

// ---- stochastic rounding statistics and splitting (public API, active variant) ----

// A tensor quantized in two pieces (index_base = the second piece's offset) rounds as the whole.
TEST(CodecStochastic, SplitTensorRoundsAsWhole) {
  const int32_t block = 256;
  const int64_t n = 20 * block + 50, cut = 7 * block;
  const Tensor x = make_input(Dist::gaussian, DType::f32, n, 8);
  QuantizeOptions opt;
  opt.stochastic = true;
  opt.seed = 77;
  const Blockwise whole = quantize_blockwise(x.data(), DType::f32, n, block, MapKind::dynamic_signed, opt);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  std::vector<float> scales(size_t(quant_num_blocks(n, block)));
  quantize_blockwise(x.data(), DType::f32, cut, block, MapKind::dynamic_signed, codes.data(), scales.data(), opt);
  opt.index_base = uint64_t(cut);
  quantize_blockwise(static_cast<const float*>(x.data()) + cut, DType::f32, n - cut, block, MapKind::dynamic_signed,
                     codes.data() + cut, scales.data() + cut / block, opt);
  EXPECT_EQ(whole.codes, codes);
  EXPECT_EQ(0, std::memcmp(whole.absmax.data(), scales.data(), scales.size() * 4));
  // A different seed gives a different rounding somewhere.
  opt.index_base = 0;
  opt.seed = 78;
  EXPECT_NE(whole.codes, quantize_blockwise(x.data(), DType::f32, n, block, MapKind::dynamic_signed, opt).codes);
}

// E[decode] = x: the mean decode over K seeds is within 5 standard errors of x, where one draw is
// a (or b, the map values around x) with variance (b - x)(x - a). The remaining bias allowed,
// (b - a) * 2^-20, covers the 24-bit uniform and the float rounding of the probability.
TEST(CodecStochastic, Unbiased) {
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  const int32_t block = 256;
  std::mt19937_64 rng(3);
  std::vector<float> x(block);
  x[0] = 1.0f;  // scale = 1 exactly, so n = x
  for (int i = 1; i < block; ++i) {
    const int c = int(rng() % 255);
    const double f = (i % 8 == 0) ? 0.0 : double(rng() % 1000) / 1000.0;  // some exactly on a map value
    x[size_t(i)] = float(t.values[c] + f * (double(t.values[c + 1]) - t.values[c]));
  }
  const int K = 4000;
  std::vector<double> sum(block, 0.0);
  QuantizeOptions opt;
  opt.stochastic = true;
  for (int k = 0; k < K; ++k) {
    opt.seed = uint64_t(k) * 7919 + 1;
    const Blockwise q = quantize_blockwise(x.data(), DType::f32, block, block, MapKind::dynamic_signed, opt);
    ASSERT_EQ(q.absmax[0], 1.0f);
    const std::vector<float> y = dequantize_blockwise(q);
    for (int i = 0; i < block; ++i) sum[size_t(i)] += y[size_t(i)];
  }
  for (int i = 0; i < block; ++i) {
    const float xi = x[size_t(i)];
    int lo = 0;
    for (int c = 0; c < 256; ++c)
      if (t.values[c] <= xi) lo = c;
    const double a = t.values[lo], b = lo < 255 ? t.values[lo + 1] : a;
    const double var = (b - xi) * (xi - a);
    const double bound = 5.0 * std::sqrt(var / K) + (b - a) * std::ldexp(1.0, -20);
    EXPECT_NEAR(sum[size_t(i)] / K, double(xi), bound) << "element " << i << " x=" << xi;
  }
}

// ---- bad arguments through the public API ----

void expect_arg_error(const std::function<void()>& f, const char* name) {
  try {
    f();
    ADD_FAILURE() << "no error for '" << name << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
  }
}

TEST(CodecApi, BadArgumentsNameTheArgument) {
  const int64_t n = 1000;
  std::vector<float> x(n + 1, 0.5f), y(n + 1), scales(64);
  std::vector<uint8_t> codes(n);
  const auto map = MapKind::dynamic_signed;
  for (int32_t block : {100, 8192, 32, 0, -256})
    expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, n, block, map, codes.data(), scales.data()); }, "block");
  expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, -1, 256, map, codes.data(), scales.data()); }, "n");
  expect_arg_error([&] { quantize_blockwise(nullptr, DType::f32, n, 256, map, codes.data(), scales.data()); }, "x");
  expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, n, 256, map, nullptr, scales.data()); }, "codes");
  expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, n, 256, map, codes.data(), nullptr); }, "absmax");
  expect_arg_error([&] { quantize_blockwise(x.data(), DType(9), n, 256, map, codes.data(), scales.data()); }, "dtype");
  const char* xb = reinterpret_cast<const char*>(x.data());
  float* misaligned_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(scales.data()) + 1);
  expect_arg_error([&] { quantize_blockwise(xb + 2, DType::f32, n, 256, map, codes.data(), scales.data()); }, "x");
  expect_arg_error([&] { quantize_blockwise(xb + 1, DType::bf16, n, 256, map, codes.data(), scales.data()); }, "x");
  expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, n, 256, map, codes.data(), misaligned_scales); },
                   "absmax");
  QuantizeOptions bad_threads;
  bad_threads.threads = -1;
  expect_arg_error([&] { quantize_blockwise(x.data(), DType::f32, n, 256, map, codes.data(), scales.data(), bad_threads); },
                   "threads");

  quantize_blockwise(x.data(), DType::f32, n, 256, map, codes.data(), scales.data());
  char* yb = reinterpret_cast<char*>(y.data());
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 8192, map, y.data(), DType::f32); }, "block");
  expect_arg_error([&] { dequantize_blockwise(nullptr, scales.data(), n, 256, map, y.data(), DType::f32); }, "codes");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), nullptr, n, 256, map, y.data(), DType::f32); }, "absmax");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 256, map, nullptr, DType::f32); }, "y");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 256, map, yb + 1, DType::bf16); }, "y");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 256, map, yb + 2, DType::f32); }, "y");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 256, map, y.data(), DType::bf16, true); },
                   "accumulate");
  expect_arg_error([&] { dequantize_blockwise(codes.data(), scales.data(), n, 256, map, y.data(), DType::f16, true); },
                   "accumulate");
  expect_arg_error([&] { quant_num_blocks(10, 100); }, "block");

  // Empty tensors need no buffers.
  EXPECT_NO_THROW(quantize_blockwise(nullptr, DType::f32, 0, 256, map, nullptr, nullptr));
  EXPECT_NO_THROW(dequantize_blockwise(nullptr, nullptr, 0, 256, map, nullptr, DType::f32, true));
}

TEST(CodecApi, RoundTripThroughPublicApi) {
  const int64_t n = 5000;
  const Tensor x = make_input(Dist::gaussian, DType::bf16, n, 12);
  const Blockwise q = quantize_blockwise(x.data(), DType::bf16, n, 512, MapKind::dynamic_signed);
  EXPECT_EQ(q.bytes(), n + 4 * 10);
  EXPECT_EQ(quant_num_blocks(n, 512), 10);
  const Quantized want = brute_encode(x, 512, table_get(MapKind::dynamic_signed).values);
  EXPECT_EQ(q.codes, want.codes);
  Tensor y(DType::bf16, n);
  dequantize_blockwise(q, y.data(), DType::bf16);
  const std::vector<float> yf = dequantize_blockwise(q);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.bits(i), f32_to_bf16(yf[size_t(i)])) << i;
}

// ---- rows: quantize_blockwise_rows, dequantize_blockwise_rows ----

// Equal floats, any NaN equal to any NaN (a device's NaN results need not carry the CPU's payload).
bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || f32_bits(a) == f32_bits(b); }

// One rows call gives what one call per row gives: codes, scales, each row's decode, and the rows' sum,
// added in row order after y when accumulating; rows of whole blocks and rows that end mid-block.
TEST(CodecRows, MatchOneCallPerRow) {
  const auto map = MapKind::dynamic_signed;
  int trial = 0;
  for (DType dt : kAllDtypes) {
    for (int32_t block : {64, 256, 2048}) {
      for (int64_t rows : {1, 2, 3, 7}) {
        for (int64_t row : {int64_t(1), int64_t(63), int64_t(block), int64_t(2 * block), int64_t(3 * block + 37)}) {
          for (bool stochastic : {false, true}) {
            const Dist dist = kAllDists[size_t(trial++) % std::size(kAllDists)];
            SCOPED_TRACE(std::string(dtype_name(dt)) + " block " + std::to_string(block) + " rows " +
                         std::to_string(rows) + " row " + std::to_string(row) + " " + dist_name(dist) +
                         (stochastic ? " stochastic" : ""));
            const int64_t n = rows * row, per = quant_num_blocks(row, block), esize = dtype_size(dt);
            const Tensor x = make_input(dist, dt, n, uint64_t(trial));
            const char* xb = static_cast<const char*>(x.data());
            QuantizeOptions opt;
            opt.stochastic = stochastic;
            opt.seed = 7;
            opt.index_base = 100;
            std::vector<uint8_t> want_codes(static_cast<size_t>(n)), codes(static_cast<size_t>(n));
            std::vector<float> want_scales(size_t(rows * per)), scales(size_t(rows * per));
            for (int64_t r = 0; r < rows; ++r) {
              QuantizeOptions o = opt;
              o.index_base = opt.index_base + uint64_t(r * row);
              quantize_blockwise(xb + r * row * esize, dt, row, block, map, want_codes.data() + r * row,
                                 want_scales.data() + r * per, o);
            }
            quantize_blockwise_rows(x.data(), dt, rows, row, block, map, codes.data(), scales.data(), opt);
            ASSERT_EQ(codes, want_codes);
            ASSERT_EQ(0, std::memcmp(scales.data(), want_scales.data(), scales.size() * 4));
            QuantizeOptions threaded = opt;  // each row split over threads (parts of whole blocks)
            threaded.threads = 3;
            std::vector<uint8_t> codes3(static_cast<size_t>(n));
            std::vector<float> scales3(scales.size());
            quantize_blockwise_rows(x.data(), dt, rows, row, block, map, codes3.data(), scales3.data(), threaded);
            ASSERT_EQ(codes3, want_codes);
            ASSERT_EQ(0, std::memcmp(scales3.data(), want_scales.data(), scales.size() * 4));

            Tensor want_y(dt, n), y(dt, n);
            for (int64_t r = 0; r < rows; ++r) {
              dequantize_blockwise(codes.data() + r * row, scales.data() + r * per, row, block, map,
                                   static_cast<char*>(want_y.data()) + r * row * esize, dt);
            }
            dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, y.data(), dt);
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.bits(i), want_y.bits(i)) << "element " << i;

            std::vector<float> each(static_cast<size_t>(n)), base(static_cast<size_t>(row));
            dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, each.data(), DType::f32);
            for (int64_t j = 0; j < row; ++j) base[size_t(j)] = float(j % 17) * 0.25f - 2.0f;
            for (bool accumulate : {false, true}) {
              std::vector<float> got = base, got3 = base;
              dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, got.data(), DType::f32,
                                        true, accumulate);
              dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, got3.data(), DType::f32,
                                        true, accumulate, 3);
              ASSERT_EQ(0, std::memcmp(got3.data(), got.data(), got.size() * 4)) << "3 threads";
              for (int64_t j = 0; j < row; ++j) {
                float want = accumulate ? base[size_t(j)] + each[size_t(j)] : each[size_t(j)];
                for (int64_t r = 1; r < rows; ++r) want = want + each[size_t(r * row + j)];
                ASSERT_TRUE(same_float(got[size_t(j)], want))
                    << "sum, element " << j << (accumulate ? " accumulating: " : ": ") << got[size_t(j)] << " vs "
                    << want;
              }
            }
          }
        }
      }
    }
  }
}

TEST(CodecRows, BadArgumentsNameTheArgument) {
  std::vector<float> x(1024, 0.5f), y(1024), scales(64);
  std::vector<uint8_t> codes(1024);
  const auto map = MapKind::dynamic_signed;
  const auto q = [&](int64_t rows, int64_t row, float* absmax) {
    quantize_blockwise_rows(x.data(), DType::f32, rows, row, 256, map, codes.data(), absmax);
  };
  expect_arg_error([&] { q(-1, 8, scales.data()); }, "rows");
  expect_arg_error([&] { q(2, -8, scales.data()); }, "row");
  expect_arg_error([&] { q(4, INT64_MAX / 2, scales.data()); }, "row");
  expect_arg_error([&] { q(2, 8, nullptr); }, "absmax");
  expect_arg_error([&] {
    quantize_blockwise_rows(x.data(), DType::f32, 4, INT64_MAX / 2, -256, map, codes.data(), scales.data());
  }, "block");
  const auto d = [&](int64_t rows, int64_t row, DType dt, bool sum, bool accumulate) {
    dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, 256, map, y.data(), dt, sum, accumulate);
  };
  expect_arg_error([&] { d(-2, 8, DType::f32, false, false); }, "rows");
  expect_arg_error([&] { d(2, 8, DType::bf16, true, false); }, "dtype");
  expect_arg_error([&] { d(2, 8, DType::f16, false, true); }, "accumulate");
  expect_arg_error([&] { d(0, 8, DType::f32, true, false); }, "rows");
  EXPECT_NO_THROW(q(0, 8, nullptr));
  EXPECT_NO_THROW(d(5, 0, DType::bf16, false, false));
}

// ---- ZERO8_ISA, ZERO8_AVX512_VBMI ----

// Run this test binary in child mode with the given environment assignments ("NAME='value' ...").
std::pair<int, std::string> run_child(const std::string& env) {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len <= 0) return {-1, "readlink failed"};
  exe[len] = '\0';
  const std::string cmd = "ZERO8_TEST_ISA_CHILD=1 " + env + " '" + exe + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) out += buf;
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// The child with ZERO8_ISA set: returns (exit code, output).
std::pair<int, std::string> run_isa_child(const std::string& value) { return run_child("ZERO8_ISA='" + value + "'"); }

TEST(IsaEnvironment, ForcesTheVariant) {
  for (Isa isa : kAllIsas) {
    if (!isa_supported(isa)) continue;
    const auto [rc, out] = run_isa_child(isa_name(isa));
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out, std::string(isa_name(isa)) + "\n");
  }
}

// ZERO8_AVX512_VBMI=0|1 sets the avx512 variant's VBMI code at start; unset, it is on where supported.
TEST(IsaEnvironment, Avx512VbmiSetting) {
  auto child = [](const char* value) {
    return run_child(std::string("ZERO8_TEST_VBMI_CHILD=1 ZERO8_AVX512_VBMI='") + value + "'");
  };
  const bool supported = isa_avx512_vbmi_supported();
  {
    const auto [rc, out] = child("");
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out, supported ? "1\n" : "0\n");
  }
  {
    const auto [rc, out] = child("0");
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out, "0\n");
  }
  {
    const auto [rc, out] = child("1");
    if (supported) {
      EXPECT_EQ(rc, 0) << out;
      EXPECT_EQ(out, "1\n");
    } else {
      EXPECT_EQ(rc, 3) << out;
      EXPECT_NE(out.find("ZERO8_AVX512_VBMI"), std::string::npos) << out;
    }
  }
  {
    const auto [rc, out] = child("yes");
    EXPECT_EQ(rc, 3) << out;
    EXPECT_NE(out.find("ZERO8_AVX512_VBMI"), std::string::npos) << out;
  }
  // In process: the setter switches the code, and refuses VBMI where the CPU lacks it.
  const bool saved = isa_avx512_vbmi();
  isa_set_avx512_vbmi(false);
  EXPECT_FALSE(isa_avx512_vbmi());
  if (supported) {
    isa_set_avx512_vbmi(true);
    EXPECT_TRUE(isa_avx512_vbmi());
  } else {
    EXPECT_THROW(isa_set_avx512_vbmi(true), Error);
  }
  isa_set_avx512_vbmi(saved);
}

TEST(IsaEnvironment, InvalidValueNamesTheVariable) {
  const auto [rc, out] = run_isa_child("sse9");
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("ZERO8_ISA"), std::string::npos) << out;
}

}  // namespace
