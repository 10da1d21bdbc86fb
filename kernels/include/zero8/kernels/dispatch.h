// Runtime CPU dispatch: which SIMD variant runs. Detected once by cpuid plus OS support (XGETBV);
// ZERO8_ISA=scalar|avx2|avx512 forces one (an error if this CPU cannot run it), so tests cover all.
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

}  // namespace zero8
