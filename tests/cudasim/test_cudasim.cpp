// The CUDA simulator's own tests: the warp shuffles and votes give CUDA's results, and what the simulator
// claims to catch in CUDA code it does catch (a missing barrier, a barrier or shuffle some threads never
// reach, host code reading device memory, a kernel writing past an allocation, a host read before the
// stream ran, a stream using another's result without an event, invalid launches, a stream, event or device
// memory used on another device). They run with two devices.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_kernels.h"

namespace {

namespace k = zero8_cudasim_test;

template <class T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

TEST(CudaSim, WarpShufflesAndVotesGiveCudasResults) {
  const int threads = 64;
  Dev<int> out(6 * threads);
  k::warp_ops(out.p, threads);
  const std::vector<int> o = out.get(6 * threads);
  unsigned ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int t = 0; t < threads; ++t) {
    const int lane = t & 31, base = t - lane;
    SCOPED_TRACE(t);
    EXPECT_EQ(o[6 * t + 0], t ^ 1);
    EXPECT_EQ(o[6 * t + 1], lane + 4 < 32 ? t + 4 : t);  // beyond the warp: the lane's own value
    EXPECT_EQ(o[6 * t + 2], base + 3);
    EXPECT_EQ(unsigned(o[6 * t + 3]), ballot);
    EXPECT_EQ(o[6 * t + 4], 1 + 2);
    EXPECT_EQ(o[6 * t + 5], (threads + 4) / 5);
  }
}

TEST(CudaSim, SharedMemoryIsFreshGarbageInEveryBlock) {
  Dev<int> out(3);
  k::shared_fresh(out.p, 3);
  EXPECT_EQ(out.get(3), (std::vector<int>{1, 1, 1}));
}

TEST(CudaSim, AMissingBarrierShowsAsGarbage) {
  Dev<float> out(256);
  k::missing_barrier(out.p, true);
  std::vector<float> v = out.get(256);
  for (int i = 0; i < 256; ++i) ASSERT_EQ(v[size_t(i)], float(i));
  k::missing_barrier(out.p, false);
  v = out.get(256);
  int garbage = 0;
  for (float x : v) garbage += std::isnan(x) ? 1 : 0;
  EXPECT_GE(garbage, 224) << "the warps after thread 0's read before it wrote";
}

