// Host/device basics shared by the CPU and CUDA paths: the ZERO8_HD qualifier, element dtypes and
// bit-exact bf16/fp16 conversions. The same code converts on both sides, so CPU tests cover the GPU math.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ZERO8_HD __host__ __device__ __forceinline__
#else
#define ZERO8_HD inline
#endif

namespace zero8 {

// Element type of a tensor crossing the kernel boundary.
enum class DType : uint8_t { f32 = 0, bf16 = 1, f16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
  }
  return "?";
}
inline int dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

ZERO8_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
ZERO8_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// bfloat16: upper 16 bits of a float32; conversion rounds to nearest even, NaN stays NaN (quiet).
ZERO8_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
ZERO8_HD uint16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE binary16 <-> float32, round to nearest even, subnormals and Inf/NaN handled (same as F16C).
ZERO8_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // Inf / NaN
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    // subnormal: value = man * 2^-24, exact in float32
    float v = float(man) * 5.9604644775390625e-8f;
    return f32_from_bits(sign | f32_bits(v));
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}
ZERO8_HD uint16_t f32_to_f16(float x) {
  uint32_t u = f32_bits(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN, quiet
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (a < 0x38800000u) {
    // result is subnormal (or zero): shift the full significand, round to nearest even
    if (a < 0x33000000u) return uint16_t(sign);  // < 2^-25: rounds to zero
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

// Load/store one element of any DType as float32.
ZERO8_HD float dtype_load(const void* p, DType t, int64_t i) {
  if (t == DType::f32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}
ZERO8_HD void dtype_store(void* p, DType t, int64_t i, float v) {
  if (t == DType::f32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = t == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

// Counter-based random numbers: the value for (seed, index) is the same on every thread, variant
// and device, so stochastic rounding is reproducible and independent of how the work is split.
// rng_mix also derives one stream's seed from another's and a counter (rank, step...).
ZERO8_HD uint64_t rng_mix(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;  // splitmix64 finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
ZERO8_HD uint32_t rng_u32(uint64_t seed, uint64_t index) { return uint32_t(rng_mix(seed, index) >> 32); }
// Uniform in [0, 1) with 24 random bits.
ZERO8_HD float rng_uniform(uint64_t seed, uint64_t index) { return float(rng_u32(seed, index) >> 8) * 5.9604644775390625e-8f; }

}  // namespace zero8
