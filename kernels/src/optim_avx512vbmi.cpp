// AVX-512 VBMI variant of the fused optimizers. The 8-bit step of the element-wise algorithms runs
// fused, 128 elements at a time: the states are decoded in registers by byte permutes (codec_vbmi.h),
// updated, stored once to a block buffer while their min, max and finiteness accumulate, and encoded
// from there once the block's scale is known, interleaved with the update of the next block.
// LAMB/LARS, 32-bit states, maps without VBMI cells or without an exact 0, and a partial last block
// take the loop of optim_simd.h with the VBMI block helpers. Bit-identical to optim_ref.cpp
// (tests/cpp/test_optim.cpp).
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized (and -Wuninitialized) once inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstring>

#include "codec_avx512_common.h"
#include "codec_internal.h"
#include "codec_vbmi.h"

#define ZERO8_OPTIM_BLOCK_DECODE quant::quant_block_decode_f32_avx512vbmi
#define ZERO8_OPTIM_BLOCK_ENCODE quant::quant_block_encode_f32_avx512vbmi
#include "optim_simd.h"
#include "optim_v512.h"

namespace zero8::optim {
namespace {

using quant::QuantTable;

// How far ahead (in elements) the fused loop prefetches: two 256-element blocks, 2 KiB of each fp32
// stream. Prefetching makes the step faster on arrays beyond the caches, and the distance hardly
// matters (1 to 8 blocks time alike); the figures are in docs/BENCHMARKS.md.
constexpr int64_t kPrefetchAhead = 512;

// The encoding of one state block once its scale is known, 64 G codes at a time, for a map with an
// exact 0 (so that the no-sign-flip rule never acts: see encode16 of the avx512 code).
struct BlockEncode {
  const float* x = nullptr;
  const QuantTable* t = nullptr;
  uint8_t* codes = nullptr;
  quant::VbmiDivisor d;
  bool zero = true;  // scale 0 or NaN: every code is zero_code

  BlockEncode() = default;
  BlockEncode(const float* x_, float scale, const QuantTable& t_, uint8_t* codes_)
      : x(x_), t(&t_), codes(codes_), d(scale, t_, false), zero(!(scale == scale) || scale == 0.0f) {}
  template <int G>
  [[gnu::always_inline]] inline void groups(int32_t j) const {  // elements [j, j + 64 G)
    __m512i c[G];
    if (zero) {
      for (int g = 0; g < G; ++g) c[g] = _mm512_set1_epi8(char(t->zero_code));
    } else {
      __m512 v[4 * G];
      for (int i = 0; i < 4 * G; ++i) v[i] = _mm512_load_ps(x + j + 16 * i);
      quant::vbmi_encode<G, false>(v, d, *t, c);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_si512(codes + j + 64 * g, c[g]);
  }
};

// The update of one whole block (len a multiple of 64) of an element-wise algorithm with kStates 8-bit
// states, 64 elements at a time: decode the states in registers, apply the rule, write the parameter,
// and keep the new states (x1, x2) and their ranges for the encoding.
template <Algo A, int kStates>
struct BlockUpdate {
  const StepArgs& a;
  const VConsts<V512>& k;
  __m512 lr;
  Ptrs q;
  int64_t lo, b;
  __m512 sc1, sc2;
  float* x1;
  float* x2;
  quant::BitExtremes r1, r2;  // the ranges of x1, x2

  BlockUpdate(const StepArgs& a_, const VConsts<V512>& k_, __m512 lr_, int64_t lo_, float* x1_, float* x2_)
      : a(a_), k(k_), lr(lr_), q(simd_piece_ptrs(a_, lo_, lo_, true, kStates == 2, x1_, x2_, a_.update_params)),
        lo(lo_), b(lo_ / a_.block), sc1(_mm512_set1_ps(a_.absmax1[b])),
        sc2(_mm512_set1_ps(kStates == 2 ? a_.absmax2[b] : 0.0f)), x1(x1_), x2(x2_) {}