// wmma's 16 x 16 x 16 int8 product: C + A B in int32 for every layout of the operands and of C's store.
TEST(CudaSim, WarpMatrixProductsAreExact) {
  std::vector<signed char> a(256), b(256);
  std::vector<int> c(256);
  for (int i = 0; i < 256; ++i) {
    a[size_t(i)] = static_cast<signed char>((i * 37) % 255 - 127);
    b[size_t(i)] = static_cast<signed char>((i * 91 + 5) % 255 - 127);
    c[size_t(i)] = i * 1000 - 7;
  }
  Dev<signed char> da(256), db(256);
  Dev<int> dc(256);
  ASSERT_EQ(cudaMemcpy(da.p, a.data(), 256, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db.p, b.data(), 256, cudaMemcpyHostToDevice), cudaSuccess);
  for (int form = 0; form < 8; ++form) {
    const bool a_col = form & 1, b_col = form & 2, c_col = form & 4;
    SCOPED_TRACE(form);
    ASSERT_EQ(cudaMemcpy(dc.p, c.data(), 256 * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    k::wmma(dc.p, da.p, db.p, a_col, b_col, 0, c_col);
    const std::vector<int> got = dc.get(256);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        int want = c[size_t(i * 16 + j)];
        for (int q = 0; q < 16; ++q)
          want += int(a[size_t(a_col ? q * 16 + i : i * 16 + q)]) * int(b[size_t(b_col ? j * 16 + q : q * 16 + j)]);
        ASSERT_EQ(got[size_t(c_col ? j * 16 + i : i * 16 + j)], want) << i << "," << j;
      }
  }
}

TEST(CudaSimDeathTest, AMisalignedWarpMatrixPointerAborts) {
  EXPECT_DEATH(
      {
        Dev<signed char> a(512);
        Dev<signed char> b(256);
        Dev<int> c(256);
        k::wmma(c.p, a.p, b.p, false, false, 16, false);
        cudaDeviceSynchronize();
      },
      "wmma_kernel.*load_matrix_sync: the pointer is not 256-bit aligned");
}

TEST(CudaSimDeathTest, ABarrierAfterExitedThreadsAborts) {
  EXPECT_DEATH(
      {
        k::divergent_barrier();
        cudaDeviceSynchronize();
      },
      "divergent_barrier_kernel, block \\(0,0,0\\).*__syncthreads after some of the block's threads exited");
}

TEST(CudaSimDeathTest, AShuffleWithAnExitedLaneAborts) {
  EXPECT_DEATH(
      {
        Dev<int> out(32);
        k::exited_lane(out.p);
        cudaDeviceSynchronize();
      },
      "exited_lane_kernel.*names lane 5, which has exited");
}

TEST(CudaSimDeathTest, HostCodeReadingDeviceMemoryAborts) {
  Dev<float> x(16);
  EXPECT_DEATH(
      {
        volatile float v = x.p[3];
        (void)v;
      },
      "host code dereferenced device memory");
}

TEST(CudaSimDeathTest, AKernelWritingPastItsAllocationAborts) {
  Dev<float> x(10);
  EXPECT_DEATH(
      {
        k::store(x.p, 10, 1.0f, nullptr);
        cudaDeviceSynchronize();
      },
      "store_kernel wrote past the end of the allocation of 40 bytes.*at byte 40");
  EXPECT_DEATH(
      {
        k::store(x.p, 1024, 1.0f, nullptr);
        cudaDeviceSynchronize();
      },
      "kernel store_kernel, block \\(0,0,0\\), thread \\(0,0,0\\): access at .* outside the allocation of 40 bytes");
}

// A kernel on device 1 that touches device 0's memory (a buffer allocated while the wrong device was
// current): a GPU faults without peer access, and so does the simulator, naming both devices. A copy
// between the devices works.
TEST(CudaSimDeathTest, AKernelTouchingAnotherDevicesMemoryAborts) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  Dev<float> x0(4);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  Dev<float> x1(4);
  ASSERT_EQ(cudaMemset(x1.p, 0, 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x0.p, x1.p, 16, cudaMemcpyDeviceToDevice), cudaSuccess);
  EXPECT_DEATH(
      {
        k::store(x0.p, 1, 1.0f, nullptr);
        cudaDeviceSynchronize();
      },
      "kernel store_kernel, block \\(0,0,0\\), thread \\(0,0,0\\): access at .* to device 0's memory \\(allocation of "
      "16 bytes at .*\\) by work on device 1");
  k::store(x1.p, 1, 1.0f, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // device 0's streams do not wait for device 1's
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(x0.get(4), std::vector<float>(4, 0.0f));
  EXPECT_EQ(x1.get(4)[1], 1.0f);
}

// Work on a stream runs when the host waits for it: a result read before that is the old one.
TEST(CudaSim, StreamsRunWhenTheHostWaits) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  Dev<float> y(4);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(y.p, 0, 4 * sizeof(float), s), cudaSuccess);
  pinned[2] = -1.0f;
  k::store(y.p, 2, 7.0f, s);
  ASSERT_EQ(cudaMemcpyAsync(pinned, y.p, 4 * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(pinned[2], -1.0f) << "to pinned memory the copy is asynchronous";
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
  EXPECT_EQ(pinned[2], 7.0f);
  // To pageable memory the call returns after the copy.
  k::store(y.p, 1, 5.0f, s);
  std::vector<float> h(4, -1.0f);
  ASSERT_EQ(cudaMemcpyAsync(h.data(), y.p, 4 * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(h, (std::vector<float>{0.0f, 5.0f, 7.0f, 0.0f}));
  cudaEventDestroy(e);
  cudaFreeHost(pinned);
  cudaStreamDestroy(s);
}

// Non-blocking streams are ordered only by events: without one, a consumer runs before its producer.
TEST(CudaSim, AnotherStreamsResultNeedsAnEvent) {
  cudaStream_t a = nullptr, b = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t made = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&made, cudaEventDisableTiming), cudaSuccess);
  Dev<float> x(1), y(1);
  ASSERT_EQ(cudaMemset(x.p, 0, 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(y.p, 0, 4), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (bool with_event : {false, true}) {
    SCOPED_TRACE(with_event ? "with an event" : "without an event");
    k::store(x.p, 0, with_event ? 2.0f : 1.0f, a);
    if (with_event) {
      ASSERT_EQ(cudaEventRecord(made, a), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(b, made, 0), cudaSuccess);
    }
    k::copy(y.p, x.p, 1, b);
    ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
    const float expect = with_event ? 2.0f : 0.0f;  // without: b ran before a's store
    EXPECT_EQ(y.get(1)[0], expect);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  cudaEventDestroy(made);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

// Streams and events belong to the device current when they were made (the tests run with two devices): a
// launch on another device's stream and an event recorded on another device's stream fail, as on a machine
// with several GPUs; copies, waits and queries across devices work; each device has its own legacy stream,
// ordered with its own blocking streams only.
TEST(CudaSim, StreamsAndEventsBelongToTheirDevice) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GE(devices, 2) << "the simulator's tests run with ZERO8_CUDASIM_DEVICES=2";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t s0 = nullptr, s1 = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s0), cudaSuccess);  // blocking
  ASSERT_EQ(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming), cudaSuccess);
  Dev<float> x0(1);
  ASSERT_EQ(cudaMemset(x0.p, 0, 4), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&s1), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming), cudaSuccess);
  Dev<float> x1(1);
  (void)cudaGetLastError();
  k::store(x0.p, 0, 1.0f, s0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle) << "a launch on device 0's stream from device 1";
  k::store(x1.p, 0, 2.0f, s1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(e0, s1), cudaErrorInvalidResourceHandle) << "device 0's event on device 1's stream";
  EXPECT_EQ(cudaEventRecord(e0, cudaStreamLegacy), cudaErrorInvalidResourceHandle) << "the legacy stream is device 1's";
  (void)cudaGetLastError();
  int d = -1;
  ASSERT_EQ(cudaStreamGetDevice(cudaStreamLegacy, &d), cudaSuccess);
  EXPECT_EQ(d, 1);
  ASSERT_EQ(cudaEventRecord(e1, s1), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(s0, e1, 0), cudaSuccess) << "a wait across devices";
  EXPECT_EQ(cudaMemcpyAsync(x0.p, x1.p, 4, cudaMemcpyDeviceToDevice, s0), cudaSuccess)
      << "a copy on another device's stream";
  // Device 1's legacy stream does not wait for device 0's blocking stream s0.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  k::store(x0.p, 0, 3.0f, s0);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  k::store(x1.p, 0, 4.0f, cudaStreamLegacy);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(s0), cudaErrorNotReady) << "device 0's stream ran with device 1's legacy stream";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  k::store(x0.p, 0, 3.0f, s0);  // a query made progress: fresh work
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(s0), cudaErrorNotReady) << "device 1's synchronize ran device 0's stream";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(x0.get(1)[0], 3.0f);  // device 0's legacy stream (the copy) waits for s0
  EXPECT_EQ(x1.get(1)[0], 4.0f);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
}

