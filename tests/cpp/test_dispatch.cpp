// The runtime variant settings that need no CPU feature or device: the form of the CUDA 8-bit kernels
// (CudaQuantKernels), set by name, in code and from ZERO8_CUDA_QUANT_KERNELS (tests/CMakeLists.txt runs
// CudaQuantKernels.FromTheEnvironment again with warp and with a bad value).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "zero8/error.h"
#include "zero8/kernels/dispatch.h"

namespace {

using zero8::CudaQuantKernels;

TEST(CudaQuantKernels, FromTheEnvironment) {
  const char* env = std::getenv("ZERO8_CUDA_QUANT_KERNELS");
  const std::string v = env ? env : "";
  if (v.empty() || v == "warp") {
    EXPECT_EQ(zero8::cuda_quant_kernels(), CudaQuantKernels::warp);
  } else if (v == "block") {
    EXPECT_EQ(zero8::cuda_quant_kernels(), CudaQuantKernels::block);
  } else {
    try {
      (void)zero8::cuda_quant_kernels();
      FAIL() << "ZERO8_CUDA_QUANT_KERNELS=" << v << " was accepted";
    } catch (const zero8::Error& e) {
      EXPECT_EQ(e.code(), zero8::ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("ZERO8_CUDA_QUANT_KERNELS=" + v + " is not one of block, warp"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(CudaQuantKernels, SetParseAndName) {
  if (std::getenv("ZERO8_CUDA_QUANT_KERNELS")) GTEST_SKIP() << "ZERO8_CUDA_QUANT_KERNELS is set: FromTheEnvironment only";
  EXPECT_STREQ(zero8::cuda_quant_kernels_name(CudaQuantKernels::block), "block");
  EXPECT_STREQ(zero8::cuda_quant_kernels_name(CudaQuantKernels::warp), "warp");
  EXPECT_EQ(zero8::cuda_quant_kernels_parse("warp", "k"), CudaQuantKernels::warp);
  EXPECT_THROW(zero8::cuda_quant_kernels_parse("Warp", "k"), zero8::Error);
  EXPECT_EQ(zero8::cuda_quant_kernels(), CudaQuantKernels::warp);
  zero8::set_cuda_quant_kernels(CudaQuantKernels::block);
  EXPECT_EQ(zero8::cuda_quant_kernels(), CudaQuantKernels::block);
  zero8::set_cuda_quant_kernels(CudaQuantKernels::warp);
  EXPECT_EQ(zero8::cuda_quant_kernels(), CudaQuantKernels::warp);
}

}  // namespace