  template <int G>
  [[gnu::always_inline]] inline void groups(int32_t j) {  // elements [lo + j, lo + j + 64 G)
    __m512 s1[4 * G], s2[4 * G];
    __m512i c[G];
    for (int g = 0; g < G; ++g) c[g] = _mm512_loadu_si512(a.code1 + lo + j + 64 * g);
    quant::vbmi_values<G>(c, *a.map1, s1);
    if constexpr (kStates == 2) {
      for (int g = 0; g < G; ++g) c[g] = _mm512_loadu_si512(a.code2 + lo + j + 64 * g);
      quant::vbmi_values<G>(c, *a.map2, s2);
    }
    prefetch<G>(j + kPrefetchAhead);
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma GCC unroll 8
    for (int v = 0; v < 4 * G; ++v) {
      const int64_t e = j + 16 * v;
      __m512 m = _mm512_mul_ps(s1[v], sc1);  // quant_decode_one: values[code] * scale
      __m512 w = kStates == 2 ? _mm512_mul_ps(s2[v], sc2) : _mm512_setzero_ps();
      const __m512 g = V512::load_grad(q.grad, q.gdt, e);
      const __m512 p = simd_update<V512, A>(k, g, V512::loadu(q.pin + e), m, w, one, lr);
      if (q.master) V512::storeu(q.master + e, p);
      if (q.param) V512::store_param(q.param, q.pdt, e, p);
      _mm512_store_ps(x1 + e, m);
      r1.add(m);
      if constexpr (kStates == 2) {
        _mm512_store_ps(x2 + e, w);
        r2.add(w);
      }
    }
  }
  // Fetch the gradient, parameter and codes of elements [lo + j, lo + j + 64 G) into L1 ahead of use (the
  // whole step is a few streams through memory, and its compute leaves the hardware prefetchers behind).
  template <int G>
  [[gnu::always_inline]] inline void prefetch(int64_t j) const {
    if (lo + j + 64 * G > a.n) return;
    const char* g = static_cast<const char*>(q.grad) + j * simd_dtype_bytes(q.gdt);
    const char* p = reinterpret_cast<const char*>(q.pin + j);
    for (int l = 0; l < 4 * G; ++l) {
      if (l < 4 * G * simd_dtype_bytes(q.gdt) / 4) _mm_prefetch(g + 64 * l, _MM_HINT_T0);
      _mm_prefetch(p + 64 * l, _MM_HINT_T0);
    }
    for (int i = 0; i < G; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(a.code1 + lo + j + 64 * i), _MM_HINT_T0);
      if constexpr (kStates == 2) _mm_prefetch(reinterpret_cast<const char*>(a.code2 + lo + j + 64 * i), _MM_HINT_T0);
    }
  }
  // The block's scales (written to absmax) and encodings.
  void finish(BlockEncode* e1, BlockEncode* e2) const {
    const float s1 = finite_scale(r1, x1, *a.map1);
    a.absmax1[b] = s1;
    *e1 = BlockEncode(x1, s1, *a.map1, a.code1 + lo);
    if constexpr (kStates == 2) {
      const float s2 = finite_scale(r2, x2, *a.map2);
      a.absmax2[b] = s2;
      *e2 = BlockEncode(x2, s2, *a.map2, a.code2 + lo);
    }
  }
  // The scale of the block's states x with optim_state_finite applied: a NaN scale says that a state is not
  // finite (rare), and only then are the states made finite and their range taken again.
  float finite_scale(const quant::BitExtremes& r, float* x, const QuantTable& t) const {
    const float s = r.scale(t);
    if (s == s) return s;
    for (int32_t i = 0; i < a.block; ++i) x[i] = optim_state_finite(x[i]);
    return quant::block_scale<DType::f32>(x, 0, a.block, t);
  }
};

// The whole blocks software-pipelined: the encoding of block b and the update of block b + 1 run in
// the same loop, 64 G elements of each per iteration. The encoding needs its block's scale, so within a
// block it could only start once the whole block is updated; interleaved, the two independent chains
// (floating-point update, byte-permute encoding) keep each other's execution units busy.
template <Algo A, int kStates, int G>
void fused_step(const StepArgs& a) {
  const OptimConsts c = optim_consts(a.algo, a.h, a.bits);
  const VConsts<V512> k(c);
  const __m512 lr = _mm512_set1_ps(c.lr);
  alignas(64) float bufs[4][kMaxBlock];  // states of two blocks: the one encoded, the one updated
  const int32_t len = a.block;
  const int64_t nfull = a.n / a.block;
  int cur = 0;
  if (nfull > 0) {
    BlockUpdate<A, kStates> u(a, k, lr, 0, bufs[0], bufs[1]);
    for (int32_t j = 0; j < len; j += 64 * G) u.template groups<G>(j);
    BlockEncode e1, e2;
    u.finish(&e1, &e2);
    for (int64_t b = 0; b < nfull; ++b) {
      if (b + 1 < nfull) {
        BlockUpdate<A, kStates> next(a, k, lr, (b + 1) * a.block, bufs[2 - cur], bufs[3 - cur]);
        for (int32_t j = 0; j < len; j += 64 * G) {
          e1.groups<G>(j);
          if constexpr (kStates == 2) e2.groups<G>(j);
          next.template groups<G>(j);
        }
        next.finish(&e1, &e2);
        cur = 2 - cur;
      } else {
        for (int32_t j = 0; j < len; j += 64 * G) {
          e1.groups<G>(j);
          if constexpr (kStates == 2) e2.groups<G>(j);
        }
      }
    }
  }
  if (nfull * a.block < a.n) {  // a partial last block
    int64_t seg = 0;
    simd_step_block<V512, A>(a, c, k, true, kStates == 2, nfull * a.block, a.n, bufs[0], bufs[1], &seg);
  }
}

// The fused loop when it applies: an element-wise algorithm whose 8-bit states are all in use, with
// maps that have VBMI cells and an exact 0 (every standard map but the signed linear one). Two groups
// of 64 per iteration where the block allows: each table then serves 128 elements per load.
template <Algo A>
void step_algo(const StepArgs& a) {
  constexpr int kStates = algo_num_states(A);
  auto fits = [](const QuantTable& t) { return t.cells_ok && t.values[t.zero_code] == 0.0f; };
  const bool fused = a.bits == 8 && a.block % 64 == 0 && a.block <= kMaxBlock && optim_uses_state(A, a.h, 1) &&
                     fits(*a.map1) && (kStates == 1 || (optim_uses_state(A, a.h, 2) && fits(*a.map2)));
  if (fused && a.block % 128 == 0)
    fused_step<A, kStates, 2>(a);
  else if (fused)
    fused_step<A, kStates, 1>(a);
  else
    simd_step<V512, A>(a);
}

}  // namespace

void optim_step_avx512vbmi(const StepArgs& a) {
  switch (a.algo) {
    case Algo::adam: return step_algo<Algo::adam>(a);
    case Algo::adamw: return step_algo<Algo::adamw>(a);
    case Algo::sgd: return step_algo<Algo::sgd>(a);
    case Algo::lion: return step_algo<Algo::lion>(a);
    case Algo::rmsprop: return step_algo<Algo::rmsprop>(a);
    case Algo::adagrad: return step_algo<Algo::adagrad>(a);
    case Algo::lamb: return simd_step<V512, Algo::lamb>(a);
    case Algo::lars: return simd_step<V512, Algo::lars>(a);
  }
}

void optim_norms_avx512vbmi(const StepArgs& a, NormSums* out) { simd_norms_any<V512>(a, out); }

}  // namespace zero8::optim
