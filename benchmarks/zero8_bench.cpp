// zero8-bench: micro-benchmarks of this machine's memory bandwidth, the block-wise codec and the
// fused optimizer step, measured side by side in one process so their ratios mean something.
// Each subcommand prints a table for people and, as its last line, one JSON object for scripts.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "linear8_step.h"
#include "zero8_bench_cuda.h"
#include "zero8/error.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/optim.h"
#include "zero8/quant.h"
#include "zero8/sharded.h"
#include "zero8/version.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Command line

const char* const kUsage =
    "usage: zero8-bench <command> [options]\n"
    "\n"
    "commands:\n"
    "  bandwidth [--numel N] [--threads T] [--repeat R] [--device cpu|cuda]\n"
    "      STREAM-like copy of N float32 (default 1e8), memcpy, and an in-place add; GB/s counts\n"
    "      bytes read + written.\n"
    "  codec [--block B] [--numel N] [--threads T] [--dtype f32|bf16|f16] [--stochastic 0|1] [--repeat R]\n"
    "        [--device cpu|cuda]\n"
    "      block-wise 8-bit quantize, dequantize and both (dynamic signed map; B default 256, N 1e8);\n"
    "      GB/s counts bytes in + out; the ratio is to the copy bandwidth measured in the same run.\n"
    "  optimizer [--name adamw] [--bits 8|32] [--numel N] [--threads T] [--block B] [--repeat R]\n"
    "        [--device cpu|cuda]\n"
    "      one fused optimizer step over N float32 parameters (default 1e8), beside its 8/32-bit twin\n"
    "      and the copy bandwidth: ns per parameter, state bytes per parameter, and the bandwidth\n"
    "      floor (bytes moved per parameter / copy GB/s; also / in-place GB/s). For adamw also a\n"
    "      yardstick: the same step with linear int8 codes (no map lookups), timed in the same rounds.\n"
    "  comm [--numel N] [--steps S] [--wire-block B] [--threads T] [--backend auto|tcp|both]   (under mpirun -np K)\n"
    "      the sharded AdamW 8-bit optimizer's traffic per rank and step: gradient reduce-scatter as\n"
    "      fp32 vs int8 blocks (bytes_ratio), parameter all-gather as bf16 vs int8 deltas, the slowest\n"
    "      rank's time of each, and the optimizer-state and master bytes per parameter on a rank.\n"
    "      --backend tcp: over the tcp backend (as under torchrun), its addresses exchanged over MPI;\n"
    "      both: each row over MPI, then over tcp, and the time ratios.\n"
    "  help\n"
    "\n"
    "--device cuda runs bandwidth (a device-to-device copy), codec and optimizer (8-bit beside 32-bit\n"
    "states; not lamb or lars) on the current GPU, timed with CUDA events (default R 20, no --threads),\n"
    "after checking the kernels' results against the CPU's bit for bit.\n"
    "N accepts integers or scientific notation (1e8). T defaults to OpenMP's thread count.\n"
    "Kernels are warmed up once, then timed in R rounds (default 7), each round running every kernel\n"
    "of the command once (so a shared machine's load hits all alike); medians are reported.\n"
    "The last line printed is one JSON object.\n";

struct UsageError {
  std::string msg;
};

// Options as --key value pairs, each key allowed once; every key must be consumed by the command.
class Options {
 public:
  Options(int argc, char** argv, int first) {
    for (int i = first; i < argc; i += 2) {
      std::string k = argv[i];
      if (k.rfind("--", 0) != 0 || k.size() < 3) throw UsageError{"unexpected argument '" + k + "'"};
      if (i + 1 >= argc) throw UsageError{"option " + k + " needs a value"};
      if (!values_.emplace(k.substr(2), argv[i + 1]).second) throw UsageError{"option " + k + " given twice"};
    }
  }
  bool has(const std::string& k) const { return values_.count(k) != 0; }
  std::string str(const std::string& k, const std::string& def) {
    used_.push_back(k);
    auto it = values_.find(k);
    return it == values_.end() ? def : it->second;
  }
  // A positive integer count; accepts "100000000" and "1e8".
  int64_t count(const std::string& k, int64_t def, int64_t lo, int64_t hi) {
    used_.push_back(k);
    auto it = values_.find(k);
    if (it == values_.end()) return def;
    const std::string& s = it->second;
    char* end = nullptr;
    double v = std::strtod(s.c_str(), &end);
    if (end == s.c_str() || *end != '\0' || !(v == std::floor(v)) || v < double(lo) || v > double(hi))
      throw UsageError{"--" + k + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "], got '" + s + "'"};
    return int64_t(v);
  }
  // Rejects options the command does not know (a typo must not silently run the default).
  void check_all_used() const {
    for (const auto& kv : values_)
      if (std::find(used_.begin(), used_.end(), kv.first) == used_.end())
        throw UsageError{"unknown option --" + kv.first};
  }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> used_;
};

// ---------------------------------------------------------------------------------------------
// Timing

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times kernels round-robin: one warm-up call each (page faults, caches, thread pool), then `repeat`
// rounds in which every kernel runs once. The machine may be shared, so a change of load during the
// run falls on all kernels alike and their ratios stay meaningful. Returns each kernel's median seconds.
std::vector<double> time_interleaved(int repeat, const std::vector<std::function<void()>>& fns) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < repeat; ++r) {
    for (size_t k = 0; k < fns.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[k]();
      const auto t1 = std::chrono::steady_clock::now();
      t[k].push_back(std::chrono::duration<double>(t1 - t0).count());
    }
  }
  std::vector<double> med;
  for (auto& v : t) med.push_back(median(v));
  return med;
}

