// The block-wise codec's drivers written once over a per-ISA lane class K, included by codec_avx2.cpp,
// codec_avx512.cpp and codec_avx512vbmi.cpp: the walk over the blocks, the choice of search, rounding
// and sign rule from the table and the arguments, and the entry points' dtype switch. Internal linkage
// only (an anonymous namespace), as optim_simd.h explains: each TU keeps its own copy, compiled with its
// own -m flags.
//
// K supplies:
//   Lookup          per-call state built from the table (the values in registers, or nothing)
//   kCellsOnly      the variant encodes by VBMI cells with nearest rounding only (its caller checked)
//   kGroupElements  blocks are encoded in groups of about this many elements, every scale of a group
//                   before its codes, so that a small block's codes need not wait for the reduction of
//                   its own scale (0: one block at a time)
//   kStreamBytes    decoded outputs of at least this many bytes, 64-byte aligned, are written with
//                   streaming stores (0: never)
//   scale_of<D>(x, off, len, t): the block scale of elements [off, off + len) of x
//   encode<D, S, R, kKeepSign>(x, off, len, scale, t, lookup*, codes, seed, index0, prefetch): the codes
//       of elements [off, off + len) of x into codes[0, len); index0 is the global index of element off;
//       prefetch is the start of as many input bytes to fetch meanwhile, or null
//   decode<D, kAccumulate, kStream>(codes, len, scale, t, lookup, y, off): y[off + i] (=, or += when
//       kAccumulate) values[codes[i]] * scale for i < len
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "zero8/kernels/codec.h"

