// Fuzz target: the DeepSpeed JSON config parser (zero8/config.h: parse_string, plain_json). Any text
// must parse or throw zero8::Error naming the key; an accepted config must survive the round trip the
// header promises, parse_string(to_json(c), c.world_size) == c.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "zero8/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zero8;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::accepts([&] { config::plain_json(text, "fuzz.json"); });
  // World size 2: the batch keys' divisibility checks run too.
  config::Config c;
  if (!fuzz::accepts([&] { c = config::parse_string(text, 2, "fuzz.json"); })) return 0;
  const std::string normalized = config::to_json(c);
  config::Config again;
  if (!fuzz::accepts([&] { again = config::parse_string(normalized, c.world_size, "to_json"); }))
    fuzz::fail("to_json of an accepted config does not parse:\n" + normalized);
  if (!(again == c)) fuzz::fail("parse_string(to_json(c)) != c for:\n" + normalized);
  return 0;
}
