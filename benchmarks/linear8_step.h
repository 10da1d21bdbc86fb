// A yardstick for `zero8-bench optimizer`: an 8-bit block-wise AdamW step with *linear* int8 codes
// (decode = convert and scale, encode = scale, round, saturate). It moves exactly the bytes of zero8's
// 8-bit step (fp32 parameter and gradient, one code per state and element, one float32 scale per state
// and block) and zero8's AdamW update, with about the least arithmetic an 8-bit block-wise step can do,
// so its time is what any 8-bit step with that traffic can hope for on the machine it runs on. It is not
// a zero8 optimizer: its codes are not the dynamic map's and nothing outside this benchmark uses it.
#pragma once

#include <cstdint>

#include "zero8/kernels/dispatch.h"
#include "zero8/optim.h"

namespace zero8::bench {

// One AdamW step (decoupled weight decay, bias-corrected) over n float32 parameters, in place. State 1
// (signed): code1 * scale1[b] / 127; state 2 (non-negative): code2 * scale2[b] / 255. Block b's new
// scale is its largest |state|.
struct Linear8Args {
  float* param = nullptr;
  const float* grad = nullptr;
  int8_t* code1 = nullptr;
  uint8_t* code2 = nullptr;
  float* scale1 = nullptr;
  float* scale2 = nullptr;
  int64_t n = 0;
  int32_t block = 256;  // power of two, 64..4096
  // The update's constants, as optim_consts computes them for 8-bit AdamW: p = p * decay - step *
  // clamp(m / (sqrt(v) + eps_hat), +-ratio_max), m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2.
  float b1 = 0.9f, b2 = 0.999f, decay = 1.0f, step = 1e-3f, eps_hat = 1e-8f, ratio_max = 7.27f;
};

// Sets the update constants from h's lr, betas, eps, weight decay and 1-based step, as zero8's AdamW
// step reads them.
void linear8_set_hyper(Linear8Args& a, const optim::Hyper& h);

// Elements [lo, hi) (lo on a block boundary, hi on one or at n). The reference is plain C++; the SIMD
// variants give the same bits (each vector op is the reference's float op) and leave a partial last
// block to it.
void linear8_step_ref(const Linear8Args& a, int64_t lo, int64_t hi);
void linear8_step_avx2(const Linear8Args& a, int64_t lo, int64_t hi);
void linear8_step_avx512(const Linear8Args& a, int64_t lo, int64_t hi);

// The whole step on `threads` threads, chunks of whole blocks handed out as zero8's step hands them
// out, with the variant of `isa`.
void linear8_step(const Linear8Args& a, Isa isa, int threads);

}  // namespace zero8::bench
