// zero8-bench --device cuda (see zero8_bench_cuda.h): device buffers, CUDA-event timing, and the checks
// against the CPU that make each figure the time of the right computation.
#include "zero8_bench_cuda.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/quant_map.h"
#include "zero8/optim.h"
#include "zero8/quant.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace zero8::bench {

#if !ZERO8_WITH_CUDA

namespace {
[[noreturn]] void no_cuda() { ZERO8_THROW(unsupported, "--device cuda: zero8 was built without CUDA (ZERO8_CUDA=OFF or no nvcc)"); }
}  // namespace

CudaDeviceInfo cuda_device_info() { no_cuda(); }
double cuda_bench_copy(int64_t, int) { no_cuda(); }
CudaCodecTimes cuda_bench_codec(const void*, int64_t, int64_t, int32_t, DType, bool, int) { no_cuda(); }
CudaOptimTimes cuda_bench_optimizer(optim::Algo, const optim::Hyper&, int64_t, int32_t, int) { no_cuda(); }

#else

namespace {

#define BENCH_CUDA(expr) cuda_check((expr), #expr, __LINE__)

void cuda_check(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
    ZERO8_THROW(unsupported, "--device cuda: no usable CUDA device (" << cudaGetErrorString(e) << ")");
  ZERO8_THROW(internal, "zero8_bench_cuda.cpp:" << line << ": " << what << ": " << cudaGetErrorString(e));
}

// A device allocation of `count` elements (cudaMalloc: plain device memory).
template <class T>
struct DeviceArray {
  T* p = nullptr;
  int64_t n = 0;
  explicit DeviceArray(int64_t count) : n(count) {
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), size_t(std::max<int64_t>(count, 1)) * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::vector<T> head(int64_t count) const {
    std::vector<T> h(size_t(std::min(count, n)));
    BENCH_CUDA(cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// The set-up's fills (cudaMemcpy from pageable memory, cudaMemset) run on the legacy default stream, and
// neither is complete when it returns (the last DMA of a pageable copy, a device memset may still be in
// flight); the kernels under test run on a non-blocking stream, which does not wait for the legacy one.
// So the set-up waits for the device before any of them reads what it wrote.
void setup_done() { BENCH_CUDA(cudaDeviceSynchronize()); }

// fn run with the 8-bit kernels in form k (each timed call sets its own: time_interleaved runs the forms
// in turn).
std::function<void()> in_form(CudaQuantKernels k, std::function<void()> fn) {
  return [k, fn = std::move(fn)] {
    set_cuda_quant_kernels(k);
    fn();
  };
}

// Fills `bytes` of device memory with copies of a host pattern (so no host array of the full size is needed).
void fill_tiled(void* dst, size_t bytes, const void* pattern, size_t pattern_bytes) {
  for (size_t off = 0; off < bytes; off += pattern_bytes)
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(dst) + off, pattern, std::min(pattern_bytes, bytes - off),
                          cudaMemcpyHostToDevice));
  setup_done();
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// As the CPU's time_interleaved: one warm-up call each, then `repeat` rounds in which every kernel runs
// once, each between two events on the stream (launches are asynchronous: the events time the device's
// work). Checks each launch. Returns each kernel's median seconds.
std::vector<double> time_interleaved(cudaStream_t s, int repeat, const std::vector<std::function<void()>>& fns) {
  for (const auto& fn : fns) fn();
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * fns.size());
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < repeat; ++r) {
    for (size_t k = 0; k < fns.size(); ++k) {
      BENCH_CUDA(cudaEventRecord(ev[2 * k], s));
      fns[k]();
      BENCH_CUDA(cudaEventRecord(ev[2 * k + 1], s));
    }
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(s));
    for (size_t k = 0; k < fns.size(); ++k) {
      float ms = 0.0f;
      BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * k], ev[2 * k + 1]));
      t[k].push_back(double(ms) * 1e-3);
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::vector<double> med;
  for (auto& v : t) med.push_back(median(v));
  return med;
}

