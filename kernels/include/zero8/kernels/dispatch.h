// Runtime dispatch: which SIMD variant runs. Detected once by cpuid plus OS support (XGETBV);
// ZERO8_ISA=scalar|avx2|avx512 forces one (an error if this CPU cannot run it), so tests cover all.
// Also which form of the CUDA 8-bit kernels runs (CudaQuantKernels).
#pragma once

namespace zero8 {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // CPU and OS can run it (and this build compiled it)
Isa isa_best();               // best supported, ignoring the environment
Isa isa_active();             // ZERO8_ISA if set (validated), else isa_best(); read once

// AVX512_VBMI (byte permutes; Ice Lake, Zen 4 and later) inside the avx512 variant: the codec and the
// 8-bit optimizers do their table lookups with it when it is on (same results, fewer instructions).
// On by default where supported; ZERO8_AVX512_VBMI=0|1 sets it at start (1 is an error where
// unsupported), isa_set_avx512_vbmi while no kernel runs (tests and benchmarks cover both paths).
bool isa_avx512_vbmi_supported();  // CPU has AVX-512 (isa_supported) and AVX512_VBMI
bool isa_avx512_vbmi();            // the avx512 variant uses its VBMI code now
void isa_set_avx512_vbmi(bool on); // throws zero8::Error (unsupported) for on where unsupported

// AVX512_VNNI (int8 dot products; Ice Lake, Zen 4 and later): the per-block int8 GEMM uses it.
bool isa_avx512_vnni_supported();  // CPU has AVX-512 (isa_supported) and AVX512_VNNI

// How the CUDA 8-bit kernels (the optimizer step, the codec's quantize and dequantize) spread their work;
// both give the CPU reference's bits:
// - block: one CUDA block per quantization block, the map read from global memory, the block's min/max
//   through shared memory, each code by the exact binary search after a division; one element per thread.
// - warp: persistent CUDA blocks holding the maps and their search accelerators in shared memory, one
//   warp per quantization block, min/max by shuffles, each code by the accelerator (quant_encode_accel:
//   the encoding of the AVX-512 VBMI CPU code), several elements per lane. Where a kernel has no warp
//   form (an optimizer state block above 256 elements, stochastic rounding), the block one runs.
// `warp` is the default: on an H200 both gave the reference's bits (and compute-sanitizer found nothing),
// and warp ran the 8-bit AdamW step 3.8x and the codec 2.9x as fast (docs/BENCHMARKS.md, "GPU"). Set per
// process: ZERO8_CUDA_QUANT_KERNELS=block|warp at start (another value: Error invalid_argument at the
// first use), set_cuda_quant_kernels while no kernel runs. Builds without CUDA keep the setting unused.
enum class CudaQuantKernels : unsigned char { block = 0, warp = 1 };
const char* cuda_quant_kernels_name(CudaQuantKernels k);  // "block", "warp"
// The kernels of a name; another: Error invalid_argument "<what>=<name> is not one of block, warp".
CudaQuantKernels cuda_quant_kernels_parse(const char* name, const char* what);
CudaQuantKernels cuda_quant_kernels();
void set_cuda_quant_kernels(CudaQuantKernels k);
// Sets the form for its lifetime, then restores the one before (tests and benchmarks that run both).
class CudaQuantKernelsScope {
 public:
  explicit CudaQuantKernelsScope(CudaQuantKernels k) : before_(cuda_quant_kernels()) { set_cuda_quant_kernels(k); }
  ~CudaQuantKernelsScope() { set_cuda_quant_kernels(before_); }
  CudaQuantKernelsScope(const CudaQuantKernelsScope&) = delete;
  CudaQuantKernelsScope& operator=(const CudaQuantKernelsScope&) = delete;

 private:
  CudaQuantKernels before_;
};

}  // namespace zero8
