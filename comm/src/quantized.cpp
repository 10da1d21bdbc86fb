// Bucket reduce-scatter / all-gather in int8 blocks, bf16 or fp32 (see quantized.h). The wire
// segment of one range in int8 is [ceil(len / block) fp32 scales][len uint8 codes].
#include "zero8/comm/quantized.h"

#include <algorithm>
#include <cstring>

#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/hd.h"

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
  check_host_memory(comm, "comm", "the bucket collectives");
}

// Encode src[0, len) (a range starting at global element `base`) into one wire segment.
void segment_encode(const WireOptions& opt, const float* src, int64_t len, int64_t base, uint64_t seed, uint8_t* seg) {
  if (len == 0) return;
  switch (opt.format) {
    case WireFormat::f32:
      std::memcpy(seg, src, size_t(len) * 4);
      return;
    case WireFormat::bf16: {
      uint16_t* h = reinterpret_cast<uint16_t*>(seg);
      for (int64_t i = 0; i < len; ++i) h[i] = f32_to_bf16(src[i]);
      return;
    }
    case WireFormat::int8: {
      const int64_t nb = (len + opt.block - 1) / opt.block;
      quant::EncodeArgs a;
      a.x = src;
      a.dtype = DType::f32;
      a.n = len;
      a.block = opt.block;
      a.table = &quant::table_get(opt.map);
      a.absmax = reinterpret_cast<float*>(seg);
      a.codes = seg + nb * 4;
      a.stochastic = opt.stochastic;
      a.seed = seed;
      a.index_base = uint64_t(base);
      quant::quant_encode(a, isa_active(), opt.threads);
      return;
    }
  }
}

// Decode one wire segment into y[0, len): overwrite, or add (y += decoded) when accumulate.
void segment_decode(const WireOptions& opt, const uint8_t* seg, int64_t len, float* y, bool accumulate) {
  if (len == 0) return;
  switch (opt.format) {
    case WireFormat::f32: {
      const float* x = reinterpret_cast<const float*>(seg);
      if (!accumulate) {
        std::memcpy(y, x, size_t(len) * 4);
      } else {
        for (int64_t i = 0; i < len; ++i) y[i] = y[i] + x[i];
      }
      return;
    }
    case WireFormat::bf16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(seg);
      if (!accumulate) {
        for (int64_t i = 0; i < len; ++i) y[i] = bf16_to_f32(h[i]);
      } else {
        for (int64_t i = 0; i < len; ++i) y[i] = y[i] + bf16_to_f32(h[i]);
      }
      return;
    }
    case WireFormat::int8: {
      const int64_t nb = (len + opt.block - 1) / opt.block;
      quant::DecodeArgs a;
      a.codes = seg + nb * 4;
      a.absmax = reinterpret_cast<const float*>(seg);
      a.n = len;
      a.block = opt.block;
      a.table = &quant::table_get(opt.map);
      a.y = y;
      a.dtype = DType::f32;
      a.accumulate = accumulate;
      quant::quant_decode(a, isa_active(), opt.threads);
      return;
    }
  }
}

// Error feedback for one range: e = v - decode(seg), where v = x + e_old was encoded into seg.
// Blocks whose int8 scale is NaN (non-finite input) keep their old residual.
void residual_update(const WireOptions& opt, const float* v, int64_t len, const uint8_t* seg, float* e, float* scratch) {
  segment_decode(opt, seg, len, scratch, false);
  if (opt.format == WireFormat::int8) {
    const float* scales = reinterpret_cast<const float*>(seg);
    for (int64_t lo = 0, b = 0; lo < len; lo += opt.block, ++b) {
      if (!(scales[b] == scales[b])) continue;
      const int64_t hi = std::min(len, lo + opt.block);
      for (int64_t i = lo; i < hi; ++i) e[i] = v[i] - scratch[i];
    }
  } else {
    for (int64_t i = 0; i < len; ++i)
      if (v[i] - v[i] == 0.0f) e[i] = v[i] - scratch[i];
  }
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
  WireWorkspace local;
  WireWorkspace& w = ws != nullptr ? *ws : local;

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
  w.send.resize(size_t(send_total));
  w.recv.resize(size_t(recv_total));
  if (feedback) w.tmp.resize(size_t(2 * max_len));
  const uint64_t seed = rng_mix(opt.seed, uint64_t(me));

  for (int p = 0; p < size; ++p) {
    if (p == me || len(p) == 0) continue;
    const int64_t off = offsets[size_t(p)];
    uint8_t* seg = w.send.data() + sd[size_t(p)];
    if (!feedback) {
      segment_encode(opt, bucket + off, len(p), off, seed, seg);
      continue;
    }
    float* v = w.tmp.data();
    float* e = residual + off;
    for (int64_t i = 0; i < len(p); ++i) v[i] = bucket[off + i] + e[i];
    segment_encode(opt, v, len(p), off, seed, seg);
    residual_update(opt, v, len(p), seg, e, w.tmp.data() + max_len);
  }

  comm.all_to_all_v(w.send.data(), sb, sd, w.recv.data(), rb, rd);

  if (mine == 0) return;
  const float* own = bucket + offsets[size_t(me)];
  for (int q = 0; q < size; ++q) {
    if (q == me) {
      if (q == 0) {
        std::memcpy(out, own, size_t(mine) * 4);
      } else {
        for (int64_t i = 0; i < mine; ++i) out[i] = out[i] + own[i];
      }
    } else {
      segment_decode(opt, w.recv.data() + rd[size_t(q)], mine, out, q != 0);
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

  if (opt.format == WireFormat::f32) {
    // The payload is the bucket itself: gather in place.
    float* own = bucket + offsets[size_t(me)];
    if (part != own && mine > 0) std::memmove(own, part, size_t(mine) * 4);
    std::vector<int64_t> rb(static_cast<size_t>(size)), rd(static_cast<size_t>(size));
    for (int p = 0; p < size; ++p) {
      rd[size_t(p)] = offsets[size_t(p)] * 4;
      rb[size_t(p)] = (offsets[size_t(p) + 1] - offsets[size_t(p)]) * 4;
    }
    comm.all_gather_v(own, mine * 4, bucket, rb, rd);
    return;
  }

  WireWorkspace local;
  WireWorkspace& w = ws != nullptr ? *ws : local;
  std::vector<int64_t> rb(static_cast<size_t>(size)), rd(static_cast<size_t>(size));
  int64_t total = 0;
  for (int p = 0; p < size; ++p) {
    rd[size_t(p)] = total;
    rb[size_t(p)] = wire_bytes(opt.format, offsets[size_t(p) + 1] - offsets[size_t(p)], opt.block);
    total = align8(total + rb[size_t(p)]);
  }
  w.recv.resize(size_t(total));
  uint8_t* own_seg = w.recv.data() + rd[size_t(me)];
  segment_encode(opt, part, mine, offsets[size_t(me)], rng_mix(opt.seed, uint64_t(me)), own_seg);
  comm.all_gather_v(own_seg, rb[size_t(me)], w.recv.data(), rb, rd);
  for (int p = 0; p < size; ++p) {
    const int64_t len = offsets[size_t(p) + 1] - offsets[size_t(p)];
    segment_decode(opt, w.recv.data() + rd[size_t(p)], len, bucket + offsets[size_t(p)], false);
  }
}

}  // namespace zero8::comm