// Page-aligned buffer, first touched by the same static OpenMP schedule the kernels use, so each
// thread's pages are local and no page fault lands inside a timed region.
template <typename T>
struct Buffer {
  T* p = nullptr;
  int64_t n = 0;
  explicit Buffer(int64_t count) : n(count) {
    const size_t bytes = ((size_t(count) * sizeof(T) + 4095) / 4096) * 4096;
    p = static_cast<T*>(std::aligned_alloc(4096, std::max<size_t>(bytes, 4096)));
    if (!p) ZERO8_THROW(invalid_argument, "cannot allocate " << bytes << " bytes");
    unsigned char* b = reinterpret_cast<unsigned char*>(p);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < int64_t(bytes); i += 4096) b[i] = 0;
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

void print_header(const char* what, int threads, int repeat) {
  std::printf("zero8-bench %s | zero8 %s | %s | %d threads | ISA %s | median of %d after 1 warm-up\n", what,
              zero8::version(), cpu_model().c_str(), threads, zero8::isa_name(zero8::isa_active()), repeat);
}

// ---------------------------------------------------------------------------------------------
// Copy bandwidth (the yardstick every other figure is divided by)
//
// What "bytes" means: the bytes a kernel must read plus write, as STREAM counts them. With ordinary
// stores the hardware also reads each destination line before writing it (write-allocate), so copy
// really moves 12 bytes per element while 8 are counted. A kernel that updates its arrays in place
// (the optimizer step: parameter and states) pays no such extra read, so it can exceed the copy
// figure; the in-place kernel below (b += a, 12 bytes counted, 12 moved) measures that ceiling.

// STREAM's copy kernel with ordinary stores. GCC would otherwise turn this loop into a memcpy call,
// whose non-temporal stores skip the read-for-ownership of the destination: that is a different
// (and higher) figure, reported separately below as "memcpy".
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
void copy_stream(const float* __restrict a, float* __restrict b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) b[i] = a[i];
}

void copy_memcpy(const float* a, float* b, int64_t n) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
    std::memcpy(b + lo, a + lo, size_t(hi - lo) * sizeof(float));
  }
}

void add_inplace(const float* __restrict a, float* __restrict b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) b[i] += a[i];
}

// The yardsticks, timed in the same rounds as the kernel under test. Bytes counted: copy and memcpy
// 4 read + 4 written per element; in place 8 read + 4 written.
struct CopyBench {
  static constexpr double kCopyBytes = 8.0, kInplaceBytes = 12.0;
  int64_t n;
  Buffer<float> a, b;

  explicit CopyBench(int64_t count) : n(count), a(count), b(count) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a.p[i] = float(i % 1000) * 0.5f;
  }
  std::function<void()> copy() {
    return [this] { copy_stream(a.p, b.p, n); };
  }
  std::function<void()> copy_glibc() {
    return [this] { copy_memcpy(a.p, b.p, n); };
  }
  std::function<void()> inplace() {
    return [this] { add_inplace(a.p, b.p, n); };
  }
  double gbps(double bytes_per_elem, double seconds) const { return bytes_per_elem * double(n) / seconds * 1e-9; }
  // The copy kernel must copy (a benchmark of a loop the compiler removed would be worthless).
  void verify() {
    copy_stream(a.p, b.p, n);
    if (std::memcmp(a.p, b.p, size_t(n) * sizeof(float)) != 0)
      ZERO8_THROW(internal, "copy benchmark produced a wrong copy");
  }
};

// ---------------------------------------------------------------------------------------------
// JSON line

class Json {
 public:
  // JSON has no inf or nan: a ratio over a zero timing (or a failed measurement) is written as null.
  Json& num(const std::string& k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    add(k, std::isfinite(v) ? buf : "null");
    return *this;
  }
  Json& integer(const std::string& k, int64_t v) {
    add(k, std::to_string(v));
    return *this;
  }
  Json& str(const std::string& k, const std::string& v) {
    add(k, "\"" + v + "\"");  // values here are identifiers: no escaping needed
    return *this;
  }
  std::string done() const { return "{" + body_ + "}"; }

 private:
  void add(const std::string& k, const std::string& v) { body_ += (body_.empty() ? "\"" : ", \"") + k + "\": " + v; }
  std::string body_;
};

int threads_option(Options& o) {
  const int t = int(o.count("threads", omp_get_max_threads(), 1, 1024));
  omp_set_num_threads(t);
  return t;
}

// ---------------------------------------------------------------------------------------------
// --device cuda: the same commands on the GPU (zero8_bench_cuda.cpp measures; printed here)

bool device_is_cuda(Options& o) {
  const std::string d = o.str("device", "cpu");
  if (d != "cpu" && d != "cuda") throw UsageError{"--device must be cpu or cuda, got '" + d + "'"};
  if (d == "cuda" && o.has("threads")) throw UsageError{"--threads applies to --device cpu only"};
  return d == "cuda";
}

int cuda_repeat(Options& o) { return int(o.count("repeat", 20, 1, 1000)); }

// The header line; throws when there is no usable device (before any large allocation).
zero8::bench::CudaDeviceInfo cuda_header(const char* what, int repeat) {
  const zero8::bench::CudaDeviceInfo d = zero8::bench::cuda_device_info();
  std::printf("zero8-bench %s | zero8 %s | %s (compute %d.%d, %d SMs, %.1f GiB) | median of %d after 1 warm-up "
              "(CUDA events)\n",
              what, zero8::version(), d.name.c_str(), d.cc_major, d.cc_minor, d.sms, d.memory_gib, repeat);
  return d;
}

// GPU names are plain words and digits; anything else would need JSON escaping.
std::string json_safe(std::string s) {
  for (char& c : s)
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) c = ' ';
  return s;
}

