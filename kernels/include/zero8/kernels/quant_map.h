// The 8-bit quantization maps (dynamic signed/unsigned, linear) and the element math that maps a
// normalized value to a code: nearest (ties to the even code, never flipping a nonzero value's sign)
// or stochastic. Host/device code: the CPU variants and the CUDA kernels call these same functions.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zero8/kernels/hd.h"

namespace zero8::quant {

// Buckets of the CPU search accelerator (QuantTable::lut): the sign, the binade and 7 mantissa bits of
// n, over the binades 2^-24..2^-1 (smaller magnitudes share the first bucket of a sign, magnitudes
// >= 1 the last). Fine enough that every standard map has at most one threshold inside a bucket.
constexpr uint32_t kQuantLutShift = 16;                            // 23 - 7 mantissa bits
constexpr uint32_t kQuantLutLo = 103u << 7;                        // |n| < 2^-24 * (1 + 2^-7)
constexpr uint32_t kQuantLutHi = 127u << 7;                        // |n| >= 1
constexpr uint32_t kQuantLutHalf = kQuantLutHi - kQuantLutLo + 1;  // 3073 buckets per sign
constexpr uint32_t kQuantLutBuckets = 2 * kQuantLutHalf;
constexpr uint8_t kQuantLutNoSteps = 255;

// Cells of the AVX-512 VBMI encoder (QuantTable::cell_code): the accelerator's range of |n| <= 1 cut per
// (sign, binade) into 2^k equal cells of its 16-bit buckets, k as small as lets no cell hold two
// thresholds. The level-1 slot of a binade e (exponent field 103..127) is e - 64 for n >= 0 and e - 103
// for n < 0 (one 6-bit index, so that one 64-entry word permute reads it).
constexpr uint32_t kQuantCellsMax = 512;  // four 128-entry byte permutes
constexpr uint32_t kQuantCellSlots = 64;

// A map of 256 sorted values plus the thresholds that make nearest-code search exact in float32.
// Layout is part of the kernel ABI (passed by pointer to CPU and CUDA kernels): keep it POD. Aligned to
// a cache line so that the byte tables at its end are whole 64-byte vectors.
struct alignas(64) QuantTable {
  float values[256];      // sorted ascending; code c decodes to values[c] * absmax
  float thresholds[256];  // code(n) = #{i : n > thresholds[i]}; thresholds[255] = +inf
  uint8_t zero_code;      // code used for zero blocks and non-finite blocks (nearest to 0, ties even)
  uint8_t nonneg_first;   // smallest code with values[c] >= 0 (for the no-sign-flip rule)
  uint8_t nonpos_last;    // largest code with values[c] <= 0
  uint8_t has_neg_one;    // values[0] == -1: the map is symmetric enough for a positive absmax
  uint8_t is_unsigned;    // values[0] >= 0
  uint8_t fma_quotient_ok;  // no threshold in (-2^-32, 2^-32): see quant_quotient_fma
  uint8_t pad_[2];
  // Accelerator of quant_code_nearest for the CPU SIMD variants, same result (quant_code_nearest_lut):
  // lut[quant_lut_index(n)] >> 16 is the code at the low end of n's bucket; lut_steps compare-and-
  // increment steps (c += n > thresholds[c]) reach the exact code anywhere in the bucket. When
  // lut_packed, the one threshold inside a bucket is n's upper 16 bits joined with the entry's lower
  // 16 bits (0xffff / 0 for none in a positive / negative bucket): one table read per element.
  uint8_t lut_steps;      // 0..7; kQuantLutNoSteps: thresholds not monotone, use the binary search
  uint8_t lut_packed;
  uint8_t cells_ok;       // the cells below are valid: monotone thresholds, at most kQuantCellsMax cells
  uint8_t lut_pad_[5];
  uint32_t lut[kQuantLutBuckets];
  uint8_t cells_pad_[40];  // to a 64-byte boundary
  // The AVX-512 VBMI encoder (quant_code_nearest_cells): the cells of level-1 slot s are
  // cell_base[s] + (m7 >> cell_shift[s]) for the 7 mantissa bits m7 of n's bucket; cell_code is the
  // code at the cell's low end (its most negative n), and since a cell holds at most one threshold,
  // code = c + (n > thresholds[c]).
  uint16_t cell_base[kQuantCellSlots];
  uint16_t cell_shift[kQuantCellSlots];
  uint8_t cell_code[kQuantCellsMax];
  // Byte k of values[c] and of thresholds[c] at [k][c] (little-endian planes): VBMI byte permutes
  // read a 256-entry float table as four 256-byte tables.
  uint8_t value_bytes[4][256];
  uint8_t threshold_bytes[4][256];
};
static_assert(sizeof(QuantTable) == 256 * 4 * 2 + 8 + 8 + kQuantLutBuckets * 4 + 40 + kQuantCellSlots * 4 +
                                        kQuantCellsMax + 2 * 4 * 256,
              "QuantTable layout is part of the kernel ABI");
static_assert(offsetof(QuantTable, cell_base) % 64 == 0 && offsetof(QuantTable, value_bytes) % 64 == 0 &&
                  offsetof(QuantTable, threshold_bytes) % 64 == 0,
              "QuantTable byte tables start on cache lines");

ZERO8_HD uint32_t quant_lut_index(float n) {
  const uint32_t u = f32_bits(n);
  uint32_t q = (u & 0x7fffffffu) >> kQuantLutShift;
  q = q < kQuantLutLo ? kQuantLutLo : (q > kQuantLutHi ? kQuantLutHi : q);
  return q - kQuantLutLo + (u >> 31) * kQuantLutHalf;
}

enum class MapKind : uint8_t { dynamic_signed = 0, dynamic_unsigned = 1, linear_signed = 2, linear_unsigned = 3 };
const char* map_kind_name(MapKind k);

// The 256 values of a map. Dynamic maps follow bitsandbytes' create_dynamic_map in the float32
// arithmetic of torch's CPU linspace and are bit-identical to the reference table
// (tests/data/dynamic_maps.txt, made with torch 1.13). Current bitsandbytes builds (0.50, torch 2.x)
// differ from it by at most 2 ulp in about 40 entries per map; codes and scales stay interchangeable
// (zero8.optim's loader accepts such maps without re-encoding).
std::vector<float> map_values(MapKind kind);
// bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits) for any valid arguments,
// zero-padded to 256 values; (7, 8) are the standard dynamic maps above.
std::vector<float> map_dynamic_values(bool is_signed, int max_exponent_bits = 7, int total_bits = 8);
// Build the search table for any sorted 256-value map (throws zero8::Error if not sorted/finite).
QuantTable table_build(const std::vector<float>& values);
// Cached table of a standard map (built once, thread-safe).
const QuantTable& table_get(MapKind kind);
// Its copy on the current CUDA device, for the *_cuda kernels (uploaded once per device, never freed;
// thread-safe). Throws Error(unsupported) without CUDA or a usable device (kernels/src/device.cpp).
const QuantTable* table_get_device(MapKind kind);

// ---- element math (host and device) ----

// Scale of a block given its min and max element: the absmax, negated when the extreme element is
// negative and the map cannot represent -1, so that the block's extreme element is reproduced exactly
// (the dynamic signed map ends at -0.99297 but +1.0). Decoding is values[code] * scale either way.
// Returns 0 for an all-zero block and NaN if the block holds a non-finite value (callers pass NaN
// as max/min then).
ZERO8_HD float quant_block_scale(float vmin, float vmax, const QuantTable& t) {
  if (!(vmin == vmin) || !(vmax == vmax)) return vmin + vmax;  // NaN
  float neg = -vmin;
  float s = vmax >= neg ? vmax : (t.has_neg_one ? neg : vmin);
  if (s - s != 0.0f) return f32_from_bits(0x7fc00000u);  // Inf
  return s;
}

// x / scale without a division (the SIMD encoders' form where quant_quotient_fma_ok): q = x * r with
// r = 1 / scale, then one correction q + (x - q * scale) * r, both steps fused multiply-adds. With r
// correctly rounded and q within one ulp, the correction gives the correctly rounded quotient whenever
// the remainder x - q * scale is exact (Markstein, IBM J. Res. Dev. 34(1), 1990; D. Russinoff,
// "Formal Verification in Industrial Design", ch. 13, lemma markstein). For |scale| in [2^-64, 2^126]
// that holds for every |x / scale| >= 2^-33 (exponents of scale and quotient sum to at least -103,
// Boldo's condition for an exact FMA remainder). Smaller quotients may differ from x / scale in the
// last bits but stay below 2^-32 in magnitude, where a table with fma_quotient_ok has no threshold:
// the code is the same. tests/cpp/test_quant_map.cpp checks the quotient over every mantissa.
ZERO8_HD float quant_quotient_fma(float x, float scale, float r) {
  const float q = x * r;
  return fmaf(fmaf(-q, scale, x), r, q);
}
ZERO8_HD bool quant_quotient_fma_ok(float scale, const QuantTable& t) {
  const float a = fabsf(scale);
  return t.fma_quotient_ok && a >= 0x1p-64f && a <= 0x1p126f;
}

// Nearest code of a normalized value n (= x / scale): exact nearest map value, ties to even code.
// The binary search over a table's thresholds (quant_code_nearest), wherever they are held.
ZERO8_HD uint32_t quant_code_search(float n, const float* thresholds) {
  uint32_t c = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (uint32_t step = 128; step > 0; step >>= 1) c += (n > thresholds[c + step - 1]) ? step : 0u;
  return c;
}
ZERO8_HD uint32_t quant_code_nearest(float n, const QuantTable& t) { return quant_code_search(n, t.thresholds); }

// quant_code_nearest through the accelerator (a table's lut, thresholds, lut_steps and lut_packed,
// wherever they are held: the CUDA warp kernels copy them to shared memory), as the SIMD variants compute
// it; the same code for every n (tests/cpp/test_quant_map.cpp).
ZERO8_HD uint32_t quant_code_lut(float n, const uint32_t* lut, const float* thresholds, uint32_t steps, bool packed) {
  if (steps == kQuantLutNoSteps) return quant_code_search(n, thresholds);
  const uint32_t e = lut[quant_lut_index(n)];
  uint32_t c = e >> 16;
  if (packed) return c + (n > f32_from_bits((f32_bits(n) & 0xffff0000u) | (e & 0xffffu)) ? 1u : 0u);
  for (uint32_t s = 0; s < steps; ++s) c += n > thresholds[c] ? 1u : 0u;
  return c;
}
ZERO8_HD uint32_t quant_code_nearest_lut(float n, const QuantTable& t) {
  return quant_code_lut(n, t.lut, t.thresholds, t.lut_steps, t.lut_packed != 0);
}

// quant_code_nearest through the VBMI cells (t.cells_ok), as the AVX-512 VBMI variant computes it, for
// |n| <= 1 (n = x / scale with |x| <= |scale|; larger |n| would wrap the level-1 slot).
ZERO8_HD uint32_t quant_code_nearest_cells(float n, const QuantTable& t) {
  const uint32_t u = f32_bits(n);
  uint32_t a = (u & 0x7fffffffu) >> kQuantLutShift;
  a = a < kQuantLutLo ? kQuantLutLo : a;  // below 2^-24: the first bucket, as quant_lut_index
  const uint32_t e = a >> 7, m7 = a & 127u;
  const uint32_t slot = ((u >> 31) ? e - 103u : e - 64u) & (kQuantCellSlots - 1);
  const uint32_t c = t.cell_code[(t.cell_base[slot] + (m7 >> t.cell_shift[slot])) & (kQuantCellsMax - 1)];
  return c + (n > t.thresholds[c] ? 1u : 0u);
}

// Stochastic code: rounds to one of the two map values around n with probability proportional to
// closeness, so E[decode] == n inside the map's range; u is uniform in [0, 1).
ZERO8_HD uint32_t quant_code_stochastic(float n, float u, const QuantTable& t) {
  if (!(n > t.values[0])) return 0;  // also NaN
  if (n >= t.values[255]) return 255;
  uint32_t lo = 0;  // largest code with values[lo] <= n
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (uint32_t step = 128; step > 0; step >>= 1) {
    uint32_t c = lo + step;
    if (c <= 255 && t.values[c] <= n) lo = c;
  }
  float a = t.values[lo], b = t.values[lo + 1];
  float p = (n - a) / (b - a);
  return u < p ? lo + 1 : lo;
}

// Apply the no-sign-flip rule: a nonzero x never decodes to a value of the opposite sign. The sign is
// n's sign bit, so the rule also holds when x / scale underflows to a signed zero (which matters for
// maps without an exact 0, such as the signed linear map).
ZERO8_HD uint32_t quant_code_keep_sign(uint32_t c, float x, float n, const QuantTable& t) {
  if (x == 0.0f) return c;
  const float v = t.values[c];
  const bool negative = (f32_bits(n) >> 31) != 0;
  if (!negative && v < 0.0f) return t.nonneg_first;
  if (negative && v > 0.0f) return t.nonpos_last;
  return c;
}

// Code of element x in a block of the given scale (the full rule, as every variant must compute it).
ZERO8_HD uint32_t quant_encode_one(float x, float scale, const QuantTable& t, bool stochastic, float u) {
  if (!(scale == scale) || scale == 0.0f) return t.zero_code;
  float n = x / scale;
  uint32_t c = stochastic ? quant_code_stochastic(n, u, t) : quant_code_nearest(n, t);
  return quant_code_keep_sign(c, x, n, t);
}

ZERO8_HD float quant_decode_one(uint32_t code, float scale, const QuantTable& t) { return t.values[code] * scale; }

// A block's constants for quant_encode_accel, made once per block.
struct QuantBlockDivisor {
  float scale = 0.0f, r = 1.0f;
  bool zero = true;        // scale 0 or NaN: every code is zero_code
  bool fma = false;        // the quotient by quant_quotient_fma (r = 1 / scale)
  bool keep_sign = false;  // the no-sign-flip rule can act: the map has no exact 0
};
ZERO8_HD QuantBlockDivisor quant_block_divisor(float scale, const QuantTable& t) {
  QuantBlockDivisor d;
  d.scale = scale;
  d.zero = !(scale == scale) || scale == 0.0f;
  // With an exact 0 in the map the nearest value of a nonzero n is 0 or of n's sign, so the rule never
  // acts, and the sign of a zero quotient (which the multiply-adds may not reproduce) does not matter.
  d.keep_sign = !(t.values[t.zero_code] == 0.0f);
  d.fma = !d.zero && !d.keep_sign && quant_quotient_fma_ok(scale, t);
  d.r = d.fma ? 1.0f / scale : 1.0f;
  return d;
}

// quant_encode_one(x, scale, t, false, 0) through the accelerator (quant_code_lut over t's lut and
// thresholds, or copies of them: the CUDA warp kernels read them from shared memory; steps and packed are
// t's lut_steps and lut_packed) and, where d.fma, the quotient by multiply-adds: the same code for every
// x (tests/cpp/test_quant_map.cpp), as the AVX-512 VBMI step encodes.
ZERO8_HD uint32_t quant_encode_accel(float x, const QuantBlockDivisor& d, const QuantTable& t, const uint32_t* lut,
                                     const float* thresholds, uint32_t steps, bool packed) {
  if (d.zero) return t.zero_code;
  const float n = d.fma ? quant_quotient_fma(x, d.scale, d.r) : x / d.scale;
  const uint32_t c = quant_code_lut(n, lut, thresholds, steps, packed);
  return d.keep_sign ? quant_code_keep_sign(c, x, n, t) : c;
}

}  // namespace zero8::quant
