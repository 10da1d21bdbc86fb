// Test helper: the nearest of 256 map values to a float, decided exactly (ties to the even code).
// Distances are compared in double, and where double cannot separate them (a subnormal n between two
// values of ~1e-3 loses itself in their 53 bits) in exact 192-bit fixed point: every float is an
// integer multiple of 2^-150, and |values| <= 1, |n| <= 4 keep the integers below 2^153.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace zero8::test {

struct Fixed192 {
  uint64_t w[3] = {0, 0, 0};  // two's complement, little-endian limbs, units of 2^-150

  static Fixed192 from_float(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t e = (u >> 23) & 0xffu;
    uint64_t m = u & 0x7fffffu;
    int shift = 0;  // x = m * 2^(shift - 150)
    if (e == 0) {
      shift = 1;  // subnormal: m * 2^-149
    } else {
      m |= 0x800000u;
      shift = int(e) - 127 - 23 + 150;
    }
    Fixed192 r;
    for (int k = 0; k < 3; ++k) {  // r = m << shift
      const int lo = 64 * k;
      if (shift >= lo && shift < lo + 64) {
        r.w[k] |= m << (shift - lo);
        if (shift - lo > 40 && k + 1 < 3) r.w[k + 1] |= m >> (64 - (shift - lo));
      }
    }
    return (u >> 31) ? r.neg() : r;
  }
  Fixed192 neg() const {
    Fixed192 r;
    uint64_t carry = 1;
    for (int k = 0; k < 3; ++k) {
      r.w[k] = ~w[k] + carry;
      carry = (carry && r.w[k] == 0) ? 1 : 0;
    }
    return r;
  }
  Fixed192 sub(const Fixed192& b) const {
    Fixed192 r;
    uint64_t borrow = 0;
    for (int k = 0; k < 3; ++k) {
      const uint64_t d = w[k] - b.w[k] - borrow;
      borrow = (w[k] < b.w[k] || (w[k] == b.w[k] && borrow)) ? 1 : 0;
      r.w[k] = d;
    }
    return r;
  }
  bool negative() const { return (w[2] >> 63) != 0; }
  Fixed192 abs() const { return negative() ? neg() : *this; }
  // Unsigned comparison (for absolute values).
  int cmp(const Fixed192& b) const {
    for (int k = 2; k >= 0; --k)
      if (w[k] != b.w[k]) return w[k] < b.w[k] ? -1 : 1;
    return 0;
  }
};

// argmin_i |n - v[i]| over 256 sorted values, ties to the even index.
inline uint32_t exact_nearest(float n, const float* v) {
  double best = std::numeric_limits<double>::infinity();
  uint32_t code = 0;
  const Fixed192 nf = Fixed192::from_float(n);
  for (uint32_t i = 0; i < 256; ++i) {
    const double d = std::fabs(double(n) - double(v[i]));
    bool take;
    if (d < best * (1.0 - 1e-9)) {
      take = true;
    } else if (d > best * (1.0 + 1e-9)) {
      take = false;
    } else {  // too close for double: decide exactly
      const int c = nf.sub(Fixed192::from_float(v[i])).abs().cmp(nf.sub(Fixed192::from_float(v[code])).abs());
      take = c < 0 || (c == 0 && i % 2 == 0 && code % 2 == 1);
    }
    if (take) {
      best = d;
      code = i;
    }
  }
  return code;
}

}  // namespace zero8::test
