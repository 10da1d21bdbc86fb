// AVX-512 VNNI kernel of the per-block int8 product (BlockGemmArgs, zero8/kernels/int8.h): both operands
// packed once per call into panels, then a 4 x 48 register tile per call of the micro-kernel, which sums
// each K-slice in int32 registers and scales it into float32 accumulators at once. Bit-identical to
// int8_block_gemm_ref.
//
// vpdpbusd multiplies unsigned by signed bytes (AVX512_VNNI CPUs need not have vpdpbssd, AVX-VNNI-INT8),
// so A is packed as u8 = a + 128 and each slice's int32 accumulator starts at -128 * (the slice's column
// sum of B), which cancels the offset exactly: sum (a + 128) b - 128 sum b = sum a b. vpdpbusd wraps (no
// saturation), so the sum is exact modulo 2^32 and the true value, |dot| <= 128 * 128 * block <= 2^30,
// is what remains.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "zero8/kernels/int8.h"

// This file is compiled with the AVX-512 F/BW/DQ/VL flags (its _avx512 suffix); vpdpbusd also needs
// AVX512_VNNI, enabled for the functions below only. int8_block_gemm_vnni_supported() gates the calls.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx512vnni")
#endif

namespace zero8::int8 {
namespace {

// Register tile: kMr rows x kNr columns (kNz vectors of 16 int32/float32). 12 int32 slice sums + 12 float32
// accumulators + 3 B vectors + 1 A broadcast = 28 of the 32 zmm registers (GCC keeps the int32 sums in
// registers and moves the float32 ones through L1 once per slice).
constexpr int kMr = 4;
constexpr int kNr = 48;
constexpr int kNz = kNr / 16;
// Cache blocking: an output tile of kMcPanels A panels x kNcPanels B panels (256 x 96, its float32 sums
// 96 KB) is one unit of OpenMP work; the reduction runs in chunks of about kKcBytes of k, so a B
// micro-panel chunk (512 x 48 = 24 KB) stays in the 48 KB L1 while the tile's 64 A panels pass by, and
// the tile's A chunk (256 x 512 = 128 KB) in the 1 MB L2. The sizes are the fastest single-thread choice
// among 16..64 x 2..4 panels and 256..1024 bytes at 512 x 4096 x 4096 on a CPU with those caches (Zen 5);
// other cache sizes may want other values.
constexpr int64_t kMcPanels = 64;
constexpr int64_t kNcPanels = 2;
constexpr int64_t kMc = kMcPanels * kMr;
constexpr int64_t kNc = kNcPanels * kNr;
constexpr int64_t kKcBytes = 512;

// Layout of the packed operands. Panel p of A holds rows p*kMr .. +kMr-1, panel q of B columns q*kNr ..
// +kNr-1; inside a panel, slice s, 4-byte group g, line l: the bytes k = s*block + 4g .. +3 of that line
// at ((s * groups + g) * P + l) * 4 (P = kMr or kNr), zero past the slice or the matrix. The slice length
// is padded to kp, a multiple of 4, so a slice never shares a vpdpbusd group with the next one.
struct Layout {
  int64_t bs = 0, nkb = 0, kp = 0, groups = 0;
  int64_t full = 0;  // leading slices stored exactly (kp == block): words w land at (w * P + l) * 4
  int64_t mp = 0, np = 0;
  int64_t a_panel = 0, b_panel = 0;  // bytes per panel: nkb * kp * P
};

Layout make_layout(const BlockGemmArgs& g) {
  Layout L;
  L.bs = g.block;
  L.nkb = (g.k + L.bs - 1) / L.bs;
  L.kp = (std::min<int64_t>(L.bs, g.k) + 3) / 4 * 4;
  L.groups = L.kp / 4;
  L.full = L.bs % 4 == 0 ? g.k / L.bs : 0;
  L.mp = (g.m + kMr - 1) / kMr;
  L.np = (g.n + kNr - 1) / kNr;
  L.a_panel = L.nkb * L.kp * kMr;
  L.b_panel = L.nkb * L.kp * kNr;
  return L;
}

// One operand to pack: `lines` lines (rows of A, columns of B) of k bytes. line_major: line l at
// src + l * k (contiguous along k); else byte (kk, l) at src + kk * lines. flip is XOR-ed into every
// byte (0x80 makes A's s8 into u8 = a + 128; padding bytes become 0 before the flip).
struct Source {
  const int8_t* src;
  bool line_major;
  int64_t lines, k;
  uint8_t flip;
};

inline int8_t source_at(const Source& s, int64_t l, int64_t kk) {
  return s.line_major ? s.src[l * s.k + kk] : s.src[kk * s.lines + l];
}

// Packs lines [l0, l1) (l1 <= panels * P) into panel storage dst (panel bytes L.*_panel).
// Callers pass l0 at a multiple of 16 and of P, so a 16-line group covers whole 4-line groups of panels
// (P = 4) or sits inside one panel (P = 48).
template <int P>
void pack_lines(const Source& s, const Layout& L, int64_t panel_bytes, uint8_t* dst, int64_t l0, int64_t l1) {
  const int64_t words = L.full * L.bs / 4;  // word-aligned region: slices [0, full)
  static_assert(P % 16 == 0 || 16 % P == 0, "16-line groups must tile the panels");
  const uint32_t flip32 = 0x01010101u * s.flip;
  auto word_at = [&](int64_t l, int64_t w) { return dst + (l / P) * panel_bytes + (w * P + l % P) * 4; };
  // Words [w, words) of lines [l, l + count) of a line-major source, one at a time (past the vectors).
  auto copy_words_from = [&](int64_t l, int count, int64_t w) {
    for (int i = 0; i < count; ++i)
      for (int64_t v = w; v < words; ++v) {
        uint32_t x;
        std::memcpy(&x, s.src + (l + i) * s.k + v * 4, 4);
        x ^= flip32;
        std::memcpy(word_at(l + i, v), &x, 4);
      }
  };
  const __m512i flip512 = _mm512_set1_epi8(char(s.flip));
  const __m128i flip128 = _mm_set1_epi8(char(s.flip));
  int64_t l = l0;
  if (s.line_major && P % 16 == 0) {
    // 16 lines x 16 words: a 16 x 16 dword transpose (unpack 32, unpack 64, then two 128-bit lane
    // shuffles); o[w] is word w of the 16 lines, one whole 64-byte line of the packed panel.
    for (; l + 16 <= std::min(l1, s.lines); l += 16) {
      int64_t w = 0;
      for (; w + 16 <= words; w += 16) {
        __m512i r[16], t[16], o[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(s.src + (l + i) * s.k + w * 4);
        for (int i = 0; i < 8; ++i) {
          t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int j = 0; j < 4; ++j) {  // r: lane L of r[4j + c] is word 4L + c of lines 4j .. 4j+3
          r[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
          r[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
          r[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
          r[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
        }
        for (int c = 0; c < 4; ++c) {  // 4 x 4 transpose of 128-bit lanes
          const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
          const __m512i x2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
          const __m512i x3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
          o[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
          o[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
          o[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
          o[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
        }
        for (int v = 0; v < 16; ++v) _mm512_storeu_si512(word_at(l, w + v), _mm512_xor_si512(o[v], flip512));
      }
      copy_words_from(l, 16, w);
    }
  } else if (s.line_major) {
    // 4 lines x 16 words: a 4 x 4 dword transpose inside each 128-bit lane; lane L of u[j] is word
    // 4L + j of the 4 lines, 16 contiguous bytes of the packed panel.
    for (; l + 4 <= std::min(l1, s.lines); l += 4) {
      int64_t w = 0;
      for (; w + 16 <= words; w += 16) {
        __m512i r[4];
        for (int t = 0; t < 4; ++t) r[t] = _mm512_loadu_si512(s.src + (l + t) * s.k + w * 4);
        const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
        __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                        _mm512_unpackhi_epi64(t1, t3)};
        for (int j = 0; j < 4; ++j) {
          u[j] = _mm512_xor_si512(u[j], flip512);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(word_at(l, w + j)), _mm512_castsi512_si128(u[j]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(word_at(l, w + 4 + j)), _mm512_extracti32x4_epi32(u[j], 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(word_at(l, w + 8 + j)), _mm512_extracti32x4_epi32(u[j], 2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(word_at(l, w + 12 + j)), _mm512_extracti32x4_epi32(u[j], 3));
        }
      }
      copy_words_from(l, 4, w);
    }
  } else {
    // 16 lines x 4 rows of k: interleave the bytes of the 4 rows (unpack 8 then 16 bits); q[j] holds lines
    // 4j .. 4j+3 as [k0 k1 k2 k3] each, 16 contiguous bytes of the packed panel (P is a multiple of 4).
    for (; l + 16 <= std::min(l1, s.lines); l += 16) {
      for (int64_t w = 0; w < words; ++w) {
        __m128i r[4];
        for (int t = 0; t < 4; ++t)
          r[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.src + (w * 4 + t) * s.lines + l));
        const __m128i a_lo = _mm_unpacklo_epi8(r[0], r[1]), a_hi = _mm_unpackhi_epi8(r[0], r[1]);
        const __m128i b_lo = _mm_unpacklo_epi8(r[2], r[3]), b_hi = _mm_unpackhi_epi8(r[2], r[3]);
        const __m128i q[4] = {_mm_unpacklo_epi16(a_lo, b_lo), _mm_unpackhi_epi16(a_lo, b_lo),
                              _mm_unpacklo_epi16(a_hi, b_hi), _mm_unpackhi_epi16(a_hi, b_hi)};
        for (int j = 0; j < 4; ++j)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(word_at(l + 4 * j, w)), _mm_xor_si128(q[j], flip128));
      }
    }
  }
  // Lines left over (and padding lines past the matrix): byte by byte over the word-aligned region.
  for (int64_t x = l; x < l1; ++x)
    for (int64_t w = 0; w < words; ++w)
      for (int t = 0; t < 4; ++t)
        word_at(x, w)[t] = uint8_t(x < s.lines ? source_at(s, x, w * 4 + t) : 0) ^ s.flip;
  // The remaining (partial or unaligned) slices, byte by byte with padding.
  for (int64_t x = l0; x < l1; ++x) {
    uint8_t* panel = dst + (x / P) * panel_bytes;
    for (int64_t sl = L.full; sl < L.nkb; ++sl) {
      const int64_t k0 = sl * L.bs, len = std::min(L.bs, s.k - k0);
      for (int64_t kk = 0; kk < L.kp; ++kk) {
        const int8_t v = x < s.lines && kk < len ? source_at(s, x, k0 + kk) : 0;
        panel[sl * L.kp * P + ((kk / 4) * P + x % P) * 4 + kk % 4] = uint8_t(v) ^ s.flip;
      }
    }
  }
}

// Per-panel side data: A's row scales [panel][slice][kMr]; B's column scales and offset corrections
// (-128 * column sum of the slice) [panel][slice][kNr], the sums taken from the packed bytes.
void pack_a_scales(const BlockGemmArgs& g, const Layout& L, float* as, int64_t p) {
  const int64_t nmb = (g.m + L.bs - 1) / L.bs;
  for (int r = 0; r < kMr; ++r) {
    const int64_t i = p * kMr + r, ib = i / L.bs;
    float* dst = as + p * L.nkb * kMr + r;
    for (int64_t s = 0; s < L.nkb; ++s)
      dst[s * kMr] = i >= g.m ? 0.0f : g.a_trans ? g.a_scale[s * nmb + ib] : g.a_scale[ib * L.nkb + s];
  }
}

void pack_b_side(const BlockGemmArgs& g, const Layout& L, const int8_t* bp, int32_t* bc, float* bsc, int64_t q) {
  const int64_t nnb = (g.n + L.bs - 1) / L.bs;
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t s = 0; s < L.nkb; ++s) {
    const int8_t* slice = bp + q * L.b_panel + s * L.kp * kNr;
    for (int z = 0; z < kNz; ++z) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t gi = 0; gi < L.groups; ++gi)
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(slice + (gi * kNr + z * 16) * 4));
      _mm512_storeu_si512(bc + (q * L.nkb + s) * kNr + z * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
    }
  }
  for (int c = 0; c < kNr; ++c) {
    const int64_t j = q * kNr + c, jb = j / L.bs;
    float* dst = bsc + q * L.nkb * kNr + c;
    for (int64_t s = 0; s < L.nkb; ++s)
      dst[s * kNr] = j >= g.n ? 0.0f : g.b_trans ? g.b_scale[jb * L.nkb + s] : g.b_scale[s * nnb + jb];
  }
}

// The micro-kernel: slices [0, nslices) of one A panel and one B panel (pointers at the chunk's first
// slice) into the kMr x kNr float32 tile c (row stride ldc), which holds the previous chunks' sums when
// `load` (else starts at 0). Per slice: int32 sums by vpdpbusd from the offset correction, then
// acc = acc + float(sum) * (row scale * column scale), int8_block_accumulate's order and rounding.
// G (4-byte groups per slice) is a template constant for the common blocks so the slice loop unrolls
// fully (with a run-time count GCC shuffled the accumulators between registers at every step); G = 0
// reads it from `groups`.
template <int G, bool kUniformRows>
void micro_kernel(const uint8_t* ap, const float* as, const int8_t* bp, const int32_t* bc, const float* bsc,
                  int64_t nslices, int64_t groups, float* c, int64_t ldc, bool load) {
  if constexpr (G > 0) groups = G;
  __m512 f[kMr][kNz];
  for (int r = 0; r < kMr; ++r)
    for (int z = 0; z < kNz; ++z) f[r][z] = load ? _mm512_loadu_ps(c + r * ldc + z * 16) : _mm512_setzero_ps();
  for (int64_t s = 0; s < nslices; ++s) {
    __m512i acc[kMr][kNz];
    for (int z = 0; z < kNz; ++z) {
      const __m512i corr = _mm512_loadu_si512(bc + s * kNr + z * 16);
      for (int r = 0; r < kMr; ++r) acc[r][z] = corr;
    }
    const uint8_t* a = ap + s * groups * kMr * 4;
    const int8_t* b = bp + s * groups * kNr * 4;
#pragma GCC unroll 32
    for (int64_t gi = 0; gi < groups; ++gi) {
      __m512i bv[kNz];
      for (int z = 0; z < kNz; ++z) bv[z] = _mm512_loadu_si512(b + (gi * kNr + z * 16) * 4);
      for (int r = 0; r < kMr; ++r) {
        int32_t aw;
        std::memcpy(&aw, a + (gi * kMr + r) * 4, 4);
        const __m512i av = _mm512_set1_epi32(aw);
        for (int z = 0; z < kNz; ++z) acc[r][z] = _mm512_dpbusd_epi32(acc[r][z], av, bv[z]);
      }
    }
    if constexpr (kUniformRows) {
      // The panel's rows share one row block: 3 scale products per slice instead of 12.
      const __m512 rs = _mm512_set1_ps(as[s * kMr]);
      __m512 scale[kNz];
      for (int z = 0; z < kNz; ++z) scale[z] = _mm512_mul_ps(rs, _mm512_loadu_ps(bsc + s * kNr + z * 16));
      for (int r = 0; r < kMr; ++r)
        for (int z = 0; z < kNz; ++z)
          f[r][z] = _mm512_add_ps(f[r][z], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][z]), scale[z]));
    } else {
      for (int r = 0; r < kMr; ++r) {
        const __m512 rs = _mm512_set1_ps(as[s * kMr + r]);
        for (int z = 0; z < kNz; ++z) {
          const __m512 scale = _mm512_mul_ps(rs, _mm512_loadu_ps(bsc + s * kNr + z * 16));
          f[r][z] = _mm512_add_ps(f[r][z], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][z]), scale));
        }
      }
    }
  }
  for (int r = 0; r < kMr; ++r)
    for (int z = 0; z < kNz; ++z) _mm512_storeu_ps(c + r * ldc + z * 16, f[r][z]);
}

using MicroKernel = void (*)(const uint8_t*, const float*, const int8_t*, const int32_t*, const float*, int64_t,
                             int64_t, float*, int64_t, bool);

// The kernel for a layout: G fixed for slices of 32 (Jetfire's block), 64 and 128 bytes; rows uniform when
// the block is a multiple of kMr (a panel, which starts at a multiple of kMr, then lies in one row block;
// padding rows past m borrow its scale, and their outputs are never stored).
MicroKernel micro_kernel_for(const Layout& L) {
  if (L.bs % kMr != 0) return &micro_kernel<0, false>;
  switch (L.groups) {
    case 8: return &micro_kernel<8, true>;
    case 16: return &micro_kernel<16, true>;
    case 32: return &micro_kernel<32, true>;
    default: return &micro_kernel<0, true>;
  }
}

// Up to 16 outputs (mask) of value v, + bias, stored at out[idx..] as dtype with dtype_store's rounding:
// bf16 to nearest even with NaN kept quiet, fp16 by vcvtps2ph (round to nearest even, as f32_to_f16).
void store_row(void* out, DType dtype, int64_t idx, __m512 v, __mmask16 mask) {
  if (dtype == DType::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + idx, mask, v);
    return;
  }
  __m256i h;
  if (dtype == DType::f16) {
    h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
  }
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + idx, mask, h);
}

