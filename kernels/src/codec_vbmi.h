// AVX-512 VBMI table lookups of the codec, 64 lanes at a time, shared by the codec's and the fused
// optimizers' avx512vbmi translation units. Byte permutes (vpermi2b: any byte of a 128-byte table per
// lane) replace the gathers of the avx512 code: a 256-entry float table is four 256-byte tables
// (QuantTable::value_bytes, threshold_bytes), and the nearest-code search reads the table's cells
// (QuantTable::cell_code). Results are bit-identical to the scalar reference: the same thresholds,
// compared as floats. Internal linkage only (an anonymous namespace), as codec_avx512_common.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "zero8/kernels/quant_map.h"

namespace zero8::quant {
namespace {

// Byte selectors, built at compile time.
struct VbmiIndex {
  alignas(64) uint8_t unpack_order[64];  // see bytes_to_dwords64
  alignas(64) uint8_t even_bytes[64];     // low bytes of the 64 words of two registers, in unpack_order
  alignas(64) uint8_t odd_bytes[64];      // high bytes of the same
  alignas(64) uint8_t natural_order[64];  // the inverse of unpack_order
  alignas(64) uint16_t odd_words[32];    // high words of the 32 dwords of two registers
  constexpr VbmiIndex() : unpack_order(), even_bytes(), odd_bytes(), natural_order(), odd_words() {
    for (int p = 0; p < 64; ++p) {
      const int lane = p / 16, j = (p % 16) / 4, i = p % 4;
      unpack_order[p] = uint8_t(16 * j + 4 * lane + i);
      natural_order[16 * j + 4 * lane + i] = uint8_t(p);
    }
    for (int p = 0; p < 64; ++p) {
      even_bytes[p] = uint8_t(2 * unpack_order[p]);
      odd_bytes[p] = uint8_t(2 * unpack_order[p] + 1);
    }
    for (int p = 0; p < 32; ++p) odd_words[p] = uint16_t(2 * p + 1);
  }
};
constexpr VbmiIndex kVbmiIndex{};

// Everything here is inlined into its caller: out of line, the calls would spill every vector register
// of the caller's loop (they are all caller-saved) and pass the vectors through memory.
#define ZERO8_VBMI_INLINE inline __attribute__((always_inline))

ZERO8_VBMI_INLINE __m512i vbmi_load(const void* p) { return _mm512_loadu_si512(p); }

// Four byte planes (byte k of each 32-bit value in plane k) to 64 dwords. The unpacks work within
// 128-bit lanes: output j, lane L, dword i comes from byte 16L + 4j + i of the planes, so planes looked
// up with indices in kVbmiIndex.unpack_order (element 16j + 4L + i there) give elements 16j..16j+15 in
// output j.
ZERO8_VBMI_INLINE void bytes_to_dwords64(__m512i b0, __m512i b1, __m512i b2, __m512i b3, __m512i out[4]) {
  const __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), hi01 = _mm512_unpackhi_epi8(b0, b1);
  const __m512i lo23 = _mm512_unpacklo_epi8(b2, b3), hi23 = _mm512_unpackhi_epi8(b2, b3);
  out[0] = _mm512_unpacklo_epi16(lo01, lo23);
  out[1] = _mm512_unpackhi_epi16(lo01, lo23);
  out[2] = _mm512_unpacklo_epi16(hi01, hi23);
  out[3] = _mm512_unpackhi_epi16(hi01, hi23);
}

// table[c[e]] for G groups of 64 codes (element e of group g in byte e of c[g]) from a table stored as
// byte planes: out[4g + j] holds elements 16j..16j+15 of group g. A 256-byte plane is read through two
// 128-byte permutes (bits 0..6 of the code), bit 7 (vpmovb2m) picks between them. Each table register
// is loaded once for the G groups (the tables outnumber the registers, so they come from L1 at every
// use).
// vbmi_lookup_unpacked takes the codes already in unpack_order (cu[g] = c[g] permuted by it).
template <int G>
ZERO8_VBMI_INLINE void vbmi_lookup_unpacked(const __m512i* cu, const uint8_t (*planes)[256], __m512i* out) {
  __mmask64 hi[G];
  for (int g = 0; g < G; ++g) hi[g] = _mm512_movepi8_mask(cu[g]);
  __m512i b[4][G];
  for (int k = 0; k < 4; ++k) {
    const __m512i t0 = vbmi_load(planes[k]), t1 = vbmi_load(planes[k] + 64);
    const __m512i t2 = vbmi_load(planes[k] + 128), t3 = vbmi_load(planes[k] + 192);
    for (int g = 0; g < G; ++g)
      b[k][g] = _mm512_mask_blend_epi8(hi[g], _mm512_permutex2var_epi8(t0, cu[g], t1),
                                       _mm512_permutex2var_epi8(t2, cu[g], t3));
  }
  for (int g = 0; g < G; ++g) bytes_to_dwords64(b[0][g], b[1][g], b[2][g], b[3][g], out + 4 * g);
}

template <int G>
ZERO8_VBMI_INLINE void vbmi_lookup(const __m512i* c, const uint8_t (*planes)[256], __m512i* out) {
  const __m512i order = vbmi_load(kVbmiIndex.unpack_order);
  __m512i cu[G];
  for (int g = 0; g < G; ++g) cu[g] = _mm512_permutexvar_epi8(order, c[g]);
  vbmi_lookup_unpacked<G>(cu, planes, out);
}

// values[c] for G groups of 64 codes.
template <int G>
ZERO8_VBMI_INLINE void vbmi_values(const __m512i* c, const QuantTable& t, __m512* out) {
  __m512i v[4 * G];
  vbmi_lookup<G>(c, t.value_bytes, v);
  for (int j = 0; j < 4 * G; ++j) out[j] = _mm512_castsi512_ps(v[j]);
}

// Four 16-lane masks as one 64-lane mask (lane 16j + i from bit i of m[j]), with mask-register unpacks.
ZERO8_VBMI_INLINE __mmask64 vbmi_mask64(const __mmask16* m) {
  return _mm512_kunpackd(_mm512_kunpackw(m[3], m[2]), _mm512_kunpackw(m[1], m[0]));
}

// The cell of 32 keys (the upper 16 bits of n: sign, exponent, 7 mantissa bits), as
// quant_code_nearest_cells: clamp |key| to the accelerator's first bucket, level-1 slot from the
// exponent (e - 64, or e - 103 for negative n), cell = base + (m7 >> shift).
ZERO8_VBMI_INLINE __m512i vbmi_cell32(__m512i key, const __m512i lvl1[4]) {
  const __m512i a = _mm512_max_epu16(_mm512_and_si512(key, _mm512_set1_epi16(0x7fff)),
                                     _mm512_set1_epi16(int16_t(kQuantLutLo)));
  __m512i slot = _mm512_srli_epi16(a, 7);
  slot = _mm512_mask_sub_epi16(slot, _mm512_movepi16_mask(key), slot, _mm512_set1_epi16(39));
  const __m512i base = _mm512_permutex2var_epi16(lvl1[0], slot, lvl1[1]);  // bits 0..5 of slot
  const __m512i shift = _mm512_permutex2var_epi16(lvl1[2], slot, lvl1[3]);
  return _mm512_add_epi16(base, _mm512_srlv_epi16(_mm512_and_si512(a, _mm512_set1_epi16(127)), shift));
}

// quant_code_nearest for G groups of 64 normalized values (|n| <= 1; n[4g + j] holds elements
// 16j..16j+15 of group g) of a table with cells_ok, as quant_code_nearest_cells computes it; byte e of
// out[g] is the code of element e of group g.
template <int G>
ZERO8_VBMI_INLINE void vbmi_code_nearest(const __m512* n, const QuantTable& t, __m512i* out) {
  // Keys: the upper 16 bits of each n, 32 words per register; then their cells.
  const __m512i odd_words = vbmi_load(kVbmiIndex.odd_words);
  const __m512i lvl1[4] = {vbmi_load(t.cell_base), vbmi_load(t.cell_base + 32), vbmi_load(t.cell_shift),
                           vbmi_load(t.cell_shift + 32)};
  __m512i lo[G], hi[G];
  for (int g = 0; g < G; ++g) {
    __m512i u[4];
    for (int j = 0; j < 4; ++j) u[j] = _mm512_castps_si512(n[4 * g + j]);
    const __m512i x0 = vbmi_cell32(_mm512_permutex2var_epi16(u[0], odd_words, u[1]), lvl1);
    const __m512i x1 = vbmi_cell32(_mm512_permutex2var_epi16(u[2], odd_words, u[3]), lvl1);
    // Cell numbers (< 512) as bytes: bits 0..6 index 128-byte permutes, bits 7 and 8 pick among them.
    lo[g] = _mm512_permutex2var_epi8(x0, vbmi_load(kVbmiIndex.even_bytes), x1);
    hi[g] = _mm512_permutex2var_epi8(x0, vbmi_load(kVbmiIndex.odd_bytes), x1);
  }
  __m512i c[G];
  {
    const uint8_t* cc = t.cell_code;
    const __m512i t0 = vbmi_load(cc), t1 = vbmi_load(cc + 64), t2 = vbmi_load(cc + 128), t3 = vbmi_load(cc + 192);
    const __m512i t4 = vbmi_load(cc + 256), t5 = vbmi_load(cc + 320), t6 = vbmi_load(cc + 384), t7 = vbmi_load(cc + 448);
    for (int g = 0; g < G; ++g) {
      const __mmask64 bit7 = _mm512_movepi8_mask(lo[g]), bit8 = _mm512_test_epi8_mask(hi[g], _mm512_set1_epi8(1));
      const __m512i c01 = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(t0, lo[g], t1),
                                                 _mm512_permutex2var_epi8(t2, lo[g], t3));
      const __m512i c23 = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(t4, lo[g], t5),
                                                 _mm512_permutex2var_epi8(t6, lo[g], t7));
      c[g] = _mm512_mask_blend_epi8(bit8, c01, c23);
    }
  }
  // One threshold at most in the cell: thresholds[c] decides between c and c + 1.
  __m512i th[4 * G];
  vbmi_lookup_unpacked<G>(c, t.threshold_bytes, th);
  const __m512i natural = vbmi_load(kVbmiIndex.natural_order);
  for (int g = 0; g < G; ++g) {
    const __m512i cn = _mm512_permutexvar_epi8(natural, c[g]);
    __mmask16 up[4];
    for (int j = 0; j < 4; ++j)
      up[j] = _mm512_cmp_ps_mask(n[4 * g + j], _mm512_castsi512_ps(th[4 * g + j]), _CMP_GT_OQ);
    out[g] = _mm512_mask_add_epi8(cn, vbmi_mask64(up), cn, _mm512_set1_epi8(1));
  }
}

