// Fuzz target: the shard file reader (zero8/src/checkpoint/tag_files.cpp, the header of
// zero8/checkpoint_format.h) and everything that reads sections out of a shard: the input replaces
// zero8_shard_rank0.bin in a copy of the stored checkpoint tests/data/checkpoints/adamw8_np2, which is
// then verified (without checksums, so that mutated bytes get past them) and exported to fp32.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "zero8/checkpoint.h"

namespace {

namespace fs = std::filesystem;

// The copy of the stored tag, made once per process, and the size the manifest gives its rank-0 shard.
struct Tag {
  std::string dir;
  size_t shard_bytes = 0;
};

const Tag& tag() {
  static const Tag t = [] {
    Tag t;
    const fs::path src = fs::path(ZERO8_TEST_DATA_DIR) / "checkpoints/adamw8_np2/global_step3";
    t.dir = zero8::fuzz::scratch_dir() + "/global_step3";
    fs::create_directories(t.dir);
    fs::copy(src, t.dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    t.shard_bytes = size_t(fs::file_size(src / zero8::ckpt::shard_file_name(0)));
    return t;
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zero8;
  const Tag& t = tag();
  // A file of another size is refused before its header is read: fit the input to the manifest's size
  // (zero padding or cut) so that the fuzzer spends its time past that check.
  std::vector<uint8_t> shard(data, data + std::min(size, t.shard_bytes));
  shard.resize(t.shard_bytes, 0);
  fuzz::write_file(t.dir + "/" + ckpt::shard_file_name(0), shard.data(), shard.size());
  fuzz::accepts([&] { ckpt::verify(t.dir, false); });
  fuzz::accepts([&] { ckpt::export_fp32(t.dir, fuzz::scratch_dir() + "/export.safetensors", false); });
  return 0;
}
