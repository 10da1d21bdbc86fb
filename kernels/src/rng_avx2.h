// rng_uniform (hd.h) for 8 lanes with AVX2, shared by the AVX2 codec and int8 kernels. Internal linkage
// (anonymous namespace), as optim_simd.h explains: each AVX2 translation unit keeps its own copy, so no
// copy compiled with other ISA flags can be merged into it by the linker.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace zero8 {
namespace {

// 64-bit lane multiply by a constant from 32-bit products (AVX2 has no vpmullq): low 64 bits of z * k.
inline __m256i mullo64_avx2(__m256i z, uint64_t k) {
  const __m256i klo = _mm256_set1_epi64x(int64_t(k & 0xffffffffu)), khi = _mm256_set1_epi64x(int64_t(k >> 32));
  const __m256i lo = _mm256_mul_epu32(z, klo);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), klo), _mm256_mul_epu32(z, khi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

// rng_uniform(seed, index0 + lane) for 8 lanes (splitmix64 on two halves of 4 lanes).
inline __m256 rng_uniform8_avx2(uint64_t seed, uint64_t index0) {
  const __m256i base = _mm256_set1_epi64x(int64_t(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull + index0));
  auto mix = [](__m256i z) {
    z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xbf58476d1ce4e5b9ull);
    z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94d049bb133111ebull);
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    // high 32 bits of each 64-bit lane into the low 128 bits
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(z, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
  };
  const __m128i r0 = mix(_mm256_add_epi64(base, _mm256_setr_epi64x(0, 1, 2, 3)));
  const __m128i r1 = mix(_mm256_add_epi64(base, _mm256_setr_epi64x(4, 5, 6, 7)));
  const __m256i r = _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-8f));
}

}  // namespace
}  // namespace zero8