TEST(CudaSim, InvalidLaunchesAreLaunchErrors) {
  (void)cudaGetLastError();
  k::launch_grid(0, 64);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  k::launch_grid(1, 2048);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "reading the error clears it";
  Dev<int> out(1);
  EXPECT_EQ(k::dynamic_smem(out.p, 1000, false), cudaSuccess);
  EXPECT_EQ(out.get(1)[0], 999);
  EXPECT_EQ(k::dynamic_smem(out.p, 20000, false), cudaErrorInvalidValue) << "80 KB without the kernel's opt-in";
  EXPECT_EQ(k::dynamic_smem(out.p, 20000, true), cudaSuccess);
  EXPECT_EQ(out.get(1)[0], 19999);
}

TEST(CudaSim, PointerKinds) {
  Dev<float> d(4);
  float *pinned = nullptr, *managed = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 16), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&managed, 16), cudaSuccess);
  std::vector<float> pageable(4);
  cudaPointerAttributes at{};
  ASSERT_EQ(cudaPointerGetAttributes(&at, d.p + 3), cudaSuccess);
  EXPECT_EQ(at.type, cudaMemoryTypeDevice);
  ASSERT_EQ(cudaPointerGetAttributes(&at, pinned), cudaSuccess);
  EXPECT_EQ(at.type, cudaMemoryTypeHost);
  ASSERT_EQ(cudaPointerGetAttributes(&at, managed), cudaSuccess);
  EXPECT_EQ(at.type, cudaMemoryTypeManaged);
  ASSERT_EQ(cudaPointerGetAttributes(&at, pageable.data()), cudaSuccess);
  EXPECT_EQ(at.type, cudaMemoryTypeUnregistered);
  EXPECT_EQ(cudaMemcpy(d.p, pageable.data(), 5 * sizeof(float), cudaMemcpyHostToDevice), cudaErrorInvalidValue)
      << "past the allocation's end";
  (void)cudaGetLastError();
  managed[1] = 3.0f;  // managed memory is the host's too
  cudaFree(managed);
  cudaFreeHost(pinned);
}

}  // namespace
