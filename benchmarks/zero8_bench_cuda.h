// zero8-bench --device cuda: the bandwidth, codec and optimizer measurements on the GPU, timed with CUDA
// events round-robin as the CPU ones are (zero8_bench.cpp prints them). Each checks its kernel's result
// against the CPU before its time counts. Every function throws zero8::Error (unsupported) when zero8 was
// built without CUDA or no device is usable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"

namespace zero8::bench {

struct CudaDeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0, sms = 0;
  double memory_gib = 0.0;
};
// Device 0 (the current device): its name, compute capability, multiprocessors and memory.
CudaDeviceInfo cuda_device_info();

// Median seconds of one device-to-device copy of n floats (cudaMemcpyAsync).
double cuda_bench_copy(int64_t n, int repeat);

struct CudaCodecTimes {
  double copy = 0, quantize = 0, dequantize = 0, both = 0;  // median seconds, the block kernels
  double quantize_warp = 0, dequantize_warp = 0, both_warp = 0;  // the warp kernels (CudaQuantKernels)
};
// x: host data of n_host elements of dtype (a whole number of blocks, or all of n), tiled over the n
// device elements. In each form of the kernels, the device's codes, scales and decodes of the first n_host
// elements must equal the CPU codec's bit for bit (else Error internal); both forms are timed in the same
// rounds (stochastic rounding has no warp quantizer: the block one runs in both). The process's setting is
// left as it was.
CudaCodecTimes cuda_bench_codec(const void* x_host, int64_t n_host, int64_t n, int32_t block, DType dtype,
                                bool stochastic, int repeat);

struct CudaOptimTimes {
  double copy = 0, step8 = 0, step8_warp = 0, step32 = 0;  // median seconds
};
// One fused step of `algo` over n float32 parameters with 8-bit states, by each form of the CUDA kernels
// (block, warp: CudaQuantKernels; a block size without a warp kernel runs the block one twice), and with
// 32-bit states (same parameter and gradient buffers), beside a copy of n floats, in the same rounds.
// Before timing, each step on a few blocks must equal the CPU reference bit for bit. LAMB and LARS (two
// phases with a host round trip) are not offered. The process's kernel setting is left as it was.
CudaOptimTimes cuda_bench_optimizer(optim::Algo algo, const optim::Hyper& h, int64_t n, int32_t block, int repeat);

}  // namespace zero8::bench
