// Runtime CPU dispatch: which SIMD variant runs. Detected once by cpuid plus OS support (XGETBV);
// ZERO8_ISA=scalar|avx2|avx512 forces one (an error if this CPU cannot run it), so tests cover all.
#pragma once

namespace zero8 {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // CPU and OS can run it (and this build compiled it)
Isa isa_best();               // best supported, ignoring the environment
Isa isa_active();             // ZERO8_ISA if set (validated), else isa_best(); read once

}  // namespace zero8