int cmd_bandwidth_cuda(Options& o) {
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 36);
  const int repeat = cuda_repeat(o);
  o.check_all_used();
  const zero8::bench::CudaDeviceInfo d = cuda_header("bandwidth", repeat);
  const double t = zero8::bench::cuda_bench_copy(n, repeat);
  const double gbps = 8.0 * double(n) / t * 1e-9;
  std::printf("%-34s %12s %10s %10s\n", "kernel (float32)", "bytes/elem", "GB/s", "ms");
  std::printf("%-34s %12d %10.2f %10.3f\n", "device-to-device copy", 8, gbps, t * 1e3);
  std::printf("numel %lld (%.1f MB per array)\n", (long long)n, 4.0 * double(n) * 1e-6);
  std::printf("%s\n", Json()
                          .str("bench", "bandwidth")
                          .str("device", "cuda")
                          .str("gpu", json_safe(d.name))
                          .integer("numel", n)
                          .integer("repeat", repeat)
                          .num("gbps", gbps)
                          .done()
                          .c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Commands

int cmd_bandwidth(Options& o) {
  if (device_is_cuda(o)) return cmd_bandwidth_cuda(o);
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 36);
  const int threads = threads_option(o);
  const int repeat = int(o.count("repeat", 7, 1, 1000));
  o.check_all_used();

  print_header("bandwidth", threads, repeat);
  CopyBench cb(n);
  const std::vector<double> t = time_interleaved(repeat, {cb.copy(), cb.copy_glibc(), cb.inplace()});
  cb.verify();
  const double g_copy = cb.gbps(CopyBench::kCopyBytes, t[0]), g_memcpy = cb.gbps(CopyBench::kCopyBytes, t[1]),
               g_inplace = cb.gbps(CopyBench::kInplaceBytes, t[2]);
  std::printf("%-34s %12s %10s %10s\n", "kernel (float32)", "bytes/elem", "GB/s", "ms");
  std::printf("%-34s %12d %10.2f %10.3f\n", "copy (STREAM loop)", 8, g_copy, t[0] * 1e3);
  std::printf("%-34s %12d %10.2f %10.3f\n", "memcpy (glibc)", 8, g_memcpy, t[1] * 1e3);
  std::printf("%-34s %12d %10.2f %10.3f\n", "add in place (b += a)", 12, g_inplace, t[2] * 1e3);
  std::printf("numel %lld (%.1f MB per array)\n", (long long)n, 4.0 * double(n) * 1e-6);
  std::printf("%s\n", Json()
                          .str("bench", "bandwidth")
                          .integer("numel", n)
                          .integer("threads", threads)
                          .integer("repeat", repeat)
                          .num("gbps", g_copy)
                          .num("gbps_memcpy", g_memcpy)
                          .num("gbps_inplace", g_inplace)
                          .done()
                          .c_str());
  return 0;
}

// Bytes a kernel must move per element, for the ratios below.
double dtype_bytes(zero8::DType t) { return t == zero8::DType::f32 ? 4.0 : 2.0; }

zero8::DType dtype_option(Options& o) {
  const std::string d = o.str("dtype", "f32");
  if (d == "f32") return zero8::DType::f32;
  if (d == "bf16") return zero8::DType::bf16;
  if (d == "f16") return zero8::DType::f16;
  throw UsageError{"--dtype must be f32, bf16 or f16, got '" + d + "'"};
}

int32_t block_option(Options& o) {
  const int64_t b = o.count("block", 256, 64, 4096);
  if ((b & (b - 1)) != 0) throw UsageError{"--block must be a power of two in 64..4096, got " + std::to_string(b)};
  return int32_t(b);
}

void print_ratio_row(const char* name, double bytes_per_elem, double gbps, double seconds, double copy_gbps) {
  std::printf("%-26s %12.4f %10.2f %10.3f %12.3f\n", name, bytes_per_elem, gbps, seconds * 1e3, gbps / copy_gbps);
}

// The codec's input: Gaussian-like data with a per-block spread that varies over decades, as optimizer
// states do; elements [0, n) of dtype written to x.
void codec_fill(void* x, zero8::DType dtype, int64_t n) {
  std::vector<float> row(4096);
  for (int64_t i = 0; i < n; i += 4096) {
    const int64_t m = std::min<int64_t>(4096, n - i);
    for (int64_t k = 0; k < m; ++k) {
      const uint64_t j = uint64_t(i + k);
      const float u1 = zero8::rng_uniform(7, 2 * j) + 1e-7f, u2 = zero8::rng_uniform(7, 2 * j + 1);
      const float g = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
      row[size_t(k)] = g * std::pow(10.0f, -float((j / 4096) % 6));
    }
    for (int64_t k = 0; k < m; ++k) zero8::dtype_store(x, dtype, i + k, row[size_t(k)]);
  }
}

const char* dtype_short(zero8::DType t) {
  return t == zero8::DType::f32 ? "f32" : t == zero8::DType::bf16 ? "bf16" : "f16";
}

// Bytes in + out of quantize and of dequantize: the tensor, its codes and the block scales.
struct CodecBytes {
  double q, d;
  CodecBytes(int64_t n, int32_t block, zero8::DType dtype) {
    const double packed = double(n) + 4.0 * double((n + block - 1) / block);
    q = double(n) * dtype_bytes(dtype) + packed;
    d = packed + double(n) * dtype_bytes(dtype);
  }
};

int cmd_codec_cuda(Options& o) {
  const int32_t block = block_option(o);
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 34);
  const zero8::DType dtype = dtype_option(o);
  const bool stochastic = o.count("stochastic", 0, 0, 1) != 0;
  const int repeat = cuda_repeat(o);
  o.check_all_used();
  const zero8::bench::CudaDeviceInfo d = cuda_header("codec", repeat);
  // A host pattern of whole blocks (4 Mi elements, or all of a smaller tensor), tiled over the device tensor.
  const int64_t n_host = std::min<int64_t>(n, int64_t(1) << 22);
  std::vector<unsigned char> x(size_t(n_host) * size_t(dtype_bytes(dtype)));
  codec_fill(x.data(), dtype, n_host);
  const zero8::bench::CudaCodecTimes t = zero8::bench::cuda_bench_codec(x.data(), n_host, n, block, dtype, stochastic, repeat);
  const double copy_gbps = 8.0 * double(n) / t.copy * 1e-9;
  const CodecBytes b(n, block, dtype);
  const double g_q = b.q / t.quantize * 1e-9, g_d = b.d / t.dequantize * 1e-9, g_qd = (b.q + b.d) / t.both * 1e-9;
  const double w_q = b.q / t.quantize_warp * 1e-9, w_d = b.d / t.dequantize_warp * 1e-9,
               w_qd = (b.q + b.d) / t.both_warp * 1e-9;
  std::printf("numel %lld, block %d, dtype %s, %s rounding; codes checked against the CPU codec\n", (long long)n,
              block, dtype_short(dtype), stochastic ? "stochastic" : "nearest");
  std::printf("%-26s %12s %10s %10s %12s\n", "kernel", "bytes/elem", "GB/s", "ms", "x copy GB/s");
  print_ratio_row("device-to-device copy", 8.0, copy_gbps, t.copy, copy_gbps);
  print_ratio_row("quantize", b.q / double(n), g_q, t.quantize, copy_gbps);
  print_ratio_row("dequantize", b.d / double(n), g_d, t.dequantize, copy_gbps);
  print_ratio_row("quantize + dequantize", (b.q + b.d) / double(n), g_qd, t.both, copy_gbps);
  print_ratio_row("quantize, warp", b.q / double(n), w_q, t.quantize_warp, copy_gbps);
  print_ratio_row("dequantize, warp", b.d / double(n), w_d, t.dequantize_warp, copy_gbps);
  print_ratio_row("quantize+dequantize, warp", (b.q + b.d) / double(n), w_qd, t.both_warp, copy_gbps);
  std::printf("block: one CUDA block per quantization block; warp: one warp per block, the map in shared memory "
              "(ZERO8_CUDA_QUANT_KERNELS)\n");
  std::printf("%s\n", Json()
                          .str("bench", "codec")
                          .str("device", "cuda")
                          .str("gpu", json_safe(d.name))
                          .integer("numel", n)
                          .integer("block", block)
                          .str("dtype", dtype_short(dtype))
                          .integer("stochastic", stochastic ? 1 : 0)
                          .integer("repeat", repeat)
                          .num("gbps", g_qd)
                          .num("gbps_quantize", g_q)
                          .num("gbps_dequantize", g_d)
                          .num("copy_gbps", copy_gbps)
                          .num("ratio_to_copy", g_qd / copy_gbps)
                          .num("gbps_warp", w_qd)
                          .num("gbps_quantize_warp", w_q)
                          .num("gbps_dequantize_warp", w_d)
                          .num("ratio_to_copy_warp", w_qd / copy_gbps)
                          .num("speedup_warp_vs_block", t.both / t.both_warp)
                          .done()
                          .c_str());
  return 0;
}