// The copy yardstick: n floats device to device, and a check that it copied.
struct CopyBench {
  DeviceArray<float> a, b;
  cudaStream_t s;
  CopyBench(int64_t n, cudaStream_t stream) : a(n), b(n), s(stream) {
    std::vector<float> pat(size_t(std::min<int64_t>(n, int64_t(1) << 22)));
    for (size_t i = 0; i < pat.size(); ++i) pat[i] = float(i % 1000) * 0.5f;
    fill_tiled(a.p, size_t(n) * 4, pat.data(), pat.size() * 4);
    BENCH_CUDA(cudaMemset(b.p, 0xff, size_t(n) * 4));
    setup_done();
  }
  std::function<void()> copy() {
    return [this] { BENCH_CUDA(cudaMemcpyAsync(b.p, a.p, size_t(a.n) * 4, cudaMemcpyDeviceToDevice, s)); };
  }
  void verify() {
    BENCH_CUDA(cudaStreamSynchronize(s));
    const int64_t m = std::min<int64_t>(a.n, int64_t(1) << 20);
    if (a.head(m) != b.head(m)) ZERO8_THROW(internal, "the device copy benchmark produced a wrong copy");
  }
};

// Optimizer state on the device, 8-bit or 32-bit, initialised as optim::State initialises it (zero
// values: zero codes and zero scales, or zeros).
struct DeviceState {
  optim::StateLayout layout;
  DeviceArray<uint8_t> c1, c2;
  DeviceArray<float> a1, a2, s1, s2;
  DeviceState(optim::Algo algo, int64_t n, int bits, int32_t block)
      : layout(algo, n, bits, block),
        c1(bits == 8 ? n : 0), c2(bits == 8 && layout.num_states == 2 ? n : 0),
        a1(bits == 8 ? layout.num_blocks() : 0), a2(bits == 8 && layout.num_states == 2 ? layout.num_blocks() : 0),
        s1(bits == 32 ? n : 0), s2(bits == 32 && layout.num_states == 2 ? n : 0) {
    if (bits == 8) {
      BENCH_CUDA(cudaMemset(c1.p, quant::table_get(quant::MapKind::dynamic_signed).zero_code, size_t(n)));
      BENCH_CUDA(cudaMemset(a1.p, 0, size_t(layout.num_blocks()) * 4));
      if (layout.num_states == 2) {
        BENCH_CUDA(cudaMemset(c2.p, quant::table_get(quant::MapKind::dynamic_unsigned).zero_code, size_t(n)));
        BENCH_CUDA(cudaMemset(a2.p, 0, size_t(layout.num_blocks()) * 4));
      }
    } else {
      BENCH_CUDA(cudaMemset(s1.p, 0, size_t(n) * 4));
      if (layout.num_states == 2) BENCH_CUDA(cudaMemset(s2.p, 0, size_t(n) * 4));
    }
    setup_done();  // else the first step on the bench's stream may read codes the memset has not written yet
  }
  // StepArgs over this state and the given device parameter and gradient.
  optim::StepArgs args(const optim::Hyper& h, float* param, const float* grad) const {
    optim::StepArgs a;
    a.algo = layout.algo;
    a.h = h;
    a.n = layout.n;
    a.param = param;
    a.grad = grad;
    a.bits = layout.bits;
    a.block = layout.block;
    if (layout.bits == 8) {
      a.code1 = c1.p, a.absmax1 = a1.p, a.map1 = quant::table_get_device(quant::MapKind::dynamic_signed);
      if (layout.num_states == 2)
        a.code2 = c2.p, a.absmax2 = a2.p, a.map2 = quant::table_get_device(quant::MapKind::dynamic_unsigned);
    } else {
      a.state1 = s1.p;
      if (layout.num_states == 2) a.state2 = s2.p;
    }
    return a;
  }
};

