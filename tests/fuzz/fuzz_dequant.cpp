// Fuzz target: the codec's decode of arbitrary codes and absmax (NaN, Inf, subnormal scales included) on
// every CPU variant this machine runs (avx2, avx512, avx512 with VBMI) and through zero8/quant.h's
// dequantize_blockwise, each bit-identical to the scalar reference quant_decode_ref (NaNs compared as NaN).
// Input: byte 0 = map kind (bits 0-1), output dtype (bits 2-3), accumulate (bit 4); byte 1 = block size
// (64 << (b % 7)); the rest = the codes, whose bytes are read again, cyclically, as the float32 scales
// and (accumulate) the initial output.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "zero8/kernels/codec.h"
#include "zero8/quant.h"

namespace {

using namespace zero8;
using namespace zero8::quant;

float float_at(const uint8_t* d, size_t size, size_t i) {
  uint8_t b[4];
  for (size_t k = 0; k < 4; ++k) b[k] = d[(4 * i + k) % size];
  float f;
  std::memcpy(&f, b, 4);
  return f;
}

size_t esize(DType t) { return t == DType::f32 ? 4 : 2; }

// Element i of an output, NaN-insensitive: equal bits, or both NaN.
bool same(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType t, int64_t i) {
  const size_t es = esize(t);
  if (std::memcmp(&a[i * es], &b[i * es], es) == 0) return true;
  return std::isnan(dtype_load(a.data(), t, i)) && std::isnan(dtype_load(b.data(), t, i));
}

void expect_same(const std::vector<uint8_t>& ref, const std::vector<uint8_t>& got, DType t, int64_t n,
                 const char* variant) {
  for (int64_t i = 0; i < n; ++i)
    if (!same(ref, got, t, i))
      fuzz::fail(std::string(variant) + " decodes element " + std::to_string(i) + " as " +
                 std::to_string(dtype_load(got.data(), t, i)) + ", the scalar reference as " +
                 std::to_string(dtype_load(ref.data(), t, i)));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const MapKind map = MapKind(data[0] & 3);
  const DType dtype = ((data[0] >> 2) & 3) == 3 ? DType::f32 : DType((data[0] >> 2) & 3);
  const bool accumulate = (data[0] & 16) && dtype == DType::f32;
  const int32_t block = 64 << (data[1] % 7);
  const uint8_t* codes = data + 2;
  const size_t n = size - 2;
  const int64_t nb = quant_num_blocks(int64_t(n), block);
  std::vector<float> absmax(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) absmax[size_t(b)] = float_at(codes, n, size_t(b));
  std::vector<uint8_t> init(n * esize(dtype), 0);
  if (accumulate)
    for (size_t i = 0; i < n; ++i) {
      const float v = float_at(codes, n, i + size_t(nb));
      std::memcpy(&init[4 * i], &v, 4);
    }

  DecodeArgs a;
  a.codes = codes;
  a.absmax = absmax.data();
  a.n = int64_t(n);
  a.block = block;
  a.table = &table_get(map);
  a.dtype = dtype;
  a.accumulate = accumulate;
  std::vector<uint8_t> ref = init;
  a.y = ref.data();
  quant_decode_ref(a);

  auto check = [&](void (*decode)(const DecodeArgs&), const char* name) {
    std::vector<uint8_t> y = init;
    DecodeArgs v = a;
    v.y = y.data();
    decode(v);
    expect_same(ref, y, dtype, int64_t(n), name);
  };
  if (isa_supported(Isa::avx2)) check(quant_decode_avx2, "avx2");
  if (isa_supported(Isa::avx512)) check(quant_decode_avx512, "avx512");
  if (isa_avx512_vbmi_supported()) check(quant_decode_avx512vbmi, "avx512vbmi");

  // The validated entry point, on the active variant with one thread.
  std::vector<uint8_t> y = init;
  dequantize_blockwise(codes, absmax.data(), int64_t(n), block, map, y.data(), dtype, accumulate, 1);
  expect_same(ref, y, dtype, int64_t(n), "dequantize_blockwise");
  return 0;
}