int cmd_codec(Options& o) {
  if (device_is_cuda(o)) return cmd_codec_cuda(o);
  const int32_t block = block_option(o);
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 34);
  const zero8::DType dtype = dtype_option(o);
  const bool stochastic = o.count("stochastic", 0, 0, 1) != 0;
  const int threads = threads_option(o);
  const int repeat = int(o.count("repeat", 7, 1, 1000));
  o.check_all_used();

  print_header("codec", threads, repeat);
  CopyBench cb(n);

  const int64_t nblocks = (n + block - 1) / block;
  const size_t xbytes = size_t(n) * size_t(dtype_bytes(dtype));
  Buffer<unsigned char> x{int64_t(xbytes)}, y{int64_t(xbytes)}, codes{n};
  Buffer<float> absmax(nblocks);
  codec_fill(x.p, dtype, n);
  const zero8::quant::QuantTable& table = zero8::quant::table_get(zero8::quant::MapKind::dynamic_signed);
  const zero8::Isa isa = zero8::isa_active();

  zero8::quant::QuantizeOptions qopt;
  qopt.stochastic = stochastic;
  qopt.seed = 42;
  qopt.threads = threads;
  auto quantize = [&] {
    zero8::quant::quantize_blockwise(x.p, dtype, n, block, table, codes.p, absmax.p, qopt);
  };
  auto dequantize = [&] {
    zero8::quant::dequantize_blockwise(codes.p, absmax.p, n, block, table, y.p, dtype, false, threads);
  };
  const std::vector<double> t = time_interleaved(repeat, {cb.copy(), quantize, dequantize, [&] {
                                                     quantize();
                                                     dequantize();
                                                   }});
  cb.verify();
  const double s_q = t[1], s_d = t[2], s_qd = t[3];
  const double copy_gbps = cb.gbps(CopyBench::kCopyBytes, t[0]);
  const CodecBytes bytes(n, block, dtype);
  const double b_q = bytes.q, b_d = bytes.d;
  const double g_q = b_q / s_q * 1e-9, g_d = b_d / s_d * 1e-9, g_qd = (b_q + b_d) / s_qd * 1e-9;

  const char* dname = dtype_short(dtype);
  std::printf("numel %lld, block %d, dtype %s, %s rounding, ISA %s\n", (long long)n, block, dname,
              stochastic ? "stochastic" : "nearest", zero8::isa_name(isa));
  std::printf("%-26s %12s %10s %10s %12s\n", "kernel", "bytes/elem", "GB/s", "ms", "x copy GB/s");
  print_ratio_row("copy (STREAM loop)", 8.0, copy_gbps, t[0], copy_gbps);
  print_ratio_row("quantize", b_q / double(n), g_q, s_q, copy_gbps);
  print_ratio_row("dequantize", b_d / double(n), g_d, s_d, copy_gbps);
  print_ratio_row("quantize + dequantize", (b_q + b_d) / double(n), g_qd, s_qd, copy_gbps);
  std::printf("%s\n", Json()
                          .str("bench", "codec")
                          .integer("numel", n)
                          .integer("block", block)
                          .str("dtype", dname)
                          .integer("stochastic", stochastic ? 1 : 0)
                          .integer("threads", threads)
                          .str("isa", zero8::isa_name(isa))
                          .num("gbps", g_qd)
                          .num("gbps_quantize", g_q)
                          .num("gbps_dequantize", g_d)
                          .num("copy_gbps", copy_gbps)
                          .num("ratio_to_copy", g_qd / copy_gbps)
                          .done()
                          .c_str());
  return 0;
}

zero8::optim::Algo algo_option(Options& o) {
  const std::string name = o.str("name", "adamw");
  std::string names;
  for (const zero8::optim::AlgoSpec& row : zero8::optim::kAlgos) {
    if (name == row.name) return row.algo;
    names += std::string(names.empty() ? "" : ", ") + row.name;
  }
  throw UsageError{"--name must be one of " + names + "; got '" + name + "'"};
}

// The bench's hyperparameters (the CPU and the GPU command time the same step).
zero8::optim::Hyper bench_hyper() {
  zero8::optim::Hyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.01f;
  return h;
}

// The least a single step over float32 parameters must move per parameter: read param and grad, write
// param, read and write every state (8-bit: a code per state plus the block scales). LAMB/LARS read
// everything once more for the norms.
double step_moved_bytes_per_param(zero8::optim::Algo algo, double state_bytes_per_param) {
  double b = 4.0 + 4.0 + 4.0 + 2.0 * state_bytes_per_param;
  if (zero8::optim::algo_has_trust_ratio(algo)) b += 4.0 + 4.0 + state_bytes_per_param;
  return b;
}

