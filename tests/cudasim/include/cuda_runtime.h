// The CUDA runtime API as zero8's CUDA simulator provides it (ZERO8_CUDA=SIM, tests only;
// tests/cudasim/src/runtime.cpp): one simulated device, device memory in guarded host pages that host code
// cannot touch, streams whose work runs when the host waits for it. The functions zero8 calls, with the
// runtime's signatures.
#pragma once

#include "zero8_cudasim_types.h"

const char* cudaGetErrorString(cudaError_t e);
const char* cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status);

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaMallocManaged(void** p, size_t bytes, unsigned flags = cudaMemAttachGlobal);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaFree(void* p);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p);

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaStreamGetDevice(cudaStream_t s, int* device);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

// Kernel attributes and occupancy, by the kernel's address.
cudaError_t zero8_cudasim_func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value);
cudaError_t zero8_cudasim_occupancy(int* blocks, const void* kernel, int block_size, size_t dyn_smem);
template <class K>
cudaError_t cudaFuncSetAttribute(K* kernel, cudaFuncAttribute attr, int value) {
  return zero8_cudasim_func_set_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <class K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, K* kernel, int block_size, size_t dyn_smem) {
  return zero8_cudasim_occupancy(blocks, reinterpret_cast<const void*>(kernel), block_size, dyn_smem);
}

// The runtime's typed overloads of the allocators.
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocManaged(T** p, size_t bytes, unsigned flags = cudaMemAttachGlobal) {
  return cudaMallocManaged(reinterpret_cast<void**>(p), bytes, flags);
}
template <class T>
cudaError_t cudaMallocAsync(T** p, size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), bytes, stream);
}

// zero8's CUDA simulator only (tests, `#if ZERO8_WITH_CUDA_SIM`): what the program has asked of the device so
// far, so that a test can check where its work went.
struct zero8_cudasim_counts {
  unsigned long long kernels;            // launches
  unsigned long long ops_legacy_stream;  // kernels, copies and sets queued on the legacy default stream
  unsigned long long copies_to_host;     // device (or managed) memory to host memory
  unsigned long long copies_to_device;   // host memory to device (or managed) memory
  unsigned long long host_waits;         // cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize
  unsigned long long pointer_queries;    // cudaPointerGetAttributes (about a microsecond each on a GPU)
};
zero8_cudasim_counts zero8_cudasim_get_counts();
