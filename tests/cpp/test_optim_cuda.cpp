// CUDA fused optimizers against the CPU scalar reference: the step must match bit for bit (same
// element math, no FMA contraction on either side); the LAMB/LARS norms to 1e-12 relative (double
// sums in another order). Skips with the reason when the build has no CUDA or the machine no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "zero8/kernels/device.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/optim.h"
#include "zero8/kernels/quant_map.h"
#include "zero8/optim.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace zero8;
using namespace zero8::optim;
using zero8::CudaQuantKernels;
using zero8::CudaQuantKernelsScope;

#if ZERO8_WITH_CUDA

// Why CUDA tests cannot run here, or empty when a device is present.
std::string cuda_unavailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
  if (count == 0) return "no CUDA device on this machine";
  return "";
}

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device copy of a host buffer, copied back on demand.
template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(const std::vector<T>& h) : n(h.size()) {
    if (n == 0) return;
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DevBuf() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

Hyper hyper_for(Algo a) {
  Hyper h;
  h.weight_decay = 1e-2f;
  if (a == Algo::sgd || a == Algo::lars) h.beta1 = 0.9f;
  if (a == Algo::adagrad) h.eps = 1e-10f;
  return h;
}

// Three steps of `algo` on the device and in the CPU reference, compared bit for bit after each. map1:
// the first state's map (the standard ones, or the signed linear map, which has no exact 0: the warp
// kernel's division and no-sign-flip path); gdt: the gradients' dtype; offset: every device array starts
// that many elements into its allocation (1: unaligned for the warp kernel's vectors, its element path).
struct StepCase {
  quant::MapKind map1 = quant::MapKind::dynamic_signed;
  DType gdt = DType::f32;
  int offset = 0;
};
void expect_step_equals_reference(Algo algo, int bits, DType pdt, int32_t block, const StepCase& sc = {}) {
  const quant::MapKind map1 = sc.map1;
  const int64_t n = 5 * block + 37;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> p32(static_cast<size_t>(n)), grad(static_cast<size_t>(n));
  for (auto& x : p32) x = nd(rng);
  std::vector<uint16_t> p16(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p16[size_t(i)] = f32_to_bf16(p32[size_t(i)]);
  const std::vector<int64_t> segs = {0, 300, n};
  // Host reference state and device copies.
  State st(StateLayout(algo, n, bits, block));
  StepArgs h;
  st.bind(h);
  std::vector<uint8_t> c1(size_t(n), bits == 8 ? st.map(1)->zero_code : 0), c2 = c1;
  std::vector<float> a1(size_t(st.layout().num_blocks()), 0.0f), a2 = a1, s1(size_t(n), 0.0f), s2 = s1;
  std::vector<float> master = p32;
  // Device copies with sc.offset elements in front (the arrays the kernels see start after them).
  const size_t off = size_t(sc.offset);
  auto padded = [off](const auto& v) {
    auto out = v;
    out.insert(out.begin(), off, typename std::decay_t<decltype(v)>::value_type{});
    return out;
  };
  auto unpadded = [off](auto v) {
    v.erase(v.begin(), v.begin() + std::ptrdiff_t(off));
    return v;
  };
  std::vector<uint16_t> g16(static_cast<size_t>(n));
  DevBuf<float> d_master(padded(master)), d_p32(padded(p32)), d_grad(padded(grad)), d_s1(padded(s1)),
      d_s2(padded(s2));
  DevBuf<float> d_a1(a1), d_a2(a2);
  DevBuf<uint16_t> d_p16(padded(p16)), d_g16(padded(g16));
  DevBuf<uint8_t> d_c1(padded(c1)), d_c2(padded(c2));
  DevBuf<int64_t> d_segs(segs);
  const quant::QuantTable* maps[2] = {&quant::table_get(map1),
                                      &quant::table_get(quant::MapKind::dynamic_unsigned)};
  quant::QuantTable* d_maps = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_maps), 2 * sizeof(quant::QuantTable)));
  CUDA_OK(cudaMemcpy(d_maps, maps[0], sizeof(quant::QuantTable), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_maps + 1, maps[1], sizeof(quant::QuantTable), cudaMemcpyHostToDevice));
  float* d_trust = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_trust), 2 * sizeof(float)));
  for (int t = 1; t <= 3; ++t) {
    for (auto& x : grad) x = 1e-2f * nd(rng);
    CUDA_OK(cudaMemcpy(d_grad.p + off, grad.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
    if (sc.gdt != DType::f32) {
      for (int64_t i = 0; i < n; ++i) dtype_store(g16.data(), sc.gdt, i, grad[size_t(i)]);
      CUDA_OK(cudaMemcpy(d_g16.p + off, g16.data(), size_t(n) * 2, cudaMemcpyHostToDevice));
    }
    // CPU reference on host buffers.
    StepArgs a = h;
    a.h = hyper_for(algo);
    a.h.step = t;
    a.param = pdt == DType::f32 ? static_cast<void*>(p32.data()) : static_cast<void*>(p16.data());
    a.param_dtype = pdt;
    a.master = pdt == DType::f32 ? nullptr : master.data();
    a.grad = sc.gdt == DType::f32 ? static_cast<const void*>(grad.data()) : g16.data();
    a.grad_dtype = sc.gdt;
    a.nseg = 2;
    a.seg_offsets = segs.data();
    if (bits == 8) {
      a.code1 = c1.data(); a.absmax1 = a1.data(); a.map1 = maps[0];
      a.code2 = c2.data(); a.absmax2 = a2.data(); a.map2 = maps[1];
    } else {
      a.state1 = s1.data(); a.state2 = s2.data();
    }
    if (algo_num_states(algo) == 1) a.code2 = nullptr, a.absmax2 = nullptr, a.map2 = nullptr, a.state2 = nullptr;
    StepArgs d = a;  // the same on device pointers
    d.param = pdt == DType::f32 ? static_cast<void*>(d_p32.p + off) : static_cast<void*>(d_p16.p + off);
    d.master = pdt == DType::f32 ? nullptr : d_master.p + off;
    d.grad = sc.gdt == DType::f32 ? static_cast<const void*>(d_grad.p + off) : d_g16.p + off;
    d.seg_offsets = d_segs.p;
    if (bits == 8) {
      d.code1 = d_c1.p + off; d.absmax1 = d_a1.p; d.map1 = d_maps;
      if (a.code2) d.code2 = d_c2.p + off, d.absmax2 = d_a2.p, d.map2 = d_maps + 1;
    } else {
      d.state1 = d_s1.p + off;
      if (a.state2) d.state2 = d_s2.p + off;
    }
    float trust[2] = {1.0f, 1.0f};
    if (algo_has_trust_ratio(algo)) {
      NormSums want[2], got[2];
      optim_norms_ref(a, want);
      DevBuf<NormSums> d_got(std::vector<NormSums>(2));
      optim_norms_cuda(d, d_got.p, nullptr);
      const std::vector<NormSums> back = d_got.get();
      std::copy(back.begin(), back.end(), got);
      for (int s = 0; s < 2; ++s) {
        EXPECT_NEAR(got[s].w_sq, want[s].w_sq, 1e-12 * want[s].w_sq);
        EXPECT_NEAR(got[s].u_sq, want[s].u_sq, 1e-12 * want[s].u_sq);
        trust[s] = optim_trust_ratio(algo, a.h, want[s]);
      }
    }
    a.seg_trust = trust;
    CUDA_OK(cudaMemcpy(d_trust, trust, sizeof(trust), cudaMemcpyHostToDevice));
    d.seg_trust = d_trust;
    optim_step_ref(a);
    optim_step_cuda(d, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    auto same = [](const auto& x, const auto& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
    };
    if (pdt == DType::f32) {
      ASSERT_TRUE(same(unpadded(d_p32.get()), p32)) << "parameter, step " << t;
    } else {
      ASSERT_TRUE(same(unpadded(d_p16.get()), p16)) << "bf16 parameter, step " << t;
      ASSERT_TRUE(same(unpadded(d_master.get()), master)) << "master, step " << t;
    }
    if (bits == 8) {
      ASSERT_TRUE(same(unpadded(d_c1.get()), c1) && same(d_a1.get(), a1)) << "state 1, step " << t;
      if (a.code2) {
        ASSERT_TRUE(same(unpadded(d_c2.get()), c2) && same(d_a2.get(), a2)) << "state 2, step " << t;
      }
    } else {
      ASSERT_TRUE(same(unpadded(d_s1.get()), s1)) << "state 1, step " << t;
      if (a.state2) {
        ASSERT_TRUE(same(unpadded(d_s2.get()), s2)) << "state 2, step " << t;
      }
    }
  }
  cudaFree(d_maps);
  cudaFree(d_trust);
}

TEST(OptimCuda, StepEqualsCpuReferenceBitwise) {
  const std::string why = cuda_unavailable();
  if (!why.empty()) GTEST_SKIP() << why;
  const Algo algos[] = {Algo::adam, Algo::adamw, Algo::sgd, Algo::lion, Algo::rmsprop, Algo::adagrad, Algo::lamb, Algo::lars};
  // Both kernels; blocks of one warp's elements, the default, and one the warp kernel leaves to the block one.
  for (CudaQuantKernels kernel : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    const CudaQuantKernelsScope scope(kernel);
    for (int32_t block : {64, 256, 1024}) {
      for (Algo algo : algos) {
        for (int bits : {8, 32}) {
          for (DType pdt : {DType::f32, DType::bf16}) {
            SCOPED_TRACE(std::string(cuda_quant_kernels_name(kernel)) + " kernel, block " + std::to_string(block) + ", " +
                         algo_name(algo) + " bits=" + std::to_string(bits) + " param=" + dtype_name(pdt));
            expect_step_equals_reference(algo, bits, pdt, block);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
    for (Algo algo : {Algo::adamw, Algo::lion}) {
      SCOPED_TRACE(std::string(cuda_quant_kernels_name(kernel)) + " kernel, signed linear map, " + algo_name(algo));
      StepCase sc;
      sc.map1 = quant::MapKind::linear_signed;
      expect_step_equals_reference(algo, 8, DType::f32, 256, sc);
      if (HasFatalFailure()) return;
    }
    // The warp kernel's vector widths (2 and 4 elements per access), the 32-bit kernel's vectors, 16-bit
    // gradients and parameters in vectors, and arrays one element off alignment (the kernels' element-wise
    // paths).
    for (int32_t block : {64, 128, 256}) {
      for (DType gdt : {DType::f32, DType::bf16, DType::f16}) {
        for (int offset : {0, 1}) {
          for (Algo algo : {Algo::adamw, Algo::lion}) {
            for (int bits : {8, 32}) {
              SCOPED_TRACE(std::string(cuda_quant_kernels_name(kernel)) + " kernel, block " + std::to_string(block) +
                           ", grad " + dtype_name(gdt) + ", offset " + std::to_string(offset) + ", " + algo_name(algo) +
                           " bits=" + std::to_string(bits));
              StepCase sc;
              sc.gdt = gdt;
              sc.offset = offset;
              expect_step_equals_reference(algo, bits, algo == Algo::adamw ? DType::bf16 : DType::f32, block, sc);
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

#if ZERO8_WITH_CUDA_SIM
// A caller that vouches for its pointers (device::VouchedPointers: the bindings' pointers_checked, which
// zero8.optim's planned steps and the Python kernels' calls pass) gets a step that asks the driver nothing
// about them (a cudaPointerGetAttributes is about a microsecond on a GPU, and an 8-bit AdamW step has eight
// pointers), with the same bits as the checked step.
TEST(OptimCuda, AStepWithVouchedPointersQueriesNone) {
  const int64_t n = 3000;
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  std::vector<float> p(static_cast<size_t>(n)), grad(static_cast<size_t>(n));
  for (float& v : p) v = g(rng);
  for (float& v : grad) v = g(rng);
  const int64_t nb = (n + 255) / 256;
  std::vector<uint8_t> codes(static_cast<size_t>(n), 128);
  std::vector<float> absmax(static_cast<size_t>(nb), 0.0f);  // scales of 0: every state decodes to 0
  struct Copy {
    DevBuf<float> p, g, a1, a2;
    DevBuf<uint8_t> c1, c2;
  };
  Copy checked{DevBuf<float>(p), DevBuf<float>(grad), DevBuf<float>(absmax), DevBuf<float>(absmax),
               DevBuf<uint8_t>(codes), DevBuf<uint8_t>(codes)};
  Copy vouched{DevBuf<float>(p), DevBuf<float>(grad), DevBuf<float>(absmax), DevBuf<float>(absmax),
               DevBuf<uint8_t>(codes), DevBuf<uint8_t>(codes)};
  auto args = [&](Copy& c) {
    StepArgs a;
    a.algo = Algo::adamw;
    a.h.weight_decay = 0.01f;
    a.n = n;
    a.param = c.p.p;
    a.grad = c.g.p;
    a.bits = 8;
    a.block = 256;
    a.code1 = c.c1.p, a.absmax1 = c.a1.p, a.map1 = quant::table_get_device(quant::MapKind::dynamic_signed);
    a.code2 = c.c2.p, a.absmax2 = c.a2.p, a.map2 = quant::table_get_device(quant::MapKind::dynamic_unsigned);
    return a;
  };
  const unsigned long long q0 = zero8_cudasim_get_counts().pointer_queries;
  step_tensor_cuda(args(checked), nullptr);
  const unsigned long long q1 = zero8_cudasim_get_counts().pointer_queries;
  {
    const device::VouchedPointers scope(true);
    step_tensor_cuda(args(vouched), nullptr);
  }
  const unsigned long long q2 = zero8_cudasim_get_counts().pointer_queries;
  EXPECT_GE(q1 - q0, 8u) << "the checked step's queries";
  EXPECT_EQ(q2 - q1, 0u) << "the vouched step's queries";
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(checked.p.get(), vouched.p.get());
  EXPECT_EQ(checked.c1.get(), vouched.c1.get());
  EXPECT_EQ(checked.a2.get(), vouched.a2.get());
  EXPECT_NE(checked.p.get(), p) << "the step changed nothing";
}
#endif

#else  // !ZERO8_WITH_CUDA

TEST(OptimCuda, StepEqualsCpuReferenceBitwise) { GTEST_SKIP() << "zero8 was built without CUDA (ZERO8_CUDA=OFF or no nvcc)"; }

#endif

}  // namespace