// quant_code_keep_sign for 64 lanes (codes as bytes): values are sorted, so values[c] < 0 iff
// c < nonneg_first and values[c] > 0 iff c > nonpos_last (as code_keep_sign16 of the avx512 code).
ZERO8_VBMI_INLINE __m512i vbmi_keep_sign64(__m512i c, const __m512* x, const __m512* n, const QuantTable& t) {
  __mmask16 nz[4], neg[4];
  for (int j = 0; j < 4; ++j) {
    nz[j] = _mm512_cmp_ps_mask(x[j], _mm512_setzero_ps(), _CMP_NEQ_OQ);
    neg[j] = _mm512_movepi32_mask(_mm512_castps_si512(n[j]));  // n's sign bit
  }
  const __mmask64 nonzero = vbmi_mask64(nz), negative = vbmi_mask64(neg);
  c = _mm512_mask_max_epu8(c, _kandn_mask64(negative, nonzero), c, _mm512_set1_epi8(char(t.nonneg_first)));
  return _mm512_mask_min_epu8(c, _kand_mask64(nonzero, negative), c, _mm512_set1_epi8(char(t.nonpos_last)));
}

// The normalization n = x / scale of a block: the division, or where quant_quotient_fma_ok (and the
// sign of a zero quotient does not matter: no keep-sign rule) quant_quotient_fma's multiply and two
// fused multiply-adds, which leave the divider to the optimizers' updates and give the same codes.
struct VbmiDivisor {
  __m512 s = _mm512_set1_ps(1.0f), r = _mm512_set1_ps(1.0f);
  bool fma = false;
  VbmiDivisor() = default;
  VbmiDivisor(float scale, const QuantTable& t, bool keep_sign)
      : s(_mm512_set1_ps(scale)), r(_mm512_set1_ps(1.0f / scale)),
        fma(!keep_sign && quant_quotient_fma_ok(scale, t)) {}
  // x / scale, by the multiply-adds (kFma: only where fma is set) or by the division.
  template <bool kFma>
  ZERO8_VBMI_INLINE __m512 quotient(__m512 x) const {
    if constexpr (kFma) {
      const __m512 q = _mm512_mul_ps(x, r);
      return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
    } else {
      return _mm512_div_ps(x, s);
    }
  }
};

