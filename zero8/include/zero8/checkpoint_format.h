// The on-disk format of zero8 checkpoints (docs/CHECKPOINT.md), in one place for everything that writes
// or reads it (the library, zero8-checkpoint, the tests): the names in a checkpoint directory, the shard
// file's header and section alignment, the section kinds. Constants and plain structs only, no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace zero8::ckpt {

// Shard files and safetensors hold raw little-endian numbers: the bytes in memory are written.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the checkpoint format is little endian");

// The format this build writes and the only one it reads (the manifest's "format_version" and every
// shard header's `version`), and the manifest's "format" field.
constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "zero8-checkpoint";

// File names inside <dir>/<tag>/, and the pointer file <dir>/latest.
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kModelName = "model.safetensors";
constexpr const char* kLatestName = "latest";
// The module's state_dict entries the optimizer does not train (frozen parameters, persistent buffers),
// at their saved dtype: written when SaveOptions::module_tensors is given, listed as an extra file.
constexpr const char* kModelRestName = "model_rest.safetensors";
constexpr const char* kShardPrefix = "zero8_shard_rank";
inline std::string shard_file_name(int rank) { return kShardPrefix + std::to_string(rank) + ".bin"; }

// What interrupted saves leave in <dir> (load ignores them, the next save removes them):
// .tmp-<tag>-<nonce>/ a save in progress, latest.tmp the next `latest`, and .replaced-<tag>-<nonce>/ the
// old copy of a tag that a two-rename replace moved aside (the only copy of that tag until the new one
// is in place).
constexpr const char* kTmpPrefix = ".tmp-";
constexpr const char* kLatestTmpName = "latest.tmp";
constexpr const char* kReplacedPrefix = ".replaced-";

// The manifest's own checksum field: XXH3-64 of the compact dump of every other field, in file order.
constexpr const char* kManifestHashKey = "manifest_xxh3";

// ---- zero8_shard_rank<r>.bin ----

constexpr char kShardMagic[8] = {'Z', 'E', 'R', 'O', '8', 'S', 'H', 'D'};

// First 64 bytes of every shard file. The nonce ties the file to the manifest of its save, so a
// shard copied in from another save is caught even when its size happens to match.
struct ShardHeader {
  char magic[8];          // kShardMagic
  uint32_t version;       // kFormatVersion
  uint32_t header_bytes;  // sizeof(ShardHeader)
  int32_t rank;
  int32_t world;
  int64_t step;
  uint64_t nonce;         // the manifest's "nonce"
  uint8_t reserved[24];   // zero
};
static_assert(std::is_standard_layout_v<ShardHeader> && std::is_trivially_copyable_v<ShardHeader>,
              "the shard header is read and written as raw bytes");
static_assert(sizeof(ShardHeader) == 64, "the shard header is part of the format");
static_assert(offsetof(ShardHeader, version) == 8 && offsetof(ShardHeader, header_bytes) == 12 &&
                  offsetof(ShardHeader, rank) == 16 && offsetof(ShardHeader, world) == 20 &&
                  offsetof(ShardHeader, step) == 24 && offsetof(ShardHeader, nonce) == 32 &&
                  offsetof(ShardHeader, reserved) == 40,
              "the shard header's fields are at the offsets docs/CHECKPOINT.md gives");

// Sections (the manifest lists each one's group, kind, range, offset and bytes) start at multiples of
// this many bytes, zero-padded in between.
constexpr int64_t kSectionAlign = 64;

// Section kinds: "master", "codes<k>", "absmax<k>", "state<k>" (k = 1, 2) and "residual". codes are
// uint8, every other kind float32; absmax ranges count state blocks, every other kind elements.
inline int section_esize(const std::string& kind) { return kind.rfind("codes", 0) == 0 ? 1 : 4; }
inline bool section_in_blocks(const std::string& kind) { return kind.rfind("absmax", 0) == 0; }

}  // namespace zero8::ckpt
