// Scalar reference of the block-wise codec: the plain definition every fast variant is checked against.
#include <algorithm>

#include "codec_internal.h"
#include "zero8/kernels/codec.h"

namespace zero8::quant {

void quant_encode_ref(const EncodeArgs& a) {
  const QuantTable& t = *a.table;
  const int64_t nblocks = (a.n + a.block - 1) / a.block;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * a.block, hi = std::min<int64_t>(a.n, lo + a.block);
    float vmin = 0.0f, vmax = 0.0f;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      const float x = dtype_load(a.x, a.dtype, i);
      finite = finite && (x - x == 0.0f);
      vmin = std::min(vmin, x);
      vmax = std::max(vmax, x);
    }
    const float nan = f32_from_bits(0x7fc00000u);
    const float scale = finite ? quant_block_scale(vmin, vmax, t) : nan;
    a.absmax[b] = scale;
    for (int64_t i = lo; i < hi; ++i) {
      const float x = dtype_load(a.x, a.dtype, i);
      const float u = a.stochastic ? rng_uniform(a.seed, a.index_base + uint64_t(i)) : 0.0f;
      a.codes[i] = uint8_t(quant_encode_one(x, scale, t, a.stochastic, u));
    }
  }
}

float quant_block_encode_f32_ref(const float* x, int32_t len, const QuantTable& t, uint8_t* codes) {
  EncodeArgs a;
  a.x = x;
  a.n = len;
  a.block = len;
  a.table = &t;
  a.codes = codes;
  float scale = 0.0f;
  a.absmax = &scale;
  quant_encode_ref(a);
  return scale;
}

void quant_block_decode_f32_ref(const uint8_t* codes, int32_t len, float scale, const QuantTable& t, float* y) {
  for (int32_t i = 0; i < len; ++i) y[i] = quant_decode_one(codes[i], scale, t);
}

void quant_decode_ref(const DecodeArgs& a) {
  const QuantTable& t = *a.table;
  for (int64_t i = 0; i < a.n; ++i) {
    const float v = quant_decode_one(a.codes[i], a.absmax[i / a.block], t);
    if (a.accumulate)
      static_cast<float*>(a.y)[i] += v;
    else
      dtype_store(a.y, a.dtype, i, v);
  }
}

}  // namespace zero8::quant
