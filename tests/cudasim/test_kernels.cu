// Kernels of the CUDA simulator's own tests (tests/cudasim/test_cudasim.cpp): small CUDA programs, correct and
// broken, whose outcome on a GPU is known, compiled by the same rewrite as kernels/cuda/*.cu.
#include <cuda_runtime.h>
#include <mma.h>

#include "test_kernels.h"

namespace zero8_cudasim_test {
namespace {

// out[t] for thread t of one block: the shuffles' and votes' results, 6 values per thread.
__global__ void warp_ops_kernel(int* out) {
  const int t = int(threadIdx.x), lane = t & 31;
  int* o = out + 6 * t;
  o[0] = __shfl_xor_sync(0xffffffffu, t, 1);
  o[1] = __shfl_down_sync(0xffffffffu, t, 4);
  o[2] = __shfl_sync(0xffffffffu, t, 3);
  o[3] = int(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[4] = __all_sync(0xffffffffu, lane < 40) + 2 * __any_sync(0xffffffffu, lane == 31);
  o[5] = __syncthreads_count(t % 5 == 0);
}

// out[b] = whether block b's shared variable held NaN bytes before the block wrote it.
__global__ void shared_fresh_kernel(int* out) {
  __shared__ float v[64];
  __shared__ unsigned first;
  if (threadIdx.x == 0) first = 0;
  __syncthreads();
  if (v[threadIdx.x] != v[threadIdx.x]) atomicMax(&first, 1u);  // NaN: not written yet
  __syncthreads();
  v[threadIdx.x] = float(blockIdx.x);
  if (threadIdx.x == 0) out[blockIdx.x] = int(first);
}

// Thread 0 fills shared memory; every thread reads it with (barrier = 1) or without a barrier between.
__global__ void missing_barrier_kernel(float* out, int barrier) {
  __shared__ float v[256];
  if (threadIdx.x == 0)
    for (int i = 0; i < 256; ++i) v[i] = float(i);
  if (barrier) __syncthreads();
  out[threadIdx.x] = v[threadIdx.x];
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x >= 32) return;
  __syncthreads();
}

__global__ void exited_lane_kernel(int* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

__global__ void store_kernel(float* y, int64_t i, float v) { y[i] = v; }

__global__ void copy_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = x[i];
}

__global__ void dynamic_smem_kernel(int* out, int n) {
  extern __shared__ __align__(16) unsigned char raw[];
  int* s = reinterpret_cast<int*>(raw);
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = i;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s[n - 1];
}

// One warp: c (16 x 16 int32, row-major; stored back column-major when c_col) += a x b, each operand 16 x 16
// bytes read with the layout of its fragment, a from a + a_offset (to give it a misaligned pointer).
template <class LA, class LB>
__global__ void wmma_kernel(int* c, const signed char* a, const signed char* b, int a_offset, int c_col) {
  namespace w = nvcuda::wmma;
  w::fragment<w::matrix_a, 16, 16, 16, signed char, LA> fa;
  w::fragment<w::matrix_b, 16, 16, 16, signed char, LB> fb;
  w::fragment<w::accumulator, 16, 16, 16, int> fc;
  w::load_matrix_sync(fa, a + a_offset, 16);
  w::load_matrix_sync(fb, b, 16);
  w::load_matrix_sync(fc, c, 16, w::mem_row_major);
  w::mma_sync(fc, fa, fb, fc);
  w::store_matrix_sync(c, fc, 16, c_col ? w::mem_col_major : w::mem_row_major);
}

}  // namespace

void wmma(int* c, const signed char* a, const signed char* b, bool a_col, bool b_col, int a_offset, bool c_col) {
  namespace w = nvcuda::wmma;
  if (!a_col && !b_col) wmma_kernel<w::row_major, w::row_major><<<1, 32>>>(c, a, b, a_offset, c_col);
  if (!a_col && b_col) wmma_kernel<w::row_major, w::col_major><<<1, 32>>>(c, a, b, a_offset, c_col);
  if (a_col && !b_col) wmma_kernel<w::col_major, w::row_major><<<1, 32>>>(c, a, b, a_offset, c_col);
  if (a_col && b_col) wmma_kernel<w::col_major, w::col_major><<<1, 32>>>(c, a, b, a_offset, c_col);
}
void warp_ops(int* out, int threads) { warp_ops_kernel<<<1, threads>>>(out); }
void shared_fresh(int* out, int blocks) { shared_fresh_kernel<<<blocks, 64>>>(out); }
void missing_barrier(float* out, bool barrier) { missing_barrier_kernel<<<1, 256>>>(out, barrier ? 1 : 0); }
void divergent_barrier() { divergent_barrier_kernel<<<1, 64>>>(); }
void exited_lane(int* out) { exited_lane_kernel<<<1, 32>>>(out); }
void store(float* y, int64_t i, float v, cudaStream_t s) { store_kernel<<<1, 1, 0, s>>>(y, i, v); }
void copy(float* y, const float* x, int64_t n, cudaStream_t s) { copy_kernel<<<4, 64, 0, s>>>(y, x, n); }
void launch_grid(unsigned grid, unsigned block) { copy_kernel<<<grid, block>>>(nullptr, nullptr, 0); }
cudaError_t dynamic_smem(int* out, int n, bool opt_in) {
  const size_t bytes = size_t(n) * sizeof(int);
  if (opt_in) {
    const cudaError_t e = cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) return e;
  }
  dynamic_smem_kernel<<<1, 128, bytes>>>(out, n);
  return cudaGetLastError();
}

}  // namespace zero8_cudasim_test
