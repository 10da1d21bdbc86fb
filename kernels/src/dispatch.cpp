// CPU feature detection (with the AVX-512 extensions VBMI and VNNI), the ZERO8_ISA override and the
// AVX-512 VBMI setting (ZERO8_AVX512_VBMI).
#include "zero8/kernels/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zero8/error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace zero8 {
namespace {

#if defined(__x86_64__)
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}
#endif

bool cpu_has(Isa isa) {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return false;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return false;  // OS saves XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
  if (isa == Isa::avx2) return avx2 && fma && f16c && bmi2;
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool os512 = (xcr0 & 0xe6) == 0xe6;  // opmask, ZMM_Hi256, Hi16_ZMM
  return avx2 && fma && f16c && bmi2 && f && dq && bw && vl && os512;
#else
  (void)isa;
  return false;
#endif
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  if (isa == Isa::scalar) return true;
#if ZERO8_WITH_X86_SIMD
  static const bool has_avx2 = cpu_has(Isa::avx2), has_avx512 = cpu_has(Isa::avx512);
  return isa == Isa::avx2 ? has_avx2 : has_avx512;
#else
  return false;
#endif
}

Isa isa_best() {
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

// Environment: ZERO8_ISA = scalar | avx2 | avx512 forces the CPU variant (read once per process).
Isa isa_active() {
  static const Isa active = [] {
    const char* env = std::getenv("ZERO8_ISA");
    if (!env || !*env) return isa_best();
    const std::string s(env);
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
      if (s != isa_name(isa)) continue;
      if (!isa_supported(isa))
        ZERO8_THROW(unsupported, "ZERO8_ISA=" << s << " but this CPU/OS or build cannot run " << s);
      return isa;
    }
    ZERO8_THROW(invalid_argument, "ZERO8_ISA=" << s << " is not one of scalar, avx2, avx512");
  }();
  return active;
}

namespace {

// AVX-512 (isa_supported) and the AVX-512 extension in cpuid leaf 7, subleaf 0, ECX bit `bit`.
bool avx512_with_leaf7_ecx(unsigned bit) {
#if ZERO8_WITH_X86_SIMD && defined(__x86_64__)
  unsigned a, b, c, d;
  return isa_supported(Isa::avx512) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << bit)) != 0;
#else
  (void)bit;
  return false;
#endif
}

}  // namespace

// cpuid leaf 7, subleaf 0, ECX: bit 1 is AVX512_VBMI, bit 11 AVX512_VNNI (Intel SDM vol. 2A, CPUID).
bool isa_avx512_vbmi_supported() {
  static const bool vbmi = avx512_with_leaf7_ecx(1);
  return vbmi;
}

bool isa_avx512_vnni_supported() {
  static const bool vnni = avx512_with_leaf7_ecx(11);
  return vnni;
}

namespace {

// Environment: ZERO8_AVX512_VBMI = 0 | 1 (read once, at the first use of the setting).
bool vbmi_default() {
  const char* env = std::getenv("ZERO8_AVX512_VBMI");
  if (!env || !*env) return isa_avx512_vbmi_supported();
  const std::string s(env);
  if (s == "0") return false;
  if (s != "1") ZERO8_THROW(invalid_argument, "ZERO8_AVX512_VBMI=" << s << " is not 0 or 1");
  if (!isa_avx512_vbmi_supported())
    ZERO8_THROW(unsupported, "ZERO8_AVX512_VBMI=1 but this CPU/OS or build has no AVX-512 VBMI");
  return true;
}

std::atomic<int>& vbmi_setting() {  // -1: not read yet
  static std::atomic<int> on{-1};
  return on;
}

// The value of a process-wide setting held in `slot` (-1 until first read): at the first read, what
// from_env() gives (the first reader's value stands; a setter may replace it at any time).
template <class F>
int setting_value(std::atomic<int>& slot, F from_env) {
  int v = slot.load(std::memory_order_relaxed);
  if (v < 0) {
    int unset = -1;
    slot.compare_exchange_strong(unset, from_env());
    v = slot.load(std::memory_order_relaxed);
  }
  return v;
}

}  // namespace

bool isa_avx512_vbmi() { return setting_value(vbmi_setting(), [] { return vbmi_default() ? 1 : 0; }) == 1; }

void isa_set_avx512_vbmi(bool on) {
  if (on && !isa_avx512_vbmi_supported())
    ZERO8_THROW(unsupported, "AVX-512 VBMI requested but this CPU/OS or build has no AVX-512 VBMI");
  vbmi_setting().store(on ? 1 : 0, std::memory_order_relaxed);
}

const char* cuda_quant_kernels_name(CudaQuantKernels k) { return k == CudaQuantKernels::warp ? "warp" : "block"; }

CudaQuantKernels cuda_quant_kernels_parse(const char* name, const char* what) {
  for (CudaQuantKernels k : {CudaQuantKernels::block, CudaQuantKernels::warp})
    if (std::strcmp(name, cuda_quant_kernels_name(k)) == 0) return k;
  ZERO8_THROW(invalid_argument, what << "=" << name << " is not one of block, warp");
}

namespace {

std::atomic<int>& cuda_quant_kernels_setting() {  // -1: ZERO8_CUDA_QUANT_KERNELS not read yet
  static std::atomic<int> k{-1};
  return k;
}

}  // namespace

CudaQuantKernels cuda_quant_kernels() {
  return CudaQuantKernels(setting_value(cuda_quant_kernels_setting(), [] {
    const char* env = std::getenv("ZERO8_CUDA_QUANT_KERNELS");
    return int(env && *env ? cuda_quant_kernels_parse(env, "ZERO8_CUDA_QUANT_KERNELS") : CudaQuantKernels::warp);
  }));
}

void set_cuda_quant_kernels(CudaQuantKernels k) {
  cuda_quant_kernels_setting().store(int(k), std::memory_order_relaxed);
}

}  // namespace zero8