// One optimizer's step over n float32 parameters, with its own state; step() is the timed kernel.
struct StepBench {
  zero8::optim::State state;
  zero8::optim::Hyper h;
  int64_t n, step_no = 0;
  float* param;
  const float* grad;
  int threads;

  StepBench(zero8::optim::Algo algo, int bits, int32_t block, int64_t n_, float* p, const float* g, int t)
      : state(zero8::optim::StateLayout(algo, n_, bits, block)), h(bench_hyper()), n(n_), param(p), grad(g),
        threads(t) {}
  std::function<void()> step() {
    return [this] {
      h.step = ++step_no;
      zero8::optim::step(state, h, param, zero8::DType::f32, n, nullptr, grad, zero8::DType::f32, n, threads);
    };
  }
  double state_bytes_per_param() const { return state.layout().bytes_per_param(); }
  double moved_bytes_per_param() const { return step_moved_bytes_per_param(state.layout().algo, state_bytes_per_param()); }
};

// Arguments of the linear int8 yardstick (linear8_step.h) over the given arrays.
zero8::bench::Linear8Args linear8_args(float* p, const float* g, int8_t* code1, uint8_t* code2, float* scale1,
                                       float* scale2, int64_t n, int32_t block) {
  zero8::bench::Linear8Args a;
  a.param = p;
  a.grad = g;
  a.code1 = code1;
  a.code2 = code2;
  a.scale1 = scale1;
  a.scale2 = scale2;
  a.n = n;
  a.block = block;
  return a;
}

// The linear int8 yardstick: AdamW with 8-bit block-wise states that need no map lookups, over the same
// parameter and gradient buffers and with the same hyperparameters as the real steps. Its time is what
// an 8-bit step moving zero8's bytes can reach here, so it tells whether a target stated against the
// 32-bit step is within reach of any 8-bit step on this machine.
struct Linear8Bench {
  Buffer<int8_t> code1;
  Buffer<uint8_t> code2;
  std::vector<float> scale1, scale2;
  zero8::bench::Linear8Args a;
  zero8::optim::Hyper h;
  int threads;

  Linear8Bench(const zero8::optim::Hyper& h_, int32_t block, int64_t n, float* p, const float* g, int t)
      : code1(n), code2(n), scale1((n + block - 1) / block, 0.0f), scale2((n + block - 1) / block, 0.0f),
        a(linear8_args(p, g, code1.p, code2.p, scale1.data(), scale2.data(), n, block)), h(h_), threads(t) {
    h.step = 0;
  }
  std::function<void()> step() {
    return [this] {
      ++h.step;
      zero8::bench::linear8_set_hyper(a, h);
      zero8::bench::linear8_step(a, zero8::isa_active(), threads);
    };
  }
};

// The yardstick's active variant must give the reference's bits (else its time would be a kernel's that
// computes something else): three steps over 3.5 blocks of optimizer-like data, compared exactly.
void linear8_check(int32_t block) {
  const int64_t n = 3 * int64_t(block) + block / 2, nb = (n + block - 1) / block;
  std::vector<float> p(n), g(n), s1(nb, 0.0f), s2(nb, 0.0f);
  std::vector<int8_t> c1(n, 0);
  std::vector<uint8_t> c2(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = 0.02f * (zero8::rng_uniform(3, uint64_t(i)) - 0.5f);
    g[i] = 1e-3f * (zero8::rng_uniform(4, uint64_t(i)) - 0.5f) * float(1 + i / block);
  }
  std::vector<float> p2 = p, s1b = s1, s2b = s2;
  std::vector<int8_t> c1b = c1;
  std::vector<uint8_t> c2b = c2;
  zero8::bench::Linear8Args a = linear8_args(p.data(), g.data(), c1.data(), c2.data(), s1.data(), s2.data(), n, block);
  zero8::bench::Linear8Args r = linear8_args(p2.data(), g.data(), c1b.data(), c2b.data(), s1b.data(), s2b.data(), n, block);
  zero8::optim::Hyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.01f;
  for (h.step = 1; h.step <= 3; ++h.step) {
    zero8::bench::linear8_set_hyper(a, h);
    zero8::bench::linear8_set_hyper(r, h);
    zero8::bench::linear8_step(a, zero8::isa_active(), 2);
    zero8::bench::linear8_step_ref(r, 0, n);
  }
  const bool same = std::memcmp(p.data(), p2.data(), n * 4) == 0 && c1 == c1b && c2 == c2b && s1 == s1b && s2 == s2b;
  const bool moved = s1[0] > 0.0f && s2[0] > 0.0f && std::any_of(c1.begin(), c1.end(), [](int8_t c) { return c != 0; });
  if (!same || !moved)
    ZERO8_THROW(internal, "the linear int8 yardstick's " << zero8::isa_name(zero8::isa_active())
                                                           << " variant differs from its reference");
}

