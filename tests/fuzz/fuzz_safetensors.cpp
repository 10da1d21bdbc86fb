// Fuzz target: the safetensors reader (zero8/src/checkpoint/safetensors.cpp: safetensors_parse) on a
// file holding the input. An accepted header's tensors must tile the data bytes exactly.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zero8;
  const std::string path = fuzz::scratch_dir() + "/fuzz.safetensors";
  fuzz::write_file(path, data, size);
  ckpt::detail::Safetensors st;
  if (!fuzz::accepts([&] {
        ckpt::detail::FileReader r(path);
        st = ckpt::detail::safetensors_parse(r);
      }))
    return 0;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& [name, e] : st.tensors) spans.emplace_back(e.begin, e.end);
  std::sort(spans.begin(), spans.end());
  int64_t pos = st.data_start;
  for (const auto& [b, e] : spans) {
    if (st.data_start + b != pos || e < b) fuzz::fail("accepted tensors do not tile the data");
    pos = st.data_start + e;
  }
  if (pos != int64_t(size)) fuzz::fail("accepted tensors do not end at the end of the file");
  return 0;
}
