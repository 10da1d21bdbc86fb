// Fuzz target: the checkpoint manifest parser (zero8/src/checkpoint/manifest.cpp: manifest_parse), every
// check included (layout recomputed from the parameters, sections, state_dict). An accepted manifest,
// written back by manifest_to_json, must parse again into the same JSON.
#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/manifest.h"
#include "fuzz_util.h"
#include "zero8/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zero8;
  const std::string text(reinterpret_cast<const char*>(data), size);
  ckpt::Manifest m;
  if (!fuzz::accepts([&] { m = ckpt::manifest_parse(text, "fuzz/manifest.json"); })) return 0;
  const std::string written = ckpt::detail::manifest_to_json(m).dump();
  ckpt::Manifest again;
  if (!fuzz::accepts([&] { again = ckpt::manifest_parse(written, "manifest_to_json"); }))
    fuzz::fail("manifest_to_json of an accepted manifest does not parse:\n" + written);
  if (ckpt::detail::manifest_to_json(again).dump() != written)
    fuzz::fail("manifest_to_json(manifest_parse(manifest_to_json(m))) differs for:\n" + written);
  return 0;
}
