// The manifest (<tag>/manifest.json) as JSON: written from a ckpt::Manifest and parsed back with every
// check (structure, the layout recomputed from the parameters, the shard sections covering each global
// range exactly once, the state_dict). Also the helpers that name groups, maps and extra files.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "zero8/checkpoint.h"
#include "zero8/kernels/quant_map.h"

namespace zero8::ckpt::detail {

// Ordered: a parsed manifest dumps its fields in the order the file lists them, which its checksum
// (kManifestHashKey) is computed over.
using json = nlohmann::ordered_json;

json file_to_json(const FileInfo& f);
// One entry of "files"; `src` names the manifest and `where` the entry in errors.
FileInfo file_from_json(const json& j, const std::string& src, const std::string& where);
// The whole manifest, its checksum field included.
json manifest_to_json(const Manifest& m);

// Index of a group name ("8bit" -> 0, "fp32" -> 1), -1 when unknown.
int group_index(const std::string& name);
// An extra file's name: one plain path component that no file of the checkpoint itself uses.
bool extra_name_ok(const std::string& name);

// A quantization map as the manifest records it: its kind (quant::map_kind_name, or "custom") and the
// XXH3-64 of its 256 float32 values.
std::string map_kind_of(const quant::QuantTable* t);
uint64_t map_hash(const quant::QuantTable& t);

}  // namespace zero8::ckpt::detail