int cmd_optimizer_cuda(Options& o, zero8::optim::Algo algo, int bits) {
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 34);
  const int32_t block = block_option(o);
  const int repeat = cuda_repeat(o);
  o.check_all_used();
  if (zero8::optim::algo_has_trust_ratio(algo))
    throw UsageError{std::string("--device cuda does not offer ") + zero8::optim::algo_name(algo) +
                     " (two phases with a host round trip); use adam, adamw, sgd, lion, rmsprop or adagrad"};
  const zero8::bench::CudaDeviceInfo d = cuda_header("optimizer", repeat);
  const zero8::bench::CudaOptimTimes t = zero8::bench::cuda_bench_optimizer(algo, bench_hyper(), n, block, repeat);
  const double copy_gbps = 8.0 * double(n) / t.copy * 1e-9;
  const double state8 = zero8::optim::StateLayout(algo, n, 8, block).bytes_per_param();
  const double state32 = zero8::optim::StateLayout(algo, n, 32, block).bytes_per_param();
  const double moved8 = step_moved_bytes_per_param(algo, state8), moved32 = step_moved_bytes_per_param(algo, state32);
  auto ns = [&](double s) { return s / double(n) * 1e9; };
  const double ns8 = ns(t.step8), ns8w = ns(t.step8_warp), ns32 = ns(t.step32);
  const char* name = zero8::optim::algo_name(algo);
  std::printf("%s, numel %lld, float32 params and grads, state block %d; steps checked against the CPU reference\n",
              name, (long long)n, block);
  std::printf("bandwidth: device-to-device copy %.2f GB/s\n", copy_gbps);
  std::printf("%-8s %10s %10s %14s %14s %12s %10s %9s\n", "states", "ms/step", "ns/param", "state B/param",
              "moved B/param", "moved GB/s", "floor ns", "x floor");
  const struct {
    const char* name;
    double s, state, moved;
  } rows[] = {{"8-bit", t.step8, state8, moved8}, {"8-bit W", t.step8_warp, state8, moved8},
              {"32-bit", t.step32, state32, moved32}};
  for (const auto& r : rows)
    std::printf("%-8s %10.3f %10.5f %14.4f %14.4f %12.1f %10.5f %9.3f\n", r.name, r.s * 1e3, ns(r.s), r.state,
                r.moved, r.moved / ns(r.s), r.moved / copy_gbps, ns(r.s) / (r.moved / copy_gbps));
  const double speedup = t.step32 / t.step8, speedup_w = t.step32 / t.step8_warp;
  std::printf("8-bit: the block step kernel; 8-bit W: the warp one (ZERO8_CUDA_QUANT_KERNELS; blocks of 64..256 "
              "elements, else the block kernel)\n");
  std::printf("8-bit step: %.3fx the speed of the 32-bit step (%s); warp kernel %.3fx (%.3fx the block kernel)\n",
              speedup, speedup >= 1.0 ? "faster" : "slower", speedup_w, t.step8 / t.step8_warp);
  const bool main8 = bits == 8;
  std::printf("%s\n", Json()
                          .str("bench", "optimizer")
                          .str("device", "cuda")
                          .str("gpu", json_safe(d.name))
                          .str("name", name)
                          .integer("bits", bits)
                          .integer("numel", n)
                          .integer("block", block)
                          .integer("repeat", repeat)
                          .num("ns_per_param", main8 ? ns8 : ns32)
                          .num("bytes_per_param_state", main8 ? state8 : state32)
                          .num("ns_per_param_8bit", ns8)
                          .num("ns_per_param_32bit", ns32)
                          .num("speedup_8_vs_32", speedup)
                          .num("ns_per_param_8bit_warp", ns8w)
                          .num("speedup_8warp_vs_32", speedup_w)
                          .num("speedup_warp_vs_block", t.step8 / t.step8_warp)
                          .num("copy_gbps", copy_gbps)
                          .num("moved_bytes_per_param", main8 ? moved8 : moved32)
                          .num("moved_bytes_per_param_8bit", moved8)
                          .num("moved_bytes_per_param_32bit", moved32)
                          .num("gbps_effective_8bit", moved8 / ns8)
                          .num("gbps_effective_8bit_warp", moved8 / ns8w)
                          .num("gbps_effective_32bit", moved32 / ns32)
                          .num("floor_ns_per_param", (main8 ? moved8 : moved32) / copy_gbps)
                          .num("ratio_to_floor", (main8 ? ns8 : ns32) / ((main8 ? moved8 : moved32) / copy_gbps))
                          .done()
                          .c_str());
  return 0;
}