template <int G, bool kKeepSign, bool kFma>
ZERO8_VBMI_INLINE void vbmi_encode_as(const __m512* x, const VbmiDivisor& d, const QuantTable& t, __m512i* out) {
  __m512 n[4 * G];
  for (int j = 0; j < 4 * G; ++j) n[j] = d.template quotient<kFma>(x[j]);
  vbmi_code_nearest<G>(n, t, out);
  if constexpr (kKeepSign) {
    for (int g = 0; g < G; ++g) out[g] = vbmi_keep_sign64(out[g], x + 4 * g, n + 4 * g, t);
  }
}

// Codes of G groups of 64 values x of a block with a finite nonzero scale (n = x / scale). One branch
// around the whole encode: with the branch at the quotients only, the fused step gained nothing.
template <int G, bool kKeepSign>
ZERO8_VBMI_INLINE void vbmi_encode(const __m512* x, const VbmiDivisor& d, const QuantTable& t, __m512i* out) {
  if (d.fma)
    vbmi_encode_as<G, kKeepSign, true>(x, d, t, out);
  else
    vbmi_encode_as<G, kKeepSign, false>(x, d, t, out);
}

ZERO8_VBMI_INLINE __mmask64 vbmi_tail_mask64(int32_t count) { return count >= 64 ? ~__mmask64(0) : (__mmask64(1) << count) - 1; }

#undef ZERO8_VBMI_INLINE

}  // namespace
}  // namespace zero8::quant
