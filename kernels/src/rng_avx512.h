// rng_uniform (hd.h) for 16 lanes with AVX-512 (F/DQ), shared by the AVX-512 codec and int8 kernels.
// Internal linkage (anonymous namespace), as optim_simd.h explains: each AVX-512 translation unit keeps
// its own copy, so no copy compiled with other ISA flags can be merged into it by the linker.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace zero8 {
namespace {

// rng_uniform(seed, index0 + lane) for 16 lanes (splitmix64 on two halves of 8 lanes).
inline __m512 rng_uniform16_avx512(uint64_t seed, uint64_t index0) {
  const __m512i base = _mm512_set1_epi64(int64_t(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull + index0));
  auto mix = [](__m512i z) {
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(int64_t(0xbf58476d1ce4e5b9ull)));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(int64_t(0x94d049bb133111ebull)));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    return _mm512_cvtepi64_epi32(_mm512_srli_epi64(z, 32));
  };
  const __m256i r0 = mix(_mm512_add_epi64(base, _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256i r1 = mix(_mm512_add_epi64(base, _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15)));
  const __m512i r = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), _mm512_set1_ps(5.9604644775390625e-8f));
}

}  // namespace
}  // namespace zero8
