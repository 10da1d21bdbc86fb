// AVX-512 VBMI variant of the block-wise codec: the avx512 code with its table lookups done by byte
// permutes (codec_vbmi.h), 64 lanes at a time. Nearest rounding of maps with cells (every standard map)
// and every decode run here; stochastic rounding and maps without cells take the avx512 code. Codes,
// scales and decoded values are bit-identical to the scalar reference.
#include <immintrin.h>

// GCC 12 flags the _mm*_undefined_*() placeholders inside its own intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstring>

#include "codec_avx512_common.h"
#include "codec_internal.h"
#include "codec_simd.h"
#include "codec_vbmi.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

// Codes of elements [off, off + len) of x, a block of the given scale, into codes[0, len). prefetch:
// start of the input bytes to fetch meanwhile (as many as the block's), or null.
template <DType D, bool kKeepSign>
void encode_codes(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, uint8_t* codes,
                  const char* prefetch) {
  if (!(scale == scale) || scale == 0.0f) {
    std::memset(codes, t.zero_code, size_t(len));
    return;
  }
  const VbmiDivisor d(scale, t, kKeepSign);
  constexpr int kLine = 64 / (D == DType::f32 ? 4 : 2);  // elements per cache line
  int32_t i = 0;
  for (; i + 128 <= len; i += 128) {  // two groups of 64 per table load
    if (prefetch) {
      for (int k = 0; k < 128; k += kLine) _mm_prefetch(prefetch + int64_t(i + k) * dtype_size(D), _MM_HINT_T0);
    }
    __m512 v[8];
    for (int j = 0; j < 8; ++j) v[j] = load16<D>(x, off + i + 16 * j);
    __m512i c[2];
    vbmi_encode<2, kKeepSign>(v, d, t, c);
    _mm512_storeu_si512(codes + i, c[0]);
    _mm512_storeu_si512(codes + i + 64, c[1]);
  }
  for (; i < len; i += 64) {  // the lanes past len read as 0 and are not stored
    const int32_t r = std::min(64, len - i);
    __m512 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load16_masked<D>(x, off + i + 16 * j, tail_mask(std::clamp(r - 16 * j, 0, 16)));
    __m512i c;
    vbmi_encode<1, kKeepSign>(v, d, t, &c);
    _mm512_mask_storeu_epi8(codes + i, vbmi_tail_mask64(r), c);
  }
}

// y[off + i] (=, or += when kAccumulate) values[codes[i]] * scale for i < len. kStream: y is 64-byte
// aligned and large (not with kAccumulate, which reads y anyway).
template <DType D, bool kAccumulate, bool kStream>
inline void decode_block(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, void* y, int64_t off) {
  const __m512 s = _mm512_set1_ps(scale);
  int32_t i = 0;
  for (; i + 128 <= len; i += 128) {  // two groups of 64 per table load
    const __m512i c[2] = {_mm512_loadu_si512(codes + i), _mm512_loadu_si512(codes + i + 64)};
    __m512 v[8];
    vbmi_values<2>(c, t, v);
    for (int j = 0; j < 8; ++j) {
      const int64_t e = off + i + 16 * j;
      __m512 x = _mm512_mul_ps(v[j], s);
      if constexpr (kAccumulate) x = _mm512_add_ps(_mm512_loadu_ps(static_cast<float*>(y) + e), x);
      store16<D, kStream>(y, e, x);
    }
  }
  for (; i < len; i += 64) {
    const int32_t r = std::min(64, len - i);
    const __m512i c = _mm512_maskz_loadu_epi8(vbmi_tail_mask64(r), codes + i);
    __m512 v[4];
    vbmi_values<1>(&c, t, v);
    for (int j = 0; 16 * j < r; ++j) {
      const int64_t e = off + i + 16 * j;
      const __mmask16 m = tail_mask(std::min(16, r - 16 * j));
      __m512 x = _mm512_mul_ps(v[j], s);
      if constexpr (kAccumulate) x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, static_cast<float*>(y) + e), x);
      store16_masked<D>(y, e, x, m);
    }
  }
}

// The lane functions of codec_simd.h's drivers (nearest rounding by cells only).
struct Avx512Vbmi : Avx512LanesBase {
  using Lookup = NoLookup;
  static constexpr bool kCellsOnly = true;
  template <DType D, Search S, Round R, bool kKeepSign>
  static void encode(const void* x, int64_t off, int32_t len, float scale, const QuantTable& t, const NoLookup*,
                     uint8_t* codes, uint64_t, uint64_t, const char* prefetch) {
    static_assert(S == Search::cells && R == Round::nearest, "VBMI cells, nearest rounding only");
    encode_codes<D, kKeepSign>(x, off, len, scale, t, codes, prefetch);
  }
  template <DType D, bool kAccumulate, bool kStream>
  static void decode(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, const NoLookup&, void* y,
                     int64_t off) {
    decode_block<D, kAccumulate, kStream>(codes, len, scale, t, y, off);
  }
};

}  // namespace

void quant_encode_avx512vbmi(const EncodeArgs& a) {
  if (a.stochastic || !a.table->cells_ok) return quant_encode_avx512(a);
  codec_encode<Avx512Vbmi>(a);
}

void quant_decode_avx512vbmi(const DecodeArgs& a) { codec_decode<Avx512Vbmi>(a); }

float quant_block_encode_f32_avx512vbmi(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  if (!t.cells_ok) return quant_block_encode_f32_avx512(x, len, t, codes);
  return codec_block_encode_f32<Avx512Vbmi>(x, len, t, codes);
}

void quant_block_decode_f32_avx512vbmi(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  codec_block_decode_f32<Avx512Vbmi>(codes, len, scale, t, y);
}

}  // namespace zero8::quant
