// AVX-512 variant of the fused optimizers: 16 lanes of the loop in optim_simd.h, with the codec's
// AVX-512 block helpers for the 8-bit states. Bit-identical to optim_ref.cpp (tests/cpp/test_optim.cpp).
// GCC 12's intrinsic headers initialize their "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "codec_internal.h"

#define ZERO8_OPTIM_BLOCK_DECODE quant::quant_block_decode_f32_avx512
#define ZERO8_OPTIM_BLOCK_ENCODE quant::quant_block_encode_f32_avx512
#include "optim_simd.h"
#include "optim_v512.h"

namespace zero8::optim {

void optim_step_avx512(const StepArgs& a) { simd_step_any<V512>(a); }
void optim_norms_avx512(const StepArgs& a, NormSums* out) { simd_norms_any<V512>(a, out); }

}  // namespace zero8::optim
