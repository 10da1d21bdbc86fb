// Construction of the quantization maps and of their exact search tables.
#include "zero8/kernels/quant_map.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "zero8/error.h"

namespace zero8::quant {
namespace {

// torch's CPU linspace for float32 as built for AVX2 (the arithmetic bitsandbytes' maps were made
// with): the scalar path and each vector's base use a fused multiply-add, the lanes of a vector add
// k*step to the base; vectors come in pairs of 8 lanes and the tail is scalar.
std::vector<float> linspace_f32(float start, float end, int64_t steps) {
  std::vector<float> out(steps);
  const float step = (end - start) / float(steps - 1);
  const int64_t halfway = steps / 2;
  if (steps == 1) {
    out[0] = start;
    return out;
  }
  auto at = [&](int64_t idx) {
    return idx < halfway ? std::fma(step, float(idx), start) : std::fma(-step, float(steps - idx - 1), end);
  };
  int64_t i = 0;
  for (; i + 16 <= steps; i += 16) {
    for (int64_t v = i; v < i + 16; v += 8) {
      const float base = at(v);
      out[v] = base;
      for (int k = 1; k < 8; ++k) out[v + k] = base + float(k) * step;
    }
  }
  for (; i < steps; ++i) out[i] = at(i);
  return out;
}

std::vector<float> linear_map(bool is_signed) {
  std::vector<float> v(256);
  for (int i = 0; i < 256; ++i) v[i] = is_signed ? float(-1.0 + 2.0 * i / 255.0) : float(i / 255.0);
  return v;
}

// The SIMD accelerator (see QuantTable::lut). With monotone thresholds the code is a monotone
// function of n, so the codes at a bucket's two ends bound every code inside it; the widest bucket
// sets the number of refinement steps. Maps with three equal values in a row can break monotony:
// those keep the plain binary search.
void table_build_lut(QuantTable& t) {
  bool monotone = true;
  for (int i = 0; i + 1 < 256; ++i) monotone = monotone && t.thresholds[i] <= t.thresholds[i + 1];
  const float inf = std::numeric_limits<float>::infinity();
  uint32_t steps = 0;
  bool packed = true;
  for (uint32_t j = 0; j < kQuantLutHalf; ++j) {
    const uint32_t q = kQuantLutLo + j;
    const bool clamped = j == 0 || j + 1 == kQuantLutHalf;  // spans more than one upper-16-bit pattern
    const float lo = j == 0 ? 0.0f : f32_from_bits(q << kQuantLutShift);
    const float hi = j + 1 == kQuantLutHalf ? inf : f32_from_bits(((q + 1) << kQuantLutShift) - 1);
    for (const bool neg : {false, true}) {
      const uint32_t c_lo = quant_code_nearest(neg ? -hi : lo, t), c_hi = quant_code_nearest(neg ? -lo : hi, t);
      const uint32_t width = c_hi - c_lo;  // wraps to huge if not monotone
      steps = std::max(steps, width);
      // The packed form stores the one threshold inside the bucket by its lower 16 bits.
      uint32_t low = neg ? 0u : 0xffffu;
      if (width == 1 && monotone && !clamped) {
        const uint32_t tb = f32_bits(t.thresholds[c_lo]);
        if ((tb >> kQuantLutShift) != (q | (neg ? 0x8000u : 0u))) packed = false;
        low = tb & 0xffffu;
      } else if (width != 0) {
        packed = false;
      }
      t.lut[j + (neg ? kQuantLutHalf : 0)] = (c_lo << 16) | low;
    }
  }
  t.lut_steps = monotone && steps <= 7 ? uint8_t(steps) : kQuantLutNoSteps;
  t.lut_packed = t.lut_steps != kQuantLutNoSteps && packed;
}

// The byte planes of values and thresholds, and the cells of the VBMI encoder (see QuantTable::cell_code).
// A cell is an interval of n, so with monotone thresholds the codes at its two ends bound every code in
// it; each binade takes the fewest cells that keep that spread <= 1. The top binade holds only |n| = 1.
void table_build_cells(QuantTable& t) {
  for (int c = 0; c < 256; ++c) {
    const uint32_t v = f32_bits(t.values[c]), th = f32_bits(t.thresholds[c]);
    for (int k = 0; k < 4; ++k) {
      t.value_bytes[k][c] = uint8_t(v >> (8 * k));
      t.threshold_bytes[k][c] = uint8_t(th >> (8 * k));
    }
  }
  for (uint32_t s = 0; s < kQuantCellSlots; ++s) {  // unused slots: any valid cell
    t.cell_base[s] = 0;
    t.cell_shift[s] = 7;
  }
  t.cells_ok = 0;
  if (t.lut_steps == kQuantLutNoSteps) return;  // thresholds not monotone
  const uint32_t e_lo = kQuantLutLo >> 7, e_hi = kQuantLutHi >> 7;  // binades 103..127
  uint32_t next = 0;
  for (const bool neg : {false, true}) {
    for (uint32_t e = e_lo; e <= e_hi; ++e) {
      const uint32_t buckets = e == e_hi ? 1 : 128;
      // Magnitudes [lo, hi] of buckets [m0, m1] of this binade (the first bucket reaches down to 0).
      auto codes_of = [&](uint32_t m0, uint32_t m1, uint32_t* c_lo, uint32_t* c_hi) {
        const float lo = (e == e_lo && m0 == 0) ? 0.0f : f32_from_bits(((e << 7) | m0) << kQuantLutShift);
        const float hi = e == e_hi ? 1.0f : f32_from_bits(((((e << 7) | m1) + 1) << kQuantLutShift) - 1);
        *c_lo = quant_code_nearest(neg ? -hi : lo, t);
        *c_hi = quant_code_nearest(neg ? -lo : hi, t);
      };
      uint32_t bits = 0;  // log2 of the number of cells
      for (;; ++bits) {
        const uint32_t per = buckets >> bits;  // buckets per cell
        bool fits = true;
        for (uint32_t m0 = 0; fits && m0 < buckets; m0 += per) {
          uint32_t c_lo, c_hi;
          codes_of(m0, m0 + per - 1, &c_lo, &c_hi);
          fits = c_hi - c_lo <= 1;
        }
        if (fits) break;
        if (per == 1) return;  // two thresholds in one bucket: no cells for this map
      }
      const uint32_t cells = 1u << bits;
      if (next + cells > kQuantCellsMax) return;
      const uint32_t slot = neg ? e - 103 : e - 64;
      t.cell_base[slot] = uint16_t(next);
      t.cell_shift[slot] = uint16_t(7 - bits);
      for (uint32_t k = 0; k < cells; ++k) {
        uint32_t c_lo, c_hi;
        codes_of(k << (7 - bits), ((k + 1) << (7 - bits)) - 1, &c_lo, &c_hi);
        t.cell_code[next + k] = uint8_t(c_lo);
      }
      next += cells;
    }
  }
  t.cells_ok = 1;
}

}  // namespace

// "8-bit Optimizers via Block-wise Quantization" (Dettmers et al. 2022), dynamic tree quantization as
// bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits) builds it: per exponent i the
// midpoints of linspace(0.1, 1, k + 1) scaled by 10^(i - (max_exponent_bits - 1)), the "additional
// items" of a zero exponent (with bitsandbytes' reuse of the last i), 0 and 1, zero-padded to 256 and
// sorted; float32 arithmetic as torch does it (the scale rounded to float). The defaults (7, 8) give
// 7 decades 1e-6..1 and the two standard maps.
std::vector<float> map_dynamic_values(bool is_signed, int max_exponent_bits, int total_bits) {
  ZERO8_CHECK_ARG(total_bits >= 2 && total_bits <= 8, "total_bits", "must be in 2..8, got " << total_bits);
  ZERO8_CHECK_ARG(max_exponent_bits >= 1 && max_exponent_bits <= total_bits - 1, "max_exponent_bits",
                  "must be in 1..total_bits-1 = " << total_bits - 1 << ", got " << max_exponent_bits);
  const int non_sign_bits = total_bits - 1;  // bitsandbytes: total_bits - (1 if signed else 1)
  const int64_t additional = (int64_t(1) << (non_sign_bits - max_exponent_bits)) - 1;
  std::vector<float> data;
  auto add_means = [&](int64_t items, int i) {
    const std::vector<float> b = linspace_f32(0.1f, 1.0f, items);
    const float scale = float(std::pow(10.0, double(-(max_exponent_bits - 1) + i)));
    for (int64_t k = 0; k + 1 < items; ++k) {
      const float mean = (b[size_t(k)] + b[size_t(k + 1)]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  };
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int e = is_signed ? i + non_sign_bits - max_exponent_bits : i + non_sign_bits - max_exponent_bits + 1;
    add_means((int64_t(1) << e) + 1, i);
  }
  if (additional > 0) add_means(additional + 1, max_exponent_bits - 1);
  data.push_back(0.0f);
  data.push_back(1.0f);
  ZERO8_CHECK_ARG(data.size() == (size_t(1) << total_bits), "total_bits",
                  "signed=" << is_signed << ", max_exponent_bits=" << max_exponent_bits << ", total_bits="
                            << total_bits << " gives " << data.size() << " values instead of 2^total_bits = "
                            << (1 << total_bits) << " (bitsandbytes rejects this combination too)");
  data.resize(256, 0.0f);
  std::sort(data.begin(), data.end());
  return data;
}

const char* map_kind_name(MapKind k) {
  switch (k) {
    case MapKind::dynamic_signed: return "dynamic";
    case MapKind::dynamic_unsigned: return "dynamic_unsigned";
    case MapKind::linear_signed: return "linear";
    case MapKind::linear_unsigned: return "linear_unsigned";
  }
  return "?";
}

std::vector<float> map_values(MapKind kind) {
  switch (kind) {
    case MapKind::dynamic_signed: return map_dynamic_values(true, 7, 8);
    case MapKind::dynamic_unsigned: return map_dynamic_values(false, 7, 8);
    case MapKind::linear_signed: return linear_map(true);
    case MapKind::linear_unsigned: return linear_map(false);
  }
  ZERO8_THROW(invalid_argument, "invalid argument 'kind': unknown map kind " << int(kind));
}

QuantTable table_build(const std::vector<float>& values) {
  ZERO8_CHECK_ARG(values.size() == 256, "values", "a map has 256 values, got " << values.size());
  QuantTable t{};
  for (int i = 0; i < 256; ++i) {
    ZERO8_CHECK_ARG(std::isfinite(values[i]) && std::fabs(values[i]) <= 1.0f, "values",
                    "value " << i << " = " << values[i] << " is not a finite value within [-1, 1]");
    ZERO8_CHECK_ARG(i == 0 || values[i - 1] <= values[i], "values", "not sorted at index " << i);
    t.values[i] = values[i];
  }
  // Threshold i separates code i from i+1: n goes above i iff n > M (the exact midpoint, in double),
  // or n == M and i+1 is even. Expressed as one float compare n > T.
  for (int i = 0; i < 255; ++i) {
    const double m = (double(values[i]) + double(values[i + 1])) / 2.0;
    float f = float(m);
    if (double(f) == m) {
      if ((i + 1) % 2 == 0) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
    } else if (double(f) > m) {
      f = std::nextafter(f, -std::numeric_limits<float>::infinity());
    }
    t.thresholds[i] = f;
  }
  t.thresholds[255] = std::numeric_limits<float>::infinity();
  t.zero_code = uint8_t(quant_code_nearest(0.0f, t));
  int nonneg = 255, nonpos = 0;
  for (int i = 255; i >= 0; --i)
    if (values[i] >= 0.0f) nonneg = i;
  for (int i = 0; i < 256; ++i)
    if (values[i] <= 0.0f) nonpos = i;
  t.nonneg_first = uint8_t(nonneg);
  t.nonpos_last = uint8_t(nonpos);
  t.has_neg_one = values[0] == -1.0f;
  t.is_unsigned = values[0] >= 0.0f;
  t.fma_quotient_ok = 1;
  for (int i = 0; i < 255; ++i)
    if (std::fabs(t.thresholds[i]) < 0x1p-32f) t.fma_quotient_ok = 0;
  table_build_lut(t);
  table_build_cells(t);
  return t;
}

const QuantTable& table_get(MapKind kind) {
  static QuantTable tables[4];  // alignas(64) from the type
  static std::once_flag once;
  std::call_once(once, [] {
    for (int k = 0; k < 4; ++k) tables[k] = table_build(map_values(MapKind(k)));
  });
  const int k = int(kind);
  ZERO8_CHECK_ARG(k >= 0 && k < 4, "kind", "unknown map kind " << k);
  return tables[k];
}

}  // namespace zero8::quant
