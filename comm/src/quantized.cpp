// Bucket reduce-scatter / all-gather in int8 blocks, bf16 or fp32 (see quantized.h). The wire
// segment of one range in int8 is [ceil(len / block) fp32 scales][len uint8 codes].
#include "zero8/comm/quantized.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/vec.h"

namespace zero8::comm {

const char* wire_format_name(WireFormat f) {
  switch (f) {
    case WireFormat::f32: return "f32";
    case WireFormat::bf16: return "bf16";
    case WireFormat::int8: return "int8";
  }
  return "?";
}

int64_t wire_bytes(WireFormat f, int64_t n, int32_t block) {
  switch (f) {
    case WireFormat::f32: return 4 * n;
    case WireFormat::bf16: return 2 * n;
    case WireFormat::int8: return n + 4 * ((n + block - 1) / block);
  }
  return 0;
}

namespace {

// Segment starts are 8-byte aligned so the fp32 scales at their head are aligned (a segment's
// length may be odd: the last range's codes). Gaps are not sent; byte counts are exact.
int64_t align8(int64_t x) { return (x + 7) & ~int64_t(7); }

void check_options(const WireOptions& opt) {
  ZERO8_CHECK_ARG(opt.format == WireFormat::f32 || opt.format == WireFormat::bf16 || opt.format == WireFormat::int8,
                  "opt.format", "unknown WireFormat " << int(opt.format));
  if (opt.format == WireFormat::int8) {
    const int32_t b = opt.block;
    ZERO8_CHECK_ARG(b >= 64 && b <= 4096 && (b & (b - 1)) == 0, "opt.block", "must be a power of two in [64, 4096], got " << b);
  }
}

void check_layout(const Communicator& comm, int64_t n, const std::vector<int64_t>& offsets, const WireOptions& opt) {
  const int size = comm.size();
  ZERO8_CHECK_ARG(n >= 0, "n", "must be >= 0, got " << n);
  ZERO8_CHECK_ARG(offsets.size() == size_t(size) + 1, "offsets",
                  "needs size() + 1 = " << size + 1 << " entries, got " << offsets.size());
  ZERO8_CHECK_ARG(offsets.front() == 0 && offsets.back() == n, "offsets",
                  "must start at 0 and end at n = " << n << " (got " << offsets.front() << " .. " << offsets.back() << ")");
  for (int p = 0; p < size; ++p) {
    ZERO8_CHECK_ARG(offsets[size_t(p)] <= offsets[size_t(p) + 1], "offsets", "decreasing at rank " << p);
    if (opt.format == WireFormat::int8 && p > 0)
      ZERO8_CHECK_ARG(offsets[size_t(p)] % opt.block == 0, "offsets",
                      "offset of rank " << p << " (" << offsets[size_t(p)] << ") is not a multiple of the wire block "
                                        << opt.block);
  }
}

// Where a call's buffers live (quantized.h, "Memory"): all on the device as soon as one is, else all on
// the host, which needs a host communicator.
vec::Where buffers_where(const Communicator& comm, const char* op,
                         std::initializer_list<std::pair<const void*, const char*>> bufs) {
  bool dev = false;
  for (const auto& [p, name] : bufs) dev = dev || (p != nullptr && device::on_device(p));
  if (!dev) {
    check_host_memory(comm, "comm", "the bucket collectives", "device buffers");
    return vec::Where{};
  }
  for (const auto& [p, name] : bufs) device::check_device_ptr(p, name, std::string(op) + " (device buffers)");
  return vec::Where{MemSpace::device, comm.stream()};
}

// The scratch of one call: the workspace's host vectors or device buffers, grown to fit.
struct Scratch {
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  float* tmp = nullptr;
  Scratch(WireWorkspace& w, const vec::Where& where, int64_t send_bytes, int64_t recv_bytes, int64_t tmp_floats) {
    if (where.mem == MemSpace::host) {
      w.send.resize(size_t(send_bytes));
      w.recv.resize(size_t(recv_bytes));
      w.tmp.resize(size_t(tmp_floats));
      send = w.send.data();
      recv = w.recv.data();
      tmp = w.tmp.data();
      return;
    }
    const char* what = "bucket collective scratch";
    w.device_send.reserve(send_bytes, what);
    w.device_recv.reserve(recv_bytes, what);
    w.device_tmp.reserve(tmp_floats * 4, what);
    send = w.device_send.as<uint8_t>();
    recv = w.device_recv.as<uint8_t>();
    tmp = w.device_tmp.as<float>();
  }
};

const quant::QuantTable* table_for(const WireOptions& opt, const vec::Where& w) {
  return w.mem == MemSpace::device ? quant::table_get_device(opt.map) : &quant::table_get(opt.map);
}

// The codec on w's side: the dispatched CPU variant, or the CUDA kernels (a build without CUDA never
// sees device buffers: buffers_where finds none).
void codec_encode(const quant::EncodeArgs& a, const WireOptions& opt, const vec::Where& w) {
#if ZERO8_WITH_CUDA
  if (w.mem == MemSpace::device) return quant::quant_encode_cuda(a, w.stream);
#endif
  (void)w;
  quant::quant_encode(a, isa_active(), opt.threads);
}

void codec_decode(const quant::DecodeArgs& a, const WireOptions& opt, const vec::Where& w) {
#if ZERO8_WITH_CUDA
  if (w.mem == MemSpace::device) return quant::quant_decode_cuda(a, w.stream);
#endif
  (void)w;
  quant::quant_decode(a, isa_active(), opt.threads);
}

// Encode src[0, len) (a range starting at global element `base`) into one wire segment.
void segment_encode(const WireOptions& opt, const float* src, int64_t len, int64_t base, uint64_t seed, uint8_t* seg,
                    const vec::Where& w) {
  if (len == 0) return;
  switch (opt.format) {
    case WireFormat::f32:
      vec::copy(seg, src, len * 4, w);
      return;
    case WireFormat::bf16:
      vec::convert(seg, DType::bf16, src, DType::f32, len, w);
      return;
    case WireFormat::int8: {
      const int64_t nb = (len + opt.block - 1) / opt.block;
      quant::EncodeArgs a;
      a.x = src;
      a.dtype = DType::f32;
      a.n = len;
      a.block = opt.block;
      a.table = table_for(opt, w);
      a.absmax = reinterpret_cast<float*>(seg);
      a.codes = seg + nb * 4;
      a.stochastic = opt.stochastic;
      a.seed = seed;
      a.index_base = uint64_t(base);
      codec_encode(a, opt, w);
      return;
    }
  }
}

// Decode one wire segment into y[0, len): overwrite, or add (y = y + decoded) when accumulate.
void segment_decode(const WireOptions& opt, const uint8_t* seg, int64_t len, float* y, bool accumulate,
                    const vec::Where& w) {
  if (len == 0) return;
  switch (opt.format) {
    case WireFormat::f32:
      if (accumulate)
        vec::add(y, DType::f32, seg, DType::f32, len, w);
      else
        vec::copy(y, seg, len * 4, w);
      return;
    case WireFormat::bf16:
      if (accumulate)
        vec::add(y, DType::f32, seg, DType::bf16, len, w);
      else
        vec::convert(y, DType::f32, seg, DType::bf16, len, w);
      return;
    case WireFormat::int8: {
      const int64_t nb = (len + opt.block - 1) / opt.block;
      quant::DecodeArgs a;
      a.codes = seg + nb * 4;
      a.absmax = reinterpret_cast<const float*>(seg);
      a.n = len;
      a.block = opt.block;
      a.table = table_for(opt, w);
      a.y = y;
      a.dtype = DType::f32;
      a.accumulate = accumulate;
      codec_decode(a, opt, w);
      return;
    }
  }
}

// Error feedback for one range: e = v - decode(seg), where v = x + e_old was encoded into seg.
// Blocks whose int8 scale is NaN (non-finite input) keep their old residual.
void residual_update(const WireOptions& opt, const float* v, int64_t len, const uint8_t* seg, float* e, float* scratch,
                     const vec::Where& w) {
  segment_decode(opt, seg, len, scratch, false, w);
  const bool int8 = opt.format == WireFormat::int8;
  vec::residual_update(e, v, scratch, len, int8 ? reinterpret_cast<const float*>(seg) : nullptr, int8 ? opt.block : 0,
                       w);
}

}  // namespace

void bucket_reduce_scatter(Communicator& comm, const float* bucket, int64_t n, const std::vector<int64_t>& offsets,
                           float* out, const WireOptions& opt, float* residual, WireWorkspace* ws) {
  check_options(opt);
  check_layout(comm, n, offsets, opt);
  const int size = comm.size(), me = comm.rank();
  const int64_t mine = offsets[size_t(me) + 1] - offsets[size_t(me)];
  ZERO8_CHECK_ARG(n == 0 || bucket != nullptr, "bucket", "null buffer");
  ZERO8_CHECK_ARG(mine == 0 || out != nullptr, "out", "null buffer");
  ZERO8_CHECK_ARG(mine == 0 || n == 0 || out + mine <= bucket || out >= bucket + n, "out",
                  "must not overlap bucket (the owner's own values are read after other ranks' are summed)");
  const bool feedback = residual != nullptr && opt.format != WireFormat::f32;
  const vec::Where w = buffers_where(comm, "bucket_reduce_scatter",
                                     {{bucket, "bucket"}, {out, "out"}, {feedback ? residual : nullptr, "residual"}});
  WireWorkspace local;
  WireWorkspace& ws_ = ws != nullptr ? *ws : local;

  auto len = [&](int p) { return offsets[size_t(p) + 1] - offsets[size_t(p)]; };
  std::vector<int64_t> sb(size_t(size), 0), sd(size_t(size), 0), rb(size_t(size), 0), rd(size_t(size), 0);
  int64_t send_total = 0, recv_total = 0, max_len = 0;
  for (int p = 0; p < size; ++p) {
    if (p == me) continue;
    sd[size_t(p)] = send_total;
    sb[size_t(p)] = wire_bytes(opt.format, len(p), opt.block);
    send_total = align8(send_total + sb[size_t(p)]);
    rd[size_t(p)] = recv_total;
    rb[size_t(p)] = wire_bytes(opt.format, mine, opt.block);
    recv_total = align8(recv_total + rb[size_t(p)]);
    max_len = std::max(max_len, len(p));
  }
  const Scratch sc(ws_, w, send_total, recv_total, feedback ? 2 * max_len : 0);
  const uint64_t seed = rng_mix(opt.seed, uint64_t(me));

  for (int p = 0; p < size; ++p) {
    if (p == me || len(p) == 0) continue;
    const int64_t off = offsets[size_t(p)];
    uint8_t* seg = sc.send + sd[size_t(p)];
    if (!feedback) {
      segment_encode(opt, bucket + off, len(p), off, seed, seg, w);
      continue;
    }
    float* v = sc.tmp;
    float* e = residual + off;
    vec::sum(v, bucket + off, e, len(p), w);
    segment_encode(opt, v, len(p), off, seed, seg, w);
    residual_update(opt, v, len(p), seg, e, sc.tmp + max_len, w);
  }

  comm.all_to_all_v(sc.send, sb, sd, sc.recv, rb, rd);

  if (mine == 0) return;
  const float* own = bucket + offsets[size_t(me)];
  for (int q = 0; q < size; ++q) {
    if (q == me) {
      if (q == 0)
        vec::copy(out, own, mine * 4, w);
      else
        vec::add(out, DType::f32, own, DType::f32, mine, w);
    } else {
      segment_decode(opt, sc.recv + rd[size_t(q)], mine, out, q != 0, w);
    }
  }
}

void bucket_all_gather(Communicator& comm, const float* part, int64_t n, const std::vector<int64_t>& offsets,
                       float* bucket, const WireOptions& opt, WireWorkspace* ws) {
  check_options(opt);
  check_layout(comm, n, offsets, opt);
  const int size = comm.size(), me = comm.rank();
  const int64_t mine = offsets[size_t(me) + 1] - offsets[size_t(me)];
  ZERO8_CHECK_ARG(mine == 0 || part != nullptr, "part", "null buffer");
  ZERO8_CHECK_ARG(n == 0 || bucket != nullptr, "bucket", "null buffer");
  const vec::Where w = buffers_where(comm, "bucket_all_gather", {{mine > 0 ? part : nullptr, "part"}, {bucket, "bucket"}});

  if (opt.format == WireFormat::f32) {
    // The payload is the bucket itself: gather in place.
    float* own = bucket + offsets[size_t(me)];
    if (part != own && mine > 0) {
      if (w.mem == MemSpace::host) {
        std::memmove(own, part, size_t(mine) * 4);
      } else {
        ZERO8_CHECK_ARG(part + mine <= own || part >= own + mine, "part",
                        "overlaps this rank's range of bucket without being it (device copies cannot overlap)");
        vec::copy(own, part, mine * 4, w);
      }
    }
    std::vector<int64_t> rb(static_cast<size_t>(size)), rd(static_cast<size_t>(size));
    for (int p = 0; p < size; ++p) {
      rd[size_t(p)] = offsets[size_t(p)] * 4;
      rb[size_t(p)] = (offsets[size_t(p) + 1] - offsets[size_t(p)]) * 4;
    }
    comm.all_gather_v(own, mine * 4, bucket, rb, rd);
    return;
  }

  WireWorkspace local;
  WireWorkspace& ws_ = ws != nullptr ? *ws : local;
  std::vector<int64_t> rb(static_cast<size_t>(size)), rd(static_cast<size_t>(size));
  int64_t total = 0;
  for (int p = 0; p < size; ++p) {
    rd[size_t(p)] = total;
    rb[size_t(p)] = wire_bytes(opt.format, offsets[size_t(p) + 1] - offsets[size_t(p)], opt.block);
    total = align8(total + rb[size_t(p)]);
  }
  const Scratch sc(ws_, w, 0, total, 0);
  uint8_t* own_seg = sc.recv + rd[size_t(me)];
  segment_encode(opt, part, mine, offsets[size_t(me)], rng_mix(opt.seed, uint64_t(me)), own_seg, w);
  comm.all_gather_v(own_seg, rb[size_t(me)], sc.recv, rb, rd);
  for (int p = 0; p < size; ++p) {
    const int64_t len = offsets[size_t(p) + 1] - offsets[size_t(p)];
    segment_decode(opt, sc.recv + rd[size_t(p)], len, bucket + offsets[size_t(p)], false, w);
  }
}

}  // namespace zero8::comm