// Three steps over 3.5 blocks on the device and with the CPU reference (optim::State + optim::step) must
// leave the same parameter bits and state bytes.
void check_step(optim::Algo algo, const optim::Hyper& hyper, int bits, int32_t block, cudaStream_t s) {
  const int64_t n = 3 * int64_t(block) + block / 2;
  std::vector<float> p(static_cast<size_t>(n)), g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    p[size_t(i)] = 0.02f * (rng_uniform(3, uint64_t(i)) - 0.5f);
    g[size_t(i)] = 1e-3f * (rng_uniform(4, uint64_t(i)) - 0.5f) * float(1 + i / block);
  }
  DeviceArray<float> dp(n), dg(n);
  BENCH_CUDA(cudaMemcpy(dp.p, p.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dg.p, g.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
  DeviceState ds(algo, n, bits, block);  // (waits for the device: the two copies above are done too)
  optim::State hs(optim::StateLayout(algo, n, bits, block));
  optim::Hyper h = hyper;
  h.lr = 1e-2f;  // large enough that every step moves the parameters
  for (h.step = 1; h.step <= 3; ++h.step) {
    optim::step(hs, h, p.data(), DType::f32, nullptr, g.data(), DType::f32, 1);
    optim::optim_step_cuda(ds.args(h, dp.p, dg.p), s);
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaStreamSynchronize(s));
  bool same = std::memcmp(dp.head(n).data(), p.data(), size_t(n) * 4) == 0;
  for (int k = 1; k <= hs.layout().num_states && same; ++k) {
    if (bits == 8) {
      const std::vector<uint8_t> codes = (k == 1 ? ds.c1 : ds.c2).head(n);
      const std::vector<float> scales = (k == 1 ? ds.a1 : ds.a2).head(hs.layout().num_blocks());
      same = std::memcmp(codes.data(), hs.codes(k), size_t(n)) == 0 &&
             std::memcmp(scales.data(), hs.absmax(k), scales.size() * 4) == 0;
    } else {
      same = std::memcmp((k == 1 ? ds.s1 : ds.s2).head(n).data(), hs.fp32(k), size_t(n) * 4) == 0;
    }
  }
  if (!same)
    ZERO8_THROW(internal, "the CUDA " << optim::algo_name(algo) << " step (" << bits
                                      << "-bit states) differs from the CPU reference: its time would not count");
}

}  // namespace

CudaDeviceInfo cuda_device_info() {
  int device = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  CudaDeviceInfo d;
  d.name = prop.name;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.sms = prop.multiProcessorCount;
  d.memory_gib = double(prop.totalGlobalMem) / double(1 << 30);
  return d;
}

double cuda_bench_copy(int64_t n, int repeat) {
  Stream s;
  CopyBench cb(n, s.s);
  const double t = time_interleaved(s.s, repeat, {cb.copy()})[0];
  cb.verify();
  return t;
}

CudaCodecTimes cuda_bench_codec(const void* x_host, int64_t n_host, int64_t n, int32_t block, DType dtype,
                                bool stochastic, int repeat) {
  if (n_host <= 0 || n_host > n || (n_host < n && n_host % block != 0))
    ZERO8_THROW(invalid_argument, "cuda_bench_codec: the host pattern must be whole blocks of the tensor, got "
                                      << n_host << " of " << n);
  Stream s;
  CopyBench cb(n, s.s);
  const size_t esize = dtype == DType::f32 ? 4 : 2;
  const int64_t nblocks = quant::quant_num_blocks(n, block);
  DeviceArray<uint8_t> x(n * int64_t(esize)), y(n * int64_t(esize)), codes(n);
  DeviceArray<float> absmax(nblocks);
  fill_tiled(x.p, size_t(n) * esize, x_host, size_t(n_host) * esize);
  quant::QuantizeOptions opt;
  opt.stochastic = stochastic;
  opt.seed = 42;
  auto quantize = [&] {
    quant::quantize_blockwise_cuda(x.p, dtype, n, block, quant::MapKind::dynamic_signed, codes.p, absmax.p, opt, s.s);
  };
  auto dequantize = [&] {
    quant::dequantize_blockwise_cuda(codes.p, absmax.p, n, block, quant::MapKind::dynamic_signed, y.p, dtype, false, s.s);
  };
  // The device's codes, scales and decodes of the host pattern against the CPU codec's, in each form.
  const int64_t hb = quant::quant_num_blocks(n_host, block);
  std::vector<uint8_t> want_codes(static_cast<size_t>(n_host)), want_y(static_cast<size_t>(n_host) * esize);
  std::vector<float> want_absmax(static_cast<size_t>(hb));
  quant::quantize_blockwise(x_host, dtype, n_host, block, quant::MapKind::dynamic_signed, want_codes.data(),
                            want_absmax.data(), opt);
  quant::dequantize_blockwise(want_codes.data(), want_absmax.data(), n_host, block, quant::MapKind::dynamic_signed,
                              want_y.data(), dtype);
  const CudaQuantKernelsScope restore(cuda_quant_kernels());  // the setting as it was, afterwards
  for (CudaQuantKernels k : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    set_cuda_quant_kernels(k);
    BENCH_CUDA(cudaMemsetAsync(codes.p, 0, size_t(n), s.s));
    BENCH_CUDA(cudaMemsetAsync(y.p, 0, size_t(n) * esize, s.s));
    quantize();
    dequantize();
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(s.s));
    const std::vector<float> got_absmax = absmax.head(hb);
    if (codes.head(n_host) != want_codes || std::memcmp(got_absmax.data(), want_absmax.data(), size_t(hb) * 4) != 0)
      ZERO8_THROW(internal, "the CUDA quantizer's codes or scales (" << cuda_quant_kernels_name(k)
                                << " kernels) differ from the CPU codec's: its time would not count");
    if (y.head(n_host * int64_t(esize)) != want_y)
      ZERO8_THROW(internal, "the CUDA dequantizer's output (" << cuda_quant_kernels_name(k)
                                << " kernels) differs from the CPU codec's: its time would not count");
  }
  // Each form's three timings, in the same rounds.
  auto both = [&] {
    quantize();
    dequantize();
  };
  std::vector<std::function<void()>> fns = {cb.copy()};
  for (CudaQuantKernels k : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    fns.push_back(in_form(k, quantize));
    fns.push_back(in_form(k, dequantize));
    fns.push_back(in_form(k, both));
  }
  const std::vector<double> t = time_interleaved(s.s, repeat, fns);
  cb.verify();
  return {t[0], t[1], t[2], t[3], t[4], t[5], t[6]};
}

