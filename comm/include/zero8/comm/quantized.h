// Bucket collectives in a chosen wire format, for ZeRO gradient reduction and parameter sync:
// reduce-scatter and all-gather of an fp32 bucket whose ranks own contiguous ranges, sent as int8
// blocks (codes + one fp32 scale per block: 25.05% of fp32 at block 2048), bf16, or exact fp32, on
// host or device buffers (the same steps and element math: the results are the same bits).
#pragma once

#include <cstdint>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::comm {

enum class WireFormat : uint8_t { f32 = 0, bf16 = 1, int8 = 2 };
const char* wire_format_name(WireFormat f);

struct WireOptions {
  WireFormat format = WireFormat::int8;
  int32_t block = 2048;  // int8 block: power of two in [64, 4096]; owner offsets must be multiples of it
  quant::MapKind map = quant::MapKind::dynamic_signed;
  bool stochastic = false;  // int8: stochastic rounding (unbiased); the stream is (seed, rank, element)
  uint64_t seed = 0;
  int threads = 0;          // codec threads (host buffers); 0 = the OpenMP default
};

// Bytes of n elements on the wire: f32 4n, bf16 2n, int8 n + 4 * ceil(n / block).
int64_t wire_bytes(WireFormat f, int64_t n, int32_t block);

// Scratch reused across calls (one per bucket stream avoids re-allocating every step). Device buckets
// use the device buffers, on one stream (the communicator's) per workspace.
struct WireWorkspace {
  std::vector<uint8_t> send, recv;
  std::vector<float> tmp;
  device::Buffer device_send, device_recv, device_tmp;
};

// Memory: the buffers of a call (bucket, out, residual; part, bucket) are all host memory or all device
// (or managed) memory; a host buffer among device ones is Error(invalid_argument) naming it. Host
// buffers need a host communicator (an NCCL communicator throws). Device buffers take any backend
// (NCCL; MPI stages the int8 blocks through page-locked memory, see communicator.h): the codec, the
// conversions and the sums run as CUDA kernels on comm.stream() (nullptr: the legacy default stream),
// the communicator's calls are ordered there too, and the call returns with its last kernels queued
// on that stream (asynchronous, as the *_cuda functions: later work on the stream sees the results;
// the host must synchronize the stream before reading them). Host and device runs of the same inputs
// give the same bits: the same codec (quant_map.h's element math on both sides), the same sums in the
// same order, each rounded once.

// Bucket layout shared by both calls: a bucket of n elements, rank p owns [offsets[p], offsets[p+1]).
// offsets has comm.size() + 1 entries, offsets[0] = 0, offsets[size] = n, non-decreasing; for int8
// every inner offset is a multiple of opt.block, so blocks are the same whichever rank encodes them.
// A rank may own an empty range.

// Reduce-scatter (collective): `bucket` holds this rank's n values; `out` (offsets[r+1] - offsets[r]
// values, not overlapping bucket) receives the sum over ranks of range r, computed in fp32 as a left fold in rank order.
// Each rank encodes the ranges it sends (never its own: its own contribution is added exactly, as
// quantizing it would add error without saving a byte), one all_to_all_v moves them, and the owner
// decodes and sums. With f32 the result is bit-identical to a serial rank-order sum.
// Error feedback (int8/bf16; ignored for f32): `residual` (n values, zero at start, kept by the
// caller across calls) is added before encoding and replaced by what the encoding lost:
// e = (x + e) - decode(encode(x + e)). The entries of this rank's own range stay untouched.
// Blocks that hold NaN/Inf leave their residual unchanged (the step will be skipped as overflowed),
// and the NaN still reaches the owner's sum.
void bucket_reduce_scatter(Communicator& comm, const float* bucket, int64_t n, const std::vector<int64_t>& offsets,
                           float* out, const WireOptions& opt, float* residual = nullptr,
                           WireWorkspace* ws = nullptr);

// All-gather (collective): this rank's range `part` (offsets[r+1] - offsets[r] values; may be
// bucket + offsets[r], in place) is encoded, gathered, and every range is decoded into `bucket`
// (n values) on every rank, this rank's own range included, so all replicas hold identical values.
// Also at size 1 (the codec's round trip): a caller that wants its values exact there passes f32.
void bucket_all_gather(Communicator& comm, const float* part, int64_t n, const std::vector<int64_t>& offsets,
                       float* bucket, const WireOptions& opt, WireWorkspace* ws = nullptr);

}  // namespace zero8::comm