// The packing workspace of the calling thread, grown as needed and kept for its next call (freed when the
// thread exits). Fresh pages are what makes a per-call allocation slow: the first touch of a 4 KB page
// faults, and for a large product's panels those faults can cost more than the product itself
// (docs/INT8.md). Transparent huge pages (madvise) make a regrowth several times cheaper.
class Workspace {
 public:
  ~Workspace() { std::free(p_); }
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      std::free(p_);
      size_ = (bytes + kHuge - 1) / kHuge * kHuge;
      p_ = std::aligned_alloc(kHuge, size_);
      if (!p_) {
        size_ = 0;
        throw std::bad_alloc();
      }
#ifdef MADV_HUGEPAGE
      madvise(p_, size_, MADV_HUGEPAGE);
#endif
    }
    return static_cast<uint8_t*>(p_);
  }

 private:
  static constexpr size_t kHuge = size_t(2) << 20;
  void* p_ = nullptr;
  size_t size_ = 0;
};

// Carves 64-byte aligned pieces out of a workspace, in order.
struct Carver {
  size_t used = 0;
  size_t take(size_t bytes) {
    const size_t at = used;
    used += (bytes + 63) / 64 * 64;
    return at;
  }
};

}  // namespace

void int8_block_gemm_vnni(const BlockGemmArgs& g, int threads) {
  const Layout L = make_layout(g);
  const int64_t tm = (L.mp + kMcPanels - 1) / kMcPanels, tn = (L.np + kNcPanels - 1) / kNcPanels;
  const int64_t spc = std::max<int64_t>(1, kKcBytes / L.kp);  // slices per reduction chunk
  const MicroKernel kernel = micro_kernel_for(L);
  // Threads: as asked, else OpenMP's default but one per 2^24 multiply-adds (a parallel region costs
  // more than it saves below that), never more than there are output tiles.
  const int64_t work = g.m * g.n * g.k;
  const int64_t want = threads > 0 ? threads : std::min<int64_t>(omp_get_max_threads(), work >> 24);
  const int nt = int(std::max<int64_t>(1, std::min(want, tm * tn)));

  // Packed operands, side data and one output tile per thread: about (m + n) * k bytes in all.
  Carver cv;
  const size_t a_at = cv.take(size_t(L.mp * L.a_panel)), b_at = cv.take(size_t(L.np * L.b_panel));
  const size_t as_at = cv.take(size_t(L.mp * L.nkb * kMr) * 4), bc_at = cv.take(size_t(L.np * L.nkb * kNr) * 4);
  const size_t bs_at = cv.take(size_t(L.np * L.nkb * kNr) * 4), w_at = cv.take(size_t(kMc * kNc * nt) * 4);
  thread_local Workspace workspace;
  uint8_t* base = workspace.get(cv.used);
  auto* ap = base + a_at;
  auto* bp = reinterpret_cast<int8_t*>(base + b_at);
  auto* as = reinterpret_cast<float*>(base + as_at);
  auto* bc = reinterpret_cast<int32_t*>(base + bc_at);
  auto* bsc = reinterpret_cast<float*>(base + bs_at);
  auto* w_all = reinterpret_cast<float*>(base + w_at);

  const Source sa{g.a, !g.a_trans, g.m, g.k, 0x80};
  const Source sb{g.b, g.b_trans, g.n, g.k, 0x00};
  // Packing units: 16 lines (4 A panels) or one B panel, so the 16-line paths stay inside a unit.
  const int64_t a_units = (L.mp * kMr + 15) / 16, b_units = L.np;

#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < a_units; ++u) {
      pack_lines<kMr>(sa, L, L.a_panel, ap, u * 16, std::min(L.mp * kMr, u * 16 + 16));
      for (int64_t p = u * 16 / kMr; p < std::min(L.mp, (u + 1) * 16 / kMr); ++p) pack_a_scales(g, L, as, p);
    }
    // The column sums read each B panel right after it is written, while it is in L2.