int cmd_optimizer(Options& o) {
  const bool cuda = device_is_cuda(o);
  const zero8::optim::Algo algo = algo_option(o);
  const std::string bits_arg = o.str("bits", "8");
  if (bits_arg != "8" && bits_arg != "32") throw UsageError{"--bits must be 8 or 32, got '" + bits_arg + "'"};
  const int bits = std::stoi(bits_arg);
  if (cuda) return cmd_optimizer_cuda(o, algo, bits);
  const int64_t n = o.count("numel", 100000000, 1, int64_t(1) << 34);
  const int32_t block = block_option(o);
  const int threads = threads_option(o);
  const int repeat = int(o.count("repeat", 7, 1, 1000));
  o.check_all_used();

  print_header("optimizer", threads, repeat);
  CopyBench cb(n);
  Buffer<float> param(n), grad(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    param.p[i] = 0.02f * (zero8::rng_uniform(1, uint64_t(i)) - 0.5f);
    grad.p[i] = 1e-3f * (zero8::rng_uniform(2, uint64_t(i)) - 0.5f);
  }
  // Both share the parameter and gradient buffers: each step moves the same bytes of them.
  StepBench b8(algo, 8, block, n, param.p, grad.p, threads), b32(algo, 32, block, n, param.p, grad.p, threads);
  std::vector<std::function<void()>> kernels = {cb.copy(), cb.inplace(), b8.step(), b32.step()};
  std::unique_ptr<Linear8Bench> lin;
  if (algo == zero8::optim::Algo::adamw) {
    linear8_check(block);
    lin = std::make_unique<Linear8Bench>(b8.h, block, n, param.p, grad.p, threads);
    kernels.push_back(lin->step());
  }
  const std::vector<double> t = time_interleaved(repeat, kernels);
  cb.verify();
  const double copy_gbps = cb.gbps(CopyBench::kCopyBytes, t[0]), inplace_gbps = cb.gbps(CopyBench::kInplaceBytes, t[1]);
  struct Row {
    const char* name;
    const StepBench* b;
    double seconds;
  };
  const Row r8{"8-bit", &b8, t[2]}, r32{"32-bit", &b32, t[3]};
  const Row& main_r = bits == 8 ? r8 : r32;

  auto ns = [&](const Row& r) { return r.seconds / double(n) * 1e9; };
  // The bandwidth floor: bytes moved / copy GB/s. The step updates in place (no write-allocate
  // reads), so the in-place floor (bytes moved / in-place GB/s) is the tighter one; both are shown.
  auto floor_ns = [&](const Row& r) { return r.b->moved_bytes_per_param() / copy_gbps; };
  auto floor_inplace_ns = [&](const Row& r) { return r.b->moved_bytes_per_param() / inplace_gbps; };
  const char* name = zero8::optim::algo_name(algo);
  std::printf("%s, numel %lld, float32 params and grads, state block %d\n", name, (long long)n, block);
  std::printf("bandwidth: copy %.2f GB/s (STREAM loop), add in place %.2f GB/s\n", copy_gbps, inplace_gbps);
  std::printf("%-8s %10s %10s %14s %14s %10s %9s %14s %9s\n", "states", "ms/step", "ns/param", "state B/param",
              "moved B/param", "floor ns", "x floor", "in-place floor", "x floor");
  for (const Row* r : {&r8, &r32}) {
    std::printf("%-8s %10.3f %10.4f %14.4f %14.4f %10.4f %9.3f %14.4f %9.3f\n", r->name, r->seconds * 1e3, ns(*r),
                r->b->state_bytes_per_param(), r->b->moved_bytes_per_param(), floor_ns(*r), ns(*r) / floor_ns(*r),
                floor_inplace_ns(*r), ns(*r) / floor_inplace_ns(*r));
  }
  const double speedup = r32.seconds / r8.seconds;
  std::printf("8-bit step: %.3fx the speed of the 32-bit step (%s)\n", speedup, speedup >= 1.0 ? "faster" : "slower");
  if (lin) {
    // The same bytes moved as the 8-bit step (one code per state and element, a scale per block).
    const double lin_ns = t[4] / double(n) * 1e9;
    std::printf("yardstick: the 8-bit step with linear int8 codes (no map lookups, not a zero8 optimizer):\n"
                "%-8s %10.3f %10.4f %14.4f %14.4f %10.4f %9.3f %14.4f %9.3f\n"
                "yardstick: %.3fx the speed of the 32-bit step; the 8-bit step runs at %.3fx its speed\n",
                "linear8", t[4] * 1e3, lin_ns, r8.b->state_bytes_per_param(), r8.b->moved_bytes_per_param(),
                floor_ns(r8), lin_ns / floor_ns(r8), floor_inplace_ns(r8), lin_ns / floor_inplace_ns(r8),
                r32.seconds / t[4], t[4] / r8.seconds);
  }
  Json json;
  json.str("bench", "optimizer")
      .str("name", name)
      .integer("bits", bits)
      .integer("numel", n)
      .integer("block", block)
      .integer("threads", threads)
      .str("isa", zero8::isa_name(zero8::isa_active()))
      .num("ns_per_param", ns(main_r))
      .num("bytes_per_param_state", main_r.b->state_bytes_per_param())
      .num("ns_per_param_8bit", ns(r8))
      .num("ns_per_param_32bit", ns(r32))
      .num("speedup_8_vs_32", r32.seconds / r8.seconds)
      .num("copy_gbps", copy_gbps)
      .num("moved_bytes_per_param", main_r.b->moved_bytes_per_param())
      .num("floor_ns_per_param", floor_ns(main_r))
      .num("ratio_to_floor", ns(main_r) / floor_ns(main_r))
      .num("inplace_gbps", inplace_gbps)
      .num("ratio_to_inplace_floor", ns(main_r) / floor_inplace_ns(main_r));
  if (lin)
    json.num("ns_per_param_linear8", t[4] / double(n) * 1e9)
        .num("speedup_linear8_vs_32", r32.seconds / t[4])
        .num("ratio_8bit_to_linear8", r8.seconds / t[4]);
  std::printf("%s\n", json.done().c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// comm: the sharded optimizer's traffic under mpirun (one rank per process)
//
// Per configuration: bytes this rank sends per step for the gradient reduce-scatter and for the
// parameter all-gather (the communicator's exact byte counters), the slowest rank's time of each,
// and the optimizer-state and fp32-master bytes this rank holds per model parameter.

struct CommRun {
  double reduce_bytes = 0, sync_bytes = 0, reduce_s = 0, step_s = 0;
  double state_per_param = 0, master_per_param = 0;
};

CommRun comm_run(zero8::comm::Communicator& world, int64_t n, int steps, bool int8_grads, bool int8_params,
                 int32_t wire_block, int threads) {
  using namespace zero8;
  shard::ShardConfig c;
  c.layout.wire_block = wire_block;
  c.algo = optim::Algo::adamw;
  c.int8_grads = int8_grads;
  c.int8_params = int8_params;
  c.working_dtype = DType::bf16;
  c.threads = threads;
  shard::ShardedOptimizer opt({{"w", {n}}}, c, world);
  uint16_t* w = static_cast<uint16_t*>(opt.param_working(0));
  for (int64_t i = 0; i < n; ++i) w[i] = f32_to_bf16(rng_uniform(1, uint64_t(i)) - 0.5f);
  opt.init(0);
  CommRun r;
  std::vector<double> reduce_t, step_t;
  for (int s = 0; s < steps + 1; ++s) {  // step 0 warms up
    float* g = opt.param_grad(0);
    for (int64_t i = 0; i < n; ++i) g[i] = (rng_uniform(uint64_t(2 + s * 64 + world.rank()), uint64_t(i)) - 0.5f) * 1e-2f;
    world.barrier();
    world.stats_reset();
    auto t0 = std::chrono::steady_clock::now();
    opt.grad_ready(0);
    opt.backward_end(true);
    auto t1 = std::chrono::steady_clock::now();
    const auto reduce_stats = world.stats();
    opt.step();
    auto t2 = std::chrono::steady_clock::now();
    const auto all = world.stats();
    if (s == 0) continue;
    r.reduce_bytes += double(reduce_stats.op(comm::OpKind::all_to_all_v).bytes);
    r.sync_bytes += double(all.op(comm::OpKind::all_gather_v).bytes);
    reduce_t.push_back(world.all_reduce_value<double>(std::chrono::duration<double>(t1 - t0).count(), comm::ReduceOp::max));
    step_t.push_back(world.all_reduce_value<double>(std::chrono::duration<double>(t2 - t1).count(), comm::ReduceOp::max));
  }
  r.reduce_bytes /= steps;
  r.sync_bytes /= steps;
  r.reduce_s = median(reduce_t);
  r.step_s = median(step_t);
  const shard::MemoryStats m = opt.memory();
  r.state_per_param = double(m.state) / double(n);
  r.master_per_param = double(m.master) / double(n);
  return r;
}

// The tcp backend's world over the same processes: its contact strings exchanged over `host` (MPI here;
// zero8's Python layer uses torch.distributed's store under torchrun).
int cmd_comm(Options& o) {
  using namespace zero8;
  const int64_t n = o.count("numel", 20000000, 1, int64_t(1) << 34);
  const int steps = int(o.count("steps", 5, 1, 1000));
  const int32_t wire = int32_t(o.count("wire-block", 2048, 64, 4096));
  const int threads = threads_option(o);
  const std::string backend = o.str("backend", "auto");
  if (backend != "auto" && backend != "tcp" && backend != "both")
    throw UsageError{"--backend must be auto, tcp or both, got '" + backend + "'"};
  o.check_all_used();
  // The launcher's world (MPI under mpirun), and for tcp / both the same processes over the tcp backend,
  // its contacts exchanged over the launcher's world. Both: each row runs on one, then the other.
  std::vector<std::unique_ptr<comm::Communicator>> worlds;
  worlds.push_back(comm::comm_create("auto"));
  if (backend != "auto") worlds.push_back(comm::tcp_create(*worlds[0]));
  if (backend == "tcp") worlds.erase(worlds.begin());  // the tcp world keeps no reference to its host
  comm::Communicator& world = *worlds[0];
  const int N = world.size();
  std::string names;
  for (const auto& w : worlds) names += std::string(names.empty() ? "" : " vs ") + w->backend();
  if (world.rank() == 0)
    std::printf("zero8-bench comm | zero8 %s | %s | %d ranks (%s) | %d threads per rank | %lld params, AdamW "
                "8-bit, bf16 working copy | median of %d steps after 1 warm-up\n",
                zero8::version(), cpu_model().c_str(), N, names.c_str(), threads, static_cast<long long>(n), steps);
  struct Row {
    const char* name;
    bool g8, p8;
    CommRun r[2];
  } rows[] = {{"fp32 grads, bf16 params", false, false, {}},
              {"int8 grads, bf16 params", true, false, {}},
              {"int8 grads, int8 params", true, true, {}}};
  for (Row& row : rows)
    for (size_t w = 0; w < worlds.size(); ++w) row.r[w] = comm_run(*worlds[w], n, steps, row.g8, row.p8, wire, threads);
  const double ratio = rows[0].r[0].reduce_bytes > 0 ? rows[1].r[0].reduce_bytes / rows[0].r[0].reduce_bytes : 0.0;
  const double state_target = (2.0 + 8.0 / 256.0) / N, master_target = 4.0 / N;
  if (world.rank() == 0) {
    std::printf("%-26s %-8s %16s %10s %16s %10s\n", "configuration", "backend", "grad bytes/rank", "reduce ms",
                "param bytes/rank", "step ms");
    for (const Row& row : rows)
      for (size_t w = 0; w < worlds.size(); ++w)
        std::printf("%-26s %-8s %16.0f %10.2f %16.0f %10.2f\n", row.name, worlds[w]->backend(), row.r[w].reduce_bytes,
                    row.r[w].reduce_s * 1e3, row.r[w].sync_bytes, row.r[w].step_s * 1e3);
    if (N == 1)
      std::printf("one rank: nothing crosses a wire, so no row quantizes or sends anything (the sharded optimizer's "
                  "WirePlan); run under mpirun -np 2 or more for the wire figures\n");
    else
      std::printf("gradient bytes, int8 / fp32: %.4f (target <= 0.255)\n", ratio);
    if (worlds.size() == 2)
      std::printf("time over %s / over %s: reduce (int8 grads) %.2f, step with int8 sync %.2f\n", worlds[1]->backend(),
                  worlds[0]->backend(), rows[1].r[1].reduce_s / rows[1].r[0].reduce_s,
                  rows[2].r[1].step_s / rows[2].r[0].step_s);
    std::printf("optimizer state on rank 0: %.4f bytes/param (target 2.03/N = %.4f); fp32 master %.4f (4/N = %.4f)\n",
                rows[1].r[0].state_per_param, state_target, rows[1].r[0].master_per_param, master_target);
    Json json;
    json.str("bench", "comm")
        .str("backend", world.backend())
        .integer("world", N)
        .integer("numel", n)
        .integer("wire_block", wire)
        .num("grad_bytes_fp32", rows[0].r[0].reduce_bytes)
        .num("grad_bytes_int8", rows[1].r[0].reduce_bytes)
        .num("bytes_ratio", ratio)
        .num("reduce_ms_fp32", rows[0].r[0].reduce_s * 1e3)
        .num("reduce_ms_int8", rows[1].r[0].reduce_s * 1e3)
        .num("param_bytes_bf16", rows[1].r[0].sync_bytes)
        .num("param_bytes_int8", rows[2].r[0].sync_bytes)
        .num("step_ms_bf16_sync", rows[1].r[0].step_s * 1e3)
        .num("step_ms_int8_sync", rows[2].r[0].step_s * 1e3)
        .num("state_bytes_per_param", rows[1].r[0].state_per_param)
        .num("state_bytes_per_param_target", state_target)
        .num("master_bytes_per_param", rows[1].r[0].master_per_param);
    if (worlds.size() == 2)
      json.num("reduce_ms_fp32_tcp", rows[0].r[1].reduce_s * 1e3)
          .num("reduce_ms_int8_tcp", rows[1].r[1].reduce_s * 1e3)
          .num("step_ms_bf16_sync_tcp", rows[1].r[1].step_s * 1e3)
          .num("step_ms_int8_sync_tcp", rows[2].r[1].step_s * 1e3);
    std::printf("%s\n", json.done().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "zero8-bench: missing command\n\n%s", kUsage);
    return 2;
  }
  const std::string cmd = argv[1];
  // "help", and --help/-h anywhere (also after a command, as in "zero8-bench codec --help").
  bool help = cmd == "help";
  for (int i = 1; i < argc; ++i) help = help || std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0;
  if (help) {
    std::printf("%s", kUsage);
    return 0;
  }
  try {
    Options o(argc, argv, 2);
    if (cmd == "bandwidth") return cmd_bandwidth(o);
    if (cmd == "codec") return cmd_codec(o);
    if (cmd == "optimizer") return cmd_optimizer(o);
    if (cmd == "comm") return cmd_comm(o);
    throw UsageError{"unknown command '" + cmd + "'"};
  } catch (const UsageError& e) {
    std::fprintf(stderr, "zero8-bench: %s\n\n%s", e.msg.c_str(), kUsage);
    return 2;
  } catch (const zero8::Error& e) {
    std::fprintf(stderr, "zero8-bench: %s\n", e.what());
    return 1;
  }
}
