// cub::BlockReduce as zero8's CUDA simulator provides it (ZERO8_CUDA=SIM, tests only): every thread's
// value to shared storage, a barrier, then thread 0 folds them (from the last thread down, an order
// cub does not promise either); as in cub, only thread 0's return value is the aggregate, and the
// others get a NaN-filled value, so a kernel that reads it elsewhere fails its test.
#pragma once

#include <cstring>

#include "zero8_cudasim.h"

namespace cub {

template <class T, int kThreads>
class BlockReduce {
 public:
  struct TempStorage {
    T v[kThreads];
  };
  explicit BlockReduce(TempStorage& s) : s_(s) {}
  template <class Op>
  T Reduce(T x, Op op) {
    const int t = int(threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y);
    const int n = int(blockDim.x * blockDim.y * blockDim.z);
    s_.v[t] = x;
    __syncthreads();
    T r;
    if (t == 0) {
      r = s_.v[n - 1];
      for (int i = n - 2; i >= 0; --i) r = op(r, s_.v[i]);
    } else {
      std::memset(static_cast<void*>(&r), 0xff, sizeof(T));
    }
    __syncthreads();
    return r;
  }

 private:
  TempStorage& s_;
};

}  // namespace cub
