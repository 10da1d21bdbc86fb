// Element-wise vector operations of the bucket collectives and the sharded optimizer, for host memory
// (OpenMP above 64K elements) or a CUDA device (asynchronous on a stream): one call site serves both
// memories, and both sides run the same element math (hd.h's conversions, one rounding per operation), so
// their results are the same bits. Raw kernels: lengths and pointers are the callers' to validate.
#pragma once

#include <cstdint>

#include "zero8/kernels/device.h"
#include "zero8/kernels/hd.h"

namespace zero8::vec {

// Where the operands live and, on the device, the stream (cudaStream_t; null: the legacy default
// stream) the work is queued on. Host operations complete before they return.
struct Where {
  MemSpace mem = MemSpace::host;
  void* stream = nullptr;
};

void copy(void* dst, const void* src, int64_t bytes, const Where& w);
void zero(void* dst, int64_t bytes, const Where& w);
// y[i] = x[i], converted from xt to yt (rounding to nearest even into 16 bits).
void convert(void* y, DType yt, const void* x, DType xt, int64_t n, const Where& w);
// y[i] = y[i] + x[i], computed in float32 and rounded into yt.
void add(void* y, DType yt, const void* x, DType xt, int64_t n, const Where& w);
// z[i] = a[i] + b[i] (float32; z may be a or b).
void sum(float* z, const float* a, const float* b, int64_t n, const Where& w);
// z[i] = a[i] - x[i] (x of xt, widened to float32).
void diff(float* z, const float* a, const void* x, DType xt, int64_t n, const Where& w);
// Error feedback: e[i] = v[i] - d[i] (v encoded, d its decoding), except where the encoding saw a
// non-finite value, which keeps its old e[i]: with block > 0, the int8 blocks of `block` elements whose
// scale (scales[i / block]) is NaN; with block == 0 (scales unused), the elements whose v is not finite.
void residual_update(float* e, const float* v, const float* d, int64_t n, const float* scales, int32_t block,
                     const Where& w);

// Sum of x[i]^2 over n floats, in double, in one fixed order shared by the CPU and the CUDA kernel, so
// the result has the same bits on both and for any thread count. Level 0 cuts x into blocks of
// kSumBlock = 1024 elements; in each, lane t of kSumLanes = 256 adds x[t]^2, x[t+256]^2, x[t+512]^2 and
// x[t+768]^2 (those that exist, in this order, from 0), then the lanes are folded pairwise,
// lane[t] += lane[t + s] for s = 128, 64, ..., 1, and lane 0 is the block's sum. Each further level sums
// the previous level's block sums (not squared) the same way, until one value is left (0 for n = 0).
// Products of floats are exact in double, so only the additions round. The sum is finite exactly when
// every x[i] is (for n < 2^60): the sharded optimizer's overflow test. `out` is one double in w's memory;
// `work` holds sum_squares_work(n) doubles there.
constexpr int kSumBlock = 1024;
constexpr int kSumLanes = 256;
int64_t sum_squares_work(int64_t n);
void sum_squares(const float* x, int64_t n, double* out, double* work, const Where& w);

// The CUDA side of the operations above (kernels/cuda/vec_kernel.cu): device pointers, asynchronous on
// `stream`. Without CUDA they throw Error(unsupported).
void convert_cuda(void* y, DType yt, const void* x, DType xt, int64_t n, void* stream);
void add_cuda(void* y, DType yt, const void* x, DType xt, int64_t n, void* stream);
void sum_cuda(float* z, const float* a, const float* b, int64_t n, void* stream);
void diff_cuda(float* z, const float* a, const void* x, DType xt, int64_t n, void* stream);
void residual_update_cuda(float* e, const float* v, const float* d, int64_t n, const float* scales, int32_t block,
                          void* stream);
void sum_squares_cuda(const float* x, int64_t n, double* out, double* work, void* stream);

}  // namespace zero8::vec