#pragma omp for schedule(static)
    for (int64_t u = 0; u < b_units; ++u) {
      pack_lines<kNr>(sb, L, L.b_panel, reinterpret_cast<uint8_t*>(bp), u * kNr, u * kNr + kNr);
      pack_b_side(g, L, bp, bc, bsc, u);
    }

    float* w = w_all + omp_get_thread_num() * kMc * kNc;
    // Consecutive tiles share their A rows (kept in L2 across the tile row).
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tm * tn; ++t) {
      const int64_t p0 = (t / tn) * kMcPanels, p1 = std::min(L.mp, p0 + kMcPanels);
      const int64_t q0 = (t % tn) * kNcPanels, q1 = std::min(L.np, q0 + kNcPanels);
      for (int64_t c0 = 0; c0 < L.nkb; c0 += spc) {
        const int64_t ns = std::min(spc, L.nkb - c0);
        for (int64_t q = q0; q < q1; ++q) {
          const int8_t* bq = bp + q * L.b_panel + c0 * L.kp * kNr;
          const int32_t* bcq = bc + (q * L.nkb + c0) * kNr;
          const float* bsq = bsc + (q * L.nkb + c0) * kNr;
          for (int64_t p = p0; p < p1; ++p)
            kernel(ap + p * L.a_panel + c0 * L.kp * kMr, as + (p * L.nkb + c0) * kMr, bq, bcq, bsq, ns,
                         L.groups, w + (p - p0) * kMr * kNc + (q - q0) * kNr, kNc, c0 > 0);
        }
      }
      // The tile's outputs: + bias, rounded to the output dtype.
      const int64_t i0 = p0 * kMr, i1 = std::min(g.m, p1 * kMr), j0 = q0 * kNr, j1 = std::min(g.n, q1 * kNr);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; j += 16) {
          const int64_t cnt = std::min<int64_t>(16, j1 - j);
          const __mmask16 mask = __mmask16((1u << cnt) - 1u);
          __m512 v = _mm512_loadu_ps(w + (i - i0) * kNc + (j - j0));
          if (g.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, g.bias + j));
          store_row(g.out, g.out_dtype, i * g.n + j, v, mask);
        }
    }
  }
}

}  // namespace zero8::int8

#if defined(__clang__)
#pragma clang attribute pop
#endif