namespace zero8::quant {
namespace {

// How the nearest code is found (see QuantTable::lut): one read of the packed accelerator (every
// standard map), the accelerator plus lut_steps threshold reads, the reference's 8-step binary search
// (non-monotone maps), or the VBMI sub-bucket cells (codec_vbmi.h).
enum class Search { packed, lut, binary, cells };

// Rounding: nearest; stochastic through the nearest code (strictly increasing maps); stochastic by
// the reference's search (any map).
enum class Round { nearest, stochastic_near, stochastic_search };

// kKeepSign: the map has no exact 0; with one, neither rounding can cross zero and the sign rule
// (quant_code_keep_sign) is a no-op.
inline bool map_has_zero(const QuantTable& t) { return t.values[t.zero_code] == 0.0f; }

inline bool map_strictly_increasing(const QuantTable& t) {
  for (int i = 0; i < 255; ++i)
    if (!(t.values[i] < t.values[i + 1])) return false;
  return true;
}

// The Lookup of variants that read the table directly.
struct NoLookup {
  explicit NoLookup(const QuantTable&) {}
};

// f(std::integral_constant<Search, S>) with the accelerator search the table allows.
template <class F>
void with_search(const QuantTable& t, F&& f) {
  if (t.lut_packed)
    f(std::integral_constant<Search, Search::packed>());
  else if (t.lut_steps == kQuantLutNoSteps)
    f(std::integral_constant<Search, Search::binary>());
  else
    f(std::integral_constant<Search, Search::lut>());
}

template <class K, DType D, Search S, Round R, bool kKeepSign>
void encode_range(const EncodeArgs& a) {
  const QuantTable& t = *a.table;
  const typename K::Lookup lookup(t);
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  const int64_t group = std::max<int64_t>(1, K::kGroupElements / a.block);
  const int64_t esize = dtype_size(D);
  // Prefetch about 8 KiB ahead: the next block for large blocks, a few blocks on for small ones.
  const int64_t ahead = std::max<int64_t>(0, 8192 / esize - a.block);
  for (int64_t g = 0; g < nblocks; g += group) {
    const int64_t gend = std::min(nblocks, g + group);
    for (int64_t b = g; b < gend; ++b) {
      const int64_t lo = b * a.block;
      a.absmax[b] = K::template scale_of<D>(a.x, lo, int32_t(std::min<int64_t>(a.block, a.n - lo)), t);
    }
    for (int64_t b = g; b < gend; ++b) {
      const int64_t lo = b * a.block;
      const int32_t len = int32_t(std::min<int64_t>(a.block, a.n - lo));
      const int64_t pf = lo + len + ahead;
      const char* prefetch = pf < a.n ? static_cast<const char*>(a.x) + pf * esize : nullptr;
      K::template encode<D, S, R, kKeepSign>(a.x, lo, len, a.absmax[b], t, &lookup, a.codes + lo, a.seed,
                                            a.index_base + uint64_t(lo), prefetch);
    }
  }
}

template <class K, DType D, Round R, bool kKeepSign>
void encode_search(const EncodeArgs& a) {
  with_search(*a.table, [&](auto s) { encode_range<K, D, decltype(s)::value, R, kKeepSign>(a); });
}

template <class K, DType D, bool kKeepSign>
void encode_map(const EncodeArgs& a) {
  if constexpr (K::kCellsOnly)  // the caller sent stochastic rounding and maps without cells elsewhere
    encode_range<K, D, Search::cells, Round::nearest, kKeepSign>(a);
  else if (!a.stochastic)
    encode_search<K, D, Round::nearest, kKeepSign>(a);
  else if (map_strictly_increasing(*a.table))
    encode_search<K, D, Round::stochastic_near, kKeepSign>(a);
  else
    encode_range<K, D, Search::binary, Round::stochastic_search, kKeepSign>(a);
}

template <class K, DType D>
void encode_dtype(const EncodeArgs& a) {
  if (map_has_zero(*a.table))
    encode_map<K, D, false>(a);
  else
    encode_map<K, D, true>(a);
}

template <class K>
void codec_encode(const EncodeArgs& a) {
  switch (a.dtype) {
    case DType::f32: return encode_dtype<K, DType::f32>(a);
    case DType::bf16: return encode_dtype<K, DType::bf16>(a);
    case DType::f16: return encode_dtype<K, DType::f16>(a);
  }
}

template <class K, bool kKeepSign>
float block_encode_f32(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  constexpr DType D = DType::f32;
  constexpr Round R = Round::nearest;
  const float scale = K::template scale_of<D>(x, 0, len, t);
  if constexpr (K::kCellsOnly)
    K::template encode<D, Search::cells, R, kKeepSign>(x, 0, len, scale, t, nullptr, codes, 0, 0, nullptr);
  else
    with_search(t, [&](auto s) {
      K::template encode<D, decltype(s)::value, R, kKeepSign>(x, 0, len, scale, t, nullptr, codes, 0, 0, nullptr);
    });
  return scale;
}

// Nearest-rounding encode of one block of fp32 values in memory (quant_block_encode_f32_*).
template <class K>
float codec_block_encode_f32(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  return map_has_zero(t) ? block_encode_f32<K, false>(x, len, t, codes) : block_encode_f32<K, true>(x, len, t, codes);
}

template <class K, DType D, bool kAccumulate, bool kStream>
void decode_blocks(const DecodeArgs& a) {
  const QuantTable& t = *a.table;
  const typename K::Lookup lookup(t);
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * a.block;
    const int32_t len = int32_t(std::min<int64_t>(a.block, a.n - lo));
    K::template decode<D, kAccumulate, kStream>(a.codes + lo, len, a.absmax[b], t, lookup, a.y, lo);
  }
  if (kStream) _mm_sfence();
}

template <class K, DType D, bool kAccumulate>
void decode_range(const DecodeArgs& a) {
  // Not with kAccumulate, which reads y anyway.
  if constexpr (!kAccumulate && K::kStreamBytes > 0) {
    if (a.n * dtype_size(D) >= K::kStreamBytes && reinterpret_cast<uintptr_t>(a.y) % 64 == 0)
      return decode_blocks<K, D, false, true>(a);
  }
  decode_blocks<K, D, kAccumulate, false>(a);
}

template <class K>
void codec_decode(const DecodeArgs& a) {
  if (a.accumulate) return decode_range<K, DType::f32, true>(a);
  switch (a.dtype) {
    case DType::f32: return decode_range<K, DType::f32, false>(a);
    case DType::bf16: return decode_range<K, DType::bf16, false>(a);
    case DType::f16: return decode_range<K, DType::f16, false>(a);
  }
}

template <class K>
void codec_block_decode_f32(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  K::template decode<DType::f32, false, false>(codes, len, scale, t, typename K::Lookup(t), y, 0);
}

}  // namespace
}  // namespace zero8::quant
