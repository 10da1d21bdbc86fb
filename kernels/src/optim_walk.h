// How the fused optimizers walk a range, shared by the scalar reference (optim_ref.cpp) and the SIMD
// loop (optim_simd.h), so both cut it into the same pieces and fold the norm sums in the same order:
// a piece is the part of a state block inside one segment (one trust ratio), and phase 1 adds the
// pieces' sums into one running sum per (segment, norm chunk) pair, folded into the segment's total
// when the pair changes (the order optim_math.h fixes). Internal linkage only (an anonymous namespace),
// as optim_simd.h explains.
#pragma once

#include <cstdint>

#include "zero8/kernels/optim.h"

namespace zero8::optim {
namespace {

// The end of the piece starting at element i of a block ending at hi: the block end, or the end of
// segment *seg (advanced to the segment holding i).
inline int64_t optim_piece_end(const StepArgs& a, int64_t i, int64_t hi, int64_t* seg) {
  if (a.nseg <= 0) return hi;
  while (a.seg_offsets[*seg + 1] <= i) ++*seg;
  const int64_t e = a.seg_offsets[*seg + 1];
  return e < hi ? e : hi;
}

// The running (segment, chunk) sums of phase 1 over out[0, nseg) (zeroed here).
class NormFold {
 public:
  NormFold(NormSums* out, int64_t nseg) : out_(out) {
    for (int64_t s = 0; s < nseg; ++s) out_[s] = NormSums{};
  }
  // The sums of one piece of segment seg in norm chunk chunk.
  void add(int64_t seg, int64_t chunk, double w_sq, double u_sq) {
    if (seg != seg_ || chunk != chunk_) {
      flush();
      acc_ = NormSums{};
      seg_ = seg;
      chunk_ = chunk;
    }
    acc_.w_sq += w_sq;
    acc_.u_sq += u_sq;
  }
  // Folds the last running sum; call once, after the last piece.
  void finish() { flush(); }

 private:
  void flush() {
    if (seg_ < 0) return;
    out_[seg_].w_sq += acc_.w_sq;
    out_[seg_].u_sq += acc_.u_sq;
  }
  NormSums* out_;
  NormSums acc_{};
  int64_t seg_ = -1, chunk_ = -1;
};

}  // namespace
}  // namespace zero8::optim
