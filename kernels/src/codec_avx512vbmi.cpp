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
  const __m512 s = _mm512_set1_ps(scale);
  constexpr int kLine = 64 / (D == DType::f32 ? 4 : 2);  // elements per cache line
  int32_t i = 0;
  for (; i + 128 <= len; i += 128) {  // two groups of 64 per table load
    if (prefetch) {
      for (int k = 0; k < 128; k += kLine) _mm_prefetch(prefetch + int64_t(i + k) * dtype_size(D), _MM_HINT_T0);
    }
    __m512 v[8];
    for (int j = 0; j < 8; ++j) v[j] = load16<D>(x, off + i + 16 * j);
    __m512i c[2];
    vbmi_encode<2, kKeepSign>(v, s, t, c);
    _mm512_storeu_si512(codes + i, c[0]);
    _mm512_storeu_si512(codes + i + 64, c[1]);
  }
  for (; i < len; i += 64) {  // the lanes past len read as 0 and are not stored
    const int32_t r = std::min(64, len - i);
    __m512 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load16_masked<D>(x, off + i + 16 * j, tail_mask(std::clamp(r - 16 * j, 0, 16)));
    __m512i c;
    vbmi_encode<1, kKeepSign>(v, s, t, &c);
    _mm512_mask_storeu_epi8(codes + i, vbmi_tail_mask64(r), c);
  }
}

// As the avx512 encode_range: scales of a group of blocks, then their codes.
template <DType D, bool kKeepSign>
void encode_range(const EncodeArgs& a) {
  const QuantTable& t = *a.table;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  const int64_t group = std::max<int64_t>(1, kGroupElements / a.block);
  const int64_t esize = dtype_size(D);
  const int64_t ahead = std::max<int64_t>(0, 8192 / esize - a.block);
  for (int64_t g = 0; g < nblocks; g += group) {
    const int64_t gend = std::min(nblocks, g + group);
    for (int64_t b = g; b < gend; ++b) {
      const int64_t lo = b * a.block;
      a.absmax[b] = block_scale<D>(a.x, lo, int32_t(std::min<int64_t>(a.block, a.n - lo)), t);
    }
    for (int64_t b = g; b < gend; ++b) {
      const int64_t lo = b * a.block;
      const int32_t len = int32_t(std::min<int64_t>(a.block, a.n - lo));
      const int64_t pf = lo + len + ahead;
      const char* prefetch = pf < a.n ? static_cast<const char*>(a.x) + pf * esize : nullptr;
      encode_codes<D, kKeepSign>(a.x, lo, len, a.absmax[b], t, a.codes + lo, prefetch);
    }
  }
}

template <DType D>
void encode_dtype(const EncodeArgs& a) {
  if (map_has_zero(*a.table))
    encode_range<D, false>(a);
  else
    encode_range<D, true>(a);
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
      if constexpr (kStream)
        store16_stream<D>(y, e, x);
      else
        store16<D>(y, e, x);
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

template <DType D, bool kAccumulate, bool kStream>
void decode_blocks(const DecodeArgs& a) {
  const QuantTable& t = *a.table;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * a.block;
    const int32_t len = int32_t(std::min<int64_t>(a.block, a.n - lo));
    decode_block<D, kAccumulate, kStream>(a.codes + lo, len, a.absmax[b], t, a.y, lo);
  }
  if (kStream) _mm_sfence();
}

template <DType D, bool kAccumulate>
void decode_range(const DecodeArgs& a) {
  if (!kAccumulate && a.n * dtype_size(D) >= kStreamBytes && reinterpret_cast<uintptr_t>(a.y) % 64 == 0)
    decode_blocks<D, kAccumulate, !kAccumulate>(a);
  else
    decode_blocks<D, kAccumulate, false>(a);
}

}  // namespace

void quant_encode_avx512vbmi(const EncodeArgs& a) {
  if (a.stochastic || !a.table->cells_ok) return quant_encode_avx512(a);
  switch (a.dtype) {
    case DType::f32: return encode_dtype<DType::f32>(a);
    case DType::bf16: return encode_dtype<DType::bf16>(a);
    case DType::f16: return encode_dtype<DType::f16>(a);
  }
}

void quant_decode_avx512vbmi(const DecodeArgs& a) {
  if (a.accumulate) return decode_range<DType::f32, true>(a);
  switch (a.dtype) {
    case DType::f32: return decode_range<DType::f32, false>(a);
    case DType::bf16: return decode_range<DType::bf16, false>(a);
    case DType::f16: return decode_range<DType::f16, false>(a);
  }
}

float quant_block_encode_f32_avx512vbmi(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  if (!t.cells_ok) return quant_block_encode_f32_avx512(x, len, t, codes);
  const float scale = block_scale<DType::f32>(x, 0, len, t);
  if (map_has_zero(t))
    encode_codes<DType::f32, false>(x, 0, len, scale, t, codes, nullptr);
  else
    encode_codes<DType::f32, true>(x, 0, len, scale, t, codes, nullptr);
  return scale;
}

void quant_block_decode_f32_avx512vbmi(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  decode_block<DType::f32, false, false>(codes, len, scale, t, y, 0);
}

}  // namespace zero8::quant
