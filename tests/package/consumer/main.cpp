// A user program built against an installed zero8 (find_package(zero8)): checks that the headers,
// the libraries and their dependencies resolve, and that the installation is the one just built.
// Usage: zero8_consumer VERSION CUDA MPI NCCL (the expected version and backends, 0/1 each).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "zero8/error.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/kernels/quant_map.h"
#include "zero8/quant.h"
#include "zero8/version.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s VERSION CUDA MPI NCCL\n", argv[0]);
    return 2;
  }
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
    failures += ok ? 0 : 1;
  };
  const zero8::BuildInfo info = zero8::build_info();
  expect(std::strcmp(zero8::version(), argv[1]) == 0, "zero8::version() is the version built");
  expect(info.cuda == (std::string(argv[2]) == "1"), "CUDA backend as configured");
  expect(info.mpi == (std::string(argv[3]) == "1"), "MPI backend as configured");
  expect(info.nccl == (std::string(argv[4]) == "1"), "NCCL backend as configured");
  // The exported compile definitions reach the user: they must agree with the library's own record.
  expect((ZERO8_WITH_CUDA != 0) == info.cuda && (ZERO8_WITH_MPI != 0) == info.mpi,
         "ZERO8_WITH_* definitions propagated to the user");

  // The signed dynamic map ends at +1 and its table decodes code 255 to 1: kernels library linked.
  const zero8::quant::QuantTable& t = zero8::quant::table_get(zero8::quant::MapKind::dynamic_signed);
  expect(t.values[255] == 1.0f && t.values[0] < 0.0f, "dynamic signed map from libzero8_kernels");
  std::printf("zero8 %s, active ISA %s\n", zero8::version(), zero8::isa_name(zero8::isa_active()));

  // A round trip through the public codec API. By the format's definition (DESIGN.md) each block's
  // largest-magnitude element decodes exactly, and an all-zero block decodes to zeros.
  std::vector<float> x(300, 0.0f);  // blocks of 64: [0,64) varied, [64,128) zero, ..., partial last
  for (int i = 0; i < 64; ++i) x[size_t(i)] = 0.01f * float(i - 20);
  for (int i = 128; i < 300; ++i) x[size_t(i)] = float(i % 7) - 3.5f;
  zero8::quant::Blockwise q = zero8::quant::quantize_blockwise(x.data(), zero8::DType::f32, int64_t(x.size()), 64);
  std::vector<float> y = zero8::quant::dequantize_blockwise(q);
  expect(q.absmax.size() == 5 && q.bytes() == 300 + 5 * 4, "5 blocks for 300 elements, 300 codes + 5 scales");
  // Block 0's extreme is +0.43 (x[63]); block 2's is -3.5 (x[133], 133 % 7 == 0): a negative extreme,
  // exact through the signed scale rule.
  expect(y.size() == x.size() && y[63] == x[63] && y[133] == x[133] && x[133] == -3.5f,
         "block extremes decode exactly (positive and negative)");
  bool zeros = true;
  for (int i = 64; i < 128; ++i) zeros = zeros && y[size_t(i)] == 0.0f;
  expect(zeros, "an all-zero block decodes to zeros");

  // Errors cross the library boundary as zero8::Error with a code.
  bool threw = false;
  try {
    zero8::quant::table_build(std::vector<float>(3, 0.0f));
  } catch (const zero8::Error& e) {
    threw = e.code() == zero8::ErrorCode::invalid_argument;
  }
  expect(threw, "zero8::Error(invalid_argument) caught from the library");
  return failures == 0 ? 0 : 1;
}
