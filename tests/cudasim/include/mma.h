// CUDA's warp matrix functions (nvcuda::wmma) as zero8's CUDA simulator provides them (ZERO8_CUDA=SIM, tests
// only): the 16 x 16 x 16 shape with signed 8-bit operands and int32 accumulators, the tensor-core form zero8's
// per-block int8 product uses (kernels/cuda/int8_blockwise.cu).
//
// Which lane holds which element of a fragment is unspecified in CUDA (the programming guide, "Warp Matrix
// Functions"). Here each use (matrix_a, matrix_b, accumulator) scatters its 256 elements over the lanes by its
// own permutation, so a kernel that assumes a layout, or assumes two uses share one, gives wrong results in the
// tests. As on a GPU, every call is made by all 32 lanes of the warp with the same pointer and leading
// dimension (otherwise the simulator reports it and aborts), a pointer must be 256-bit aligned and a leading
// dimension a multiple of 16 bytes. Integer sums wrap modulo 2^32 (the hardware's int32 accumulation).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "zero8_cudasim.h"

namespace zero8_cudasim {
[[noreturn]] void wmma_fatal(const std::string& what);
}  // namespace zero8_cudasim

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace sim {

template <class Use>
struct UseTraits;
// Position (row * 16 + column) of element e of lane l: (32 * e + l) times an odd multiplier, plus an offset,
// modulo 256, a different bijection for each use.
template <>
struct UseTraits<matrix_a> {
  static constexpr unsigned kMul = 37, kAdd = 11;
};
template <>
struct UseTraits<matrix_b> {
  static constexpr unsigned kMul = 91, kAdd = 200;
};
template <>
struct UseTraits<accumulator> {
  static constexpr unsigned kMul = 173, kAdd = 77;
};

template <class Use>
constexpr int position(int lane, int e) {
  return int(((32u * unsigned(e) + unsigned(lane)) * UseTraits<Use>::kMul + UseTraits<Use>::kAdd) & 255u);
}

// A load or store's checks: p and ldm as CUDA requires them, and the same in all 32 lanes (a warp barrier).
inline void warp_call(const char* what, const void* p, unsigned ldm, size_t elem_bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    ::zero8_cudasim::wmma_fatal(std::string(what) + ": the pointer is not 256-bit aligned");
  if ((size_t(ldm) * elem_bytes) % 16 != 0)
    ::zero8_cudasim::wmma_fatal(std::string(what) + ": the leading dimension " + std::to_string(ldm) +
                                " is not a multiple of 16 bytes");
  unsigned gen = 0;
  const uint64_t key = (uint64_t(reinterpret_cast<uintptr_t>(p)) << 16) ^ ldm;
  ::zero8_cudasim::sync_warp_exchange(0xffffffffu, key, &gen);
  for (int l = 0; l < 32; ++l)
    if (::zero8_cudasim::shfl_value(0xffffffffu, gen, l) != key)
      ::zero8_cudasim::wmma_fatal(std::string(what) +
                                  ": the lanes of the warp pass different pointers or leading dimensions");
}

// Element (r, c) of a 16 x 16 matrix at p with leading dimension ldm, stored row- or column-major.
template <class T>
inline T* at(T* p, unsigned ldm, bool row_major_storage, int r, int c) {
  return row_major_storage ? p + size_t(r) * ldm + c : p + size_t(c) * ldm + r;
}

}  // namespace sim

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the simulator has the 16 x 16 x 16 shape only");
  static_assert((std::is_same<Use, accumulator>::value && std::is_same<T, int>::value) ||
                    (!std::is_same<Use, accumulator>::value && std::is_same<T, signed char>::value),
                "the simulator has signed 8-bit operands with int32 accumulators only");
  using element_type = T;
  static constexpr int num_elements = 8;
  T x[num_elements];
};

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T v) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = v;
}

template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, signed char, Layout>& f, const signed char* p, unsigned ldm) {
  static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                "an operand fragment names its layout");
  sim::warp_call("wmma::load_matrix_sync", p, ldm, 1);
  const int lane = ::zero8_cudasim::lane_id();
  for (int e = 0; e < f.num_elements; ++e) {
    const int pos = sim::position<Use>(lane, e);
    f.x[e] = *sim::at(p, ldm, std::is_same<Layout, row_major>::value, pos / 16, pos % 16);
  }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, int>& f, const int* p, unsigned ldm, layout_t l) {
  sim::warp_call("wmma::load_matrix_sync", p, ldm, 4);
  const int lane = ::zero8_cudasim::lane_id();
  for (int e = 0; e < f.num_elements; ++e) {
    const int pos = sim::position<accumulator>(lane, e);
    f.x[e] = *sim::at(p, ldm, l == mem_row_major, pos / 16, pos % 16);
  }
}

inline void store_matrix_sync(int* p, const fragment<accumulator, 16, 16, 16, int>& f, unsigned ldm, layout_t l) {
  sim::warp_call("wmma::store_matrix_sync", p, ldm, 4);
  const int lane = ::zero8_cudasim::lane_id();
  for (int e = 0; e < f.num_elements; ++e) {
    const int pos = sim::position<accumulator>(lane, e);
    *sim::at(p, ldm, l == mem_row_major, pos / 16, pos % 16) = f.x[e];
  }
}

// d = a * b + c. The lanes exchange their fragments' addresses, each computes its elements of d from all of a
// and b, and a second barrier keeps every lane's fragments unchanged until all have read them.
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, int>& d,
                     const fragment<matrix_a, 16, 16, 16, signed char, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, signed char, LB>& b,
                     const fragment<accumulator, 16, 16, 16, int>& c) {
  struct Parts {
    const signed char* a;
    const signed char* b;
  } mine{a.x, b.x};
  unsigned g2 = 0;
  ::zero8_cudasim::sync_warp_exchange(0xffffffffu, ::zero8_cudasim::to_slot(&mine), &g2);
  signed char am[256], bm[256];
  for (int l = 0; l < 32; ++l) {
    const Parts* p = ::zero8_cudasim::from_slot<const Parts*>(::zero8_cudasim::shfl_value(0xffffffffu, g2, l));
    for (int e = 0; e < 8; ++e) {
      am[sim::position<matrix_a>(l, e)] = p->a[e];
      bm[sim::position<matrix_b>(l, e)] = p->b[e];
    }
  }
  const int lane = ::zero8_cudasim::lane_id();
  int out[8];
  for (int e = 0; e < 8; ++e) {
    const int pos = sim::position<accumulator>(lane, e), r = pos / 16, col = pos % 16;
    uint32_t s = uint32_t(c.x[e]);
    for (int kk = 0; kk < 16; ++kk) s += uint32_t(int32_t(am[r * 16 + kk]) * int32_t(bm[kk * 16 + col]));
    int32_t v;
    std::memcpy(&v, &s, 4);
    out[e] = v;
  }
  unsigned g3 = 0;
  ::zero8_cudasim::sync_warp_exchange(0xffffffffu, 0, &g3);  // nobody changes a or b while another lane reads
  for (int e = 0; e < 8; ++e) d.x[e] = out[e];
}

}  // namespace wmma
}  // namespace nvcuda
