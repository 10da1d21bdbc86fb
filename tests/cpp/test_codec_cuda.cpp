// CUDA codec kernels against the CPU scalar reference (codes, scales and decodes compared exactly),
// beside the CPU tests. Without a device (or a CUDA build) the device tests skip and say why; the
// entry points' behaviour without a device is checked wherever it can be.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/quant.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace zero8;
using namespace zero8::quant;

#if ZERO8_WITH_CUDA
bool cuda_device_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}
#endif

class CodecCuda : public ::testing::Test {
 protected:
  void SetUp() override {
#if !ZERO8_WITH_CUDA
    GTEST_SKIP() << "not built with CUDA";
#else
    if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device on this machine";
#endif
  }
};

#if ZERO8_WITH_CUDA
// A device buffer holding a copy of host bytes (freed on scope exit).
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n, const void* host = nullptr) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&p, n > 0 ? n : 1), cudaSuccess);
    if (host) {
      EXPECT_EQ(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceBuffer() { cudaFree(p); }
  template <class T>
  std::vector<T> get(size_t count) const {
    std::vector<T> out(count);
    EXPECT_EQ(cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// Inputs of every magnitude: normal, tiny, huge, zero blocks and a non-finite block.
std::vector<float> make_input(int64_t n, int32_t block, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = i / block;
    const float scale = b % 4 == 0 ? 1.0f : b % 4 == 1 ? 1e-39f : b % 4 == 2 ? 1e30f : 0.0f;
    x[size_t(i)] = g(rng) * scale;
  }
  if (n > 3 * block) x[size_t(3 * block + 1)] = std::numeric_limits<float>::infinity();
  return x;
}

// x in a 16-bit dtype (empty for float32, whose input is x itself).
std::vector<uint16_t> to_dtype(const std::vector<float>& x, DType dt) {
  if (dtype_size(dt) != 2) return {};
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) dtype_store(out.data(), dt, int64_t(i), x[i]);
  return out;
}
#endif

TEST_F(CodecCuda, EncodeMatchesCpuReference) {
#if ZERO8_WITH_CUDA
  for (CudaQuantKernels form : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    const CudaQuantKernelsScope scope(form);
    SCOPED_TRACE(std::string(cuda_quant_kernels_name(form)) + " kernels");
    for (MapKind kind : {MapKind::dynamic_signed, MapKind::dynamic_unsigned, MapKind::linear_signed}) {
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
        for (int32_t block : {64, 256, 2048, 4096}) {
          for (bool stochastic : {false, true}) {
            for (int offset : {0, 1}) {  // 1: the arrays off the warp kernel's vector alignment
              if (offset == 1 && (stochastic || form != CudaQuantKernels::warp)) continue;
              const int64_t n = 9 * int64_t(block) + 37;
              const std::vector<float> xf = make_input(n, block, uint64_t(block) + uint64_t(dt));
              const std::vector<uint16_t> xh = to_dtype(xf, dt);
              const void* host_x = dt == DType::f32 ? static_cast<const void*>(xf.data()) : xh.data();
              const int64_t nb = quant_num_blocks(n, block);
              QuantizeOptions opt;
              opt.stochastic = stochastic;
              opt.seed = 42;
              opt.index_base = 1000;
              // CPU reference
              std::vector<uint8_t> codes(static_cast<size_t>(n));
              std::vector<float> scales(static_cast<size_t>(nb));
              EncodeArgs a;
              a.x = host_x;
              a.dtype = dt;
              a.n = n;
              a.block = block;
              a.table = &table_get(kind);
              a.codes = codes.data();
              a.absmax = scales.data();
              a.stochastic = stochastic;
              a.seed = opt.seed;
              a.index_base = opt.index_base;
              quant_encode_ref(a);
              // device
              const size_t esize = size_t(dtype_size(dt)), off = size_t(offset);
              DeviceBuffer dx((size_t(n) + off) * esize), dc(size_t(n) + off), ds(size_t(nb) * 4);
              char* x_dev = static_cast<char*>(dx.p) + off * esize;
              ASSERT_EQ(cudaMemcpy(x_dev, host_x, size_t(n) * esize, cudaMemcpyHostToDevice), cudaSuccess);
              quantize_blockwise_cuda(x_dev, dt, n, block, kind, static_cast<uint8_t*>(dc.p) + off,
                                      static_cast<float*>(ds.p), opt);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              std::vector<uint8_t> got_codes = dc.get<uint8_t>(size_t(n) + off);
              got_codes.erase(got_codes.begin(), got_codes.begin() + std::ptrdiff_t(off));
              EXPECT_EQ(got_codes, codes) << dtype_name(dt) << " block " << block << " offset " << offset;
              const std::vector<float> got = ds.get<float>(static_cast<size_t>(nb));
              EXPECT_EQ(0, std::memcmp(got.data(), scales.data(), size_t(nb) * 4))
                  << dtype_name(dt) << " block " << block << " offset " << offset;
            }
          }
        }
      }
    }
  }
#endif
}

TEST_F(CodecCuda, DecodeMatchesCpuReference) {
#if ZERO8_WITH_CUDA
  const QuantTable& t = table_get(MapKind::dynamic_signed);
  const int32_t block = 256;
  const int64_t n = 33 * block + 5, nb = quant_num_blocks(n, block);
  std::mt19937_64 rng(5);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  std::vector<float> scales(static_cast<size_t>(nb)), base(static_cast<size_t>(n));
  for (auto& c : codes) c = uint8_t(rng());
  for (auto& s : scales) s = float(int64_t(rng() % 2000) - 1000) * 1e-2f;
  for (auto& b : base) b = float(int64_t(rng() % 2000) - 1000) * 1e-3f;
  DeviceBuffer ds(size_t(nb) * 4, scales.data());
  for (CudaQuantKernels form : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    const CudaQuantKernelsScope scope(form);
    SCOPED_TRACE(std::string(cuda_quant_kernels_name(form)) + " kernels");
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (bool accumulate : {false, true}) {
        for (int offset : {0, 1}) {  // 1: codes and output off the warp kernel's vector alignment
          if (accumulate && dt != DType::f32) continue;
          const size_t esize = size_t(dtype_size(dt)), off = size_t(offset), bytes = size_t(n) * esize;
          std::vector<uint8_t> want(bytes);
          if (accumulate) std::memcpy(want.data(), base.data(), bytes);
          DeviceBuffer dc(size_t(n) + off), dy_all(bytes + off * esize);
          ASSERT_EQ(cudaMemcpy(static_cast<char*>(dc.p) + off, codes.data(), size_t(n), cudaMemcpyHostToDevice),
                    cudaSuccess);
          char* y_dev = static_cast<char*>(dy_all.p) + off * esize;
          if (accumulate) {
            ASSERT_EQ(cudaMemcpy(y_dev, base.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
          }
          DecodeArgs a;
          a.codes = codes.data();
          a.absmax = scales.data();
          a.n = n;
          a.block = block;
          a.table = &t;
          a.y = want.data();
          a.dtype = dt;
          a.accumulate = accumulate;
          quant_decode_ref(a);
          dequantize_blockwise_cuda(static_cast<const uint8_t*>(dc.p) + off, static_cast<const float*>(ds.p), n, block,
                                    MapKind::dynamic_signed, y_dev, dt, accumulate);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<uint8_t> got = dy_all.get<uint8_t>(bytes + off * esize);
          got.erase(got.begin(), got.begin() + std::ptrdiff_t(off * esize));
          EXPECT_EQ(got, want) << dtype_name(dt) << " accumulate " << accumulate << " offset " << offset;
        }
      }
    }
  }
#endif
}

// The rows entries on the device give the CPU's rows (codes, scales, each row's decode, the rows' sum),
// in both kernel forms, for rows that end mid-block (with and without the warp form's vectors) and rows of
// whole blocks.
TEST_F(CodecCuda, RowsMatchCpu) {
#if ZERO8_WITH_CUDA
  const auto map = MapKind::dynamic_signed;
  const auto same = [](float a, float b) {  // a device's NaN results need not carry the CPU's payload
    uint32_t ua, ub;
    std::memcpy(&ua, &a, 4);
    std::memcpy(&ub, &b, 4);
    return (a != a && b != b) || ua == ub;
  };
  for (CudaQuantKernels form : {CudaQuantKernels::block, CudaQuantKernels::warp}) {
    const CudaQuantKernelsScope scope(form);
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (int32_t block : {64, 2048}) {
        for (int64_t rows : {1, 3, 8, 4001}) {  // 4001 short rows: more than the decode's grid has in y
          for (int64_t row : {int64_t(3), int64_t(100), int64_t(2 * block), int64_t(2 * block + 4),
                              int64_t(2 * block + 37)}) {
            // The many short rows once (the block form's encode would take a thread block per row).
            if ((rows > 8) != (row == 3) ||
                (rows > 8 && (block != 64 || dt != DType::f32 || form != CudaQuantKernels::warp))) {
              continue;
            }
            for (bool stochastic : {false, true}) {
              SCOPED_TRACE(std::string(cuda_quant_kernels_name(form)) + " kernels, " + dtype_name(dt) + " block " +
                           std::to_string(block) + " rows " + std::to_string(rows) + " row " + std::to_string(row) +
                           (stochastic ? " stochastic" : ""));
              const int64_t n = rows * row, per = quant_num_blocks(row, block);
              const size_t esize = size_t(dtype_size(dt));
              const std::vector<float> xf = make_input(n, block / 2, uint64_t(n) + uint64_t(dt));
              const std::vector<uint16_t> xh = to_dtype(xf, dt);
              const void* host_x = dt == DType::f32 ? static_cast<const void*>(xf.data()) : xh.data();
              QuantizeOptions opt;
              opt.stochastic = stochastic;
              opt.seed = 3;
              opt.index_base = 11;
              std::vector<uint8_t> codes(static_cast<size_t>(n));
              std::vector<float> scales(size_t(rows * per));
              quantize_blockwise_rows(host_x, dt, rows, row, block, map, codes.data(), scales.data(), opt);
              DeviceBuffer dx(size_t(n) * esize, host_x), dc(static_cast<size_t>(n)), ds(scales.size() * 4);
              quantize_blockwise_rows_cuda(dx.p, dt, rows, row, block, map, static_cast<uint8_t*>(dc.p),
                                           static_cast<float*>(ds.p), opt);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              ASSERT_EQ(dc.get<uint8_t>(static_cast<size_t>(n)), codes);
              ASSERT_EQ(0, std::memcmp(ds.get<float>(scales.size()).data(), scales.data(), scales.size() * 4));

              std::vector<uint8_t> each(size_t(n) * esize);  // decoded into the input's dtype
              dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, each.data(), dt);
              DeviceBuffer dy(size_t(n) * esize);
              dequantize_blockwise_rows_cuda(static_cast<const uint8_t*>(dc.p), static_cast<const float*>(ds.p), rows,
                                             row, block, map, dy.p, dt);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              const std::vector<uint8_t> got_each = dy.get<uint8_t>(size_t(n) * esize);
              for (int64_t i = 0; i < n; ++i) {
                ASSERT_TRUE(same(dtype_load(got_each.data(), dt, i), dtype_load(each.data(), dt, i)))
                    << "element " << i;
              }

              std::vector<float> base(static_cast<size_t>(row));
              for (int64_t j = 0; j < row; ++j) base[size_t(j)] = float(j % 13) * 0.5f - 3.0f;
              for (bool accumulate : {false, true}) {
                std::vector<float> want = base;
                dequantize_blockwise_rows(codes.data(), scales.data(), rows, row, block, map, want.data(), DType::f32,
                                          true, accumulate);
                DeviceBuffer dsum(size_t(row) * 4, base.data());
                dequantize_blockwise_rows_cuda(static_cast<const uint8_t*>(dc.p), static_cast<const float*>(ds.p),
                                               rows, row, block, map, dsum.p, DType::f32, true, accumulate);
                ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                const std::vector<float> got = dsum.get<float>(static_cast<size_t>(row));
                for (int64_t j = 0; j < row; ++j) {
                  ASSERT_TRUE(same(got[size_t(j)], want[size_t(j)]))
                      << "sum, element " << j << (accumulate ? " accumulating" : "");
                }
              }
            }
          }
        }
      }
    }
  }
#endif
}

// The CUDA entries without CUDA or without a device: a clear zero8::Error, never a crash; and bad
// arguments are reported as such before any device work.
TEST(CodecCudaEntry, ExplainsWhenItCannotRun) {
  std::vector<float> x(512, 1.0f), scales(2);
  std::vector<uint8_t> codes(512);
#if !ZERO8_WITH_CUDA
  try {
    quantize_blockwise_cuda(x.data(), DType::f32, 512, 256, MapKind::dynamic_signed, codes.data(), scales.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("not built with CUDA"), std::string::npos) << e.what();
  }
#else
  try {
    quantize_blockwise_cuda(x.data(), DType::f32, 512, 100, MapKind::dynamic_signed, codes.data(), scales.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'block'"), std::string::npos) << e.what();
  }
  if (cuda_device_present()) GTEST_SKIP() << "a CUDA device is present: the no-device path cannot be exercised";
  try {
    table_get_device(MapKind::dynamic_signed);
    ADD_FAILURE() << "no error without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
#endif
}

}  // namespace
