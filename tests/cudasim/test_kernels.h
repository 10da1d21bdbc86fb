// Launchers of the CUDA simulator's test kernels (test_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace zero8_cudasim_test {

void warp_ops(int* out, int threads);
void shared_fresh(int* out, int blocks);
void missing_barrier(float* out, bool barrier);
void divergent_barrier();
void exited_lane(int* out);
void store(float* y, int64_t i, float v, cudaStream_t s);
void copy(float* y, const float* x, int64_t n, cudaStream_t s);
void launch_grid(unsigned grid, unsigned block);
cudaError_t dynamic_smem(int* out, int n, bool opt_in);
void wmma(int* c, const signed char* a, const signed char* b, bool a_col, bool b_col, int a_offset, bool c_col);

}  // namespace zero8_cudasim_test