CudaOptimTimes cuda_bench_optimizer(optim::Algo algo, const optim::Hyper& h, int64_t n, int32_t block, int repeat) {
  if (optim::algo_has_trust_ratio(algo))
    ZERO8_THROW(invalid_argument, "--device cuda: " << optim::algo_name(algo)
                                                    << " is not offered (two phases with a host round trip)");
  optim::hyper_validate(algo, h);
  Stream s;
  const CudaQuantKernelsScope restore(cuda_quant_kernels());  // the setting as it was, afterwards
  for (CudaQuantKernels k : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    set_cuda_quant_kernels(k);
    check_step(algo, h, 8, block, s.s);
  }
  check_step(algo, h, 32, block, s.s);
  CopyBench cb(n, s.s);
  DeviceArray<float> param(n), grad(n);
  {
    std::vector<float> p(size_t(std::min<int64_t>(n, int64_t(1) << 22))), g(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = 0.02f * (rng_uniform(1, uint64_t(i)) - 0.5f);
      g[i] = 1e-3f * (rng_uniform(2, uint64_t(i)) - 0.5f);
    }
    fill_tiled(param.p, size_t(n) * 4, p.data(), p.size() * 4);
    fill_tiled(grad.p, size_t(n) * 4, g.data(), g.size() * 4);
  }
  // Both share the parameter and gradient buffers: each step moves the same bytes of them.
  DeviceState s8(algo, n, 8, block), s32(algo, n, 32, block);
  optim::Hyper h8 = h, h32 = h;
  h8.step = h32.step = 0;
  // Both forms of the 8-bit kernel step the same state in turn: they give the same bits, so each round moves the
  // same bytes whichever runs.
  auto step8 = [&] {
    ++h8.step;
    optim::optim_step_cuda(s8.args(h8, param.p, grad.p), s.s);
  };
  const std::vector<double> t = time_interleaved(s.s, repeat, {cb.copy(), in_form(CudaQuantKernels::block, step8),
                                                               in_form(CudaQuantKernels::warp, step8), [&] {
                                                                 ++h32.step;
                                                                 optim::optim_step_cuda(s32.args(h32, param.p, grad.p), s.s);
                                                               }});
  cb.verify();
  return {t[0], t[1], t[2], t[3]};
}

#endif  // ZERO8_WITH_CUDA

}  // namespace zero8::bench
