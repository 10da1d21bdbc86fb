// Checkpoints of the sharded optimizer (format: docs/CHECKPOINT.md). save() writes every rank's fp32
// master and 8-bit state partition plus the model's working copy (safetensors) atomically; load()
// restores them at the same world size or re-cuts the old ranks' ranges at block boundaries for
// another one (codes and absmax are copied byte for byte, never dequantized). The reading functions
// below (manifest, verify, fp32 export) need no communicator: the zero8-checkpoint tool uses them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zero8/checkpoint_format.h"
#include "zero8/kernels/hd.h"
#include "zero8/kernels/optim.h"
#include "zero8/loss_scaler.h"
#include "zero8/sharded.h"

namespace zero8::ckpt {

// The format version, the file names of a checkpoint (kManifestName, kModelName, kModelRestName,
// kLatestName, shard_file_name(rank)) and the shard file's layout: checkpoint_format.h.

// Environment (read in src/checkpoint/io.cpp, at each save; the one place these are parsed):
//   ZERO8_CKPT_CRASH_AT=<point>:<rank>  test hook: the process of rank <rank> (of the optimizer's
//       communicator) SIGKILLs itself when save() reaches <point>, one of kCrashPoints. An unknown
//       point makes save() throw, so a misspelt test cannot silently pass.
//   ZERO8_CKPT_RENAME_EXCHANGE=0  replace an existing tag of the same name in two renames (move the
//       old one aside, rename the new one in), as on file systems without renameat2(RENAME_EXCHANGE);
//       used to test that path. Default: the atomic exchange, with that fallback when unsupported.
//   ZERO8_CKPT_TIMEOUT=<seconds>  during save and load the communicator's timeout is raised to this
//       (default 3600): ranks wait in collectives while others write or read large files.
constexpr const char* kCrashPoints[] = {
    "begin",                 // rank 0 made the temporary directory
    "mid_shard",             // a rank wrote half of its shard file (unsynced, truncated)
    "after_shard",           // a rank's files are written and synced, before the ranks agree
    "before_manifest",       // rank 0 gathered every rank's file list
    "mid_manifest",          // rank 0 wrote half of manifest.json
    "before_rename",         // the temporary directory is complete and synced
    "after_move_aside",      // two-rename replace only: the old same-named tag was moved aside
    "before_latest",         // <dir>/<tag> is in place, latest still names the previous tag
    "before_latest_rename",  // latest.tmp is written and synced
    "before_cleanup",        // latest names the new tag; replaced and keep_last tags not yet removed
};

// ---------------------------------------------------------------------------------------------
// Save and load (collective over the optimizer's communicator: every rank calls them together)
// ---------------------------------------------------------------------------------------------

// Bytes the caller owns and leaves unchanged while save() runs: save() writes them from where they are
// (no copy), so a large frozen tensor or model-states file costs no memory of its own during a save.
struct ByteSpan {
  const void* data = nullptr;
  int64_t size = 0;
};

struct SaveOptions {
  std::string tag;            // "" -> "global_step<opt.steps()>"; no '/', no leading '.', not "latest"
  std::string client_state;   // JSON text stored as is in the manifest (epoch, scheduler, data
                              // position, ...); "" -> null. Rank 0's value is the one saved.
  std::string config_json;    // the run's normalized config (zero8::to_json(Config)); "" -> null
  int keep_last = 0;          // > 0: afterwards keep only the K most recently saved complete tags
                              // (the one latest names and the one just saved are never removed)
  bool update_latest = true;  // false: <dir>/latest keeps naming what it named (DeepSpeed's
                              // save_latest=False); the tag is still installed atomically
  // Rank 0's further files of the tag, (name, bytes): written and synced with the shards, before the
  // tag is installed, and listed in the manifest (role "extra") with their checksums, so the tag is
  // never visible without them (the engine's mp_rank_00_model_states.pt). Plain names only.
  std::vector<std::pair<std::string, ByteSpan>> extra_files;
  // The module's whole state_dict, so that export_fp32 gives every key of it (the engine passes these;
  // a caller without a module leaves them empty and the manifest lists the parameters only).
  // state_dict: every key in order, as (key, source): the source is a parameter of opt (trained: the
  // export takes it from the fp32 masters) or the name of one of module_tensors; a key whose source is
  // another name is a tied alias (the same tensor under two names). module_tensors: the entries opt does
  // not train, each as (name, safetensors dtype, shape, raw little-endian bytes: the tensor's own memory),
  // written by rank 0 to kModelRestName. Only rank 0's values are used; they are checked there (names
  // unique, dtypes known, sizes, every source resolves) before anything is written.
  struct ModuleTensor {
    std::string name;
    std::string dtype;  // F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL
    std::vector<int64_t> shape;
    ByteSpan bytes;
  };
  std::vector<std::pair<std::string, std::string>> state_dict;
  std::vector<ModuleTensor> module_tensors;
};

struct SaveResult {
  std::string tag;
  std::string path;                  // <dir>/<tag>
  int64_t bytes = 0;                 // all files of the tag (manifest included)
  std::vector<std::string> removed;  // tags removed by keep_last (the same list on every rank)
};

// Saves opt at a step boundary (after step(); gradient inputs are not saved). Every rank writes its
// shard into <dir>/.tmp-<tag>-<nonce>/ and syncs it; rank 0 then writes the model file and the
// manifest with every file's size and xxh3 checksum, renames the directory to <dir>/<tag> (an
// existing tag of that name is replaced only once the new one is complete), and replaces
// <dir>/latest atomically. A crash at any point leaves the previous checkpoint loadable and latest
// naming a complete tag; temporary directories left by a crash are removed by the next save.
// Assumes a file system every rank sees (as DeepSpeed does). Throws zero8::Error on every rank when
// any rank fails (the first failing rank's message); the temporary directory is then removed.
SaveResult save(shard::ShardedOptimizer& opt, const std::string& dir, const SaveOptions& opts = {});

struct LoadResult {
  std::string tag;
  std::string path;                   // <dir>/<tag> (or the directory it was recovered from)
  int64_t step = 0;                   // optimizer steps of the checkpoint (now opt.steps())
  int saved_world = 0;                // world size the checkpoint was saved with
  std::string client_state = "null";  // JSON text as saved
  std::string config_json = "null";   // JSON text as saved
  std::vector<std::string> warnings;  // e.g. error-feedback residuals dropped at another world size
  int64_t bytes_hashed = 0;           // bytes of the tag's files this rank checksummed (0 without verify)
};

struct LoadOptions {
  std::string tag;    // "" -> the tag <dir>/latest names
  bool verify = true; // check the xxh3 checksum of every file this rank reads (whole files)
  // Called on every rank once everything is validated and read, before anything changes, with the
  // result load is about to return: a caller that reads more files of the tag (the Python engine's
  // model-states file) validates them here, so that its failure too leaves opt untouched. A throw on
  // any rank fails the load on every rank.
  std::function<void(const LoadResult&)> before_commit;
};

// Loads a checkpoint into opt, which must describe the same model (parameter names, shapes and order),
// the same algorithm, state bits, state block size and maps; anything else is an error naming the
// file and the mismatch. Each rank reads the old shards' ranges overlapping its partition (its own
// file at the same world size): masters, codes, absmax and fp32 states are copied by global element
// or block range. The working copy is restored bit for bit from model.safetensors (rank 0 reads it
// and broadcasts), steps and the loss-scaler state are restored, and error-feedback residuals are
// restored at the same world size and layout only (otherwise dropped, with a warning). Validation and
// every read happen before anything is changed: when load throws (on every rank, with the first
// failing rank's message), opt is untouched. The hyperparameters stay those of opt's config.
LoadResult load(shard::ShardedOptimizer& opt, const std::string& dir, const LoadOptions& opts = {});

// ---------------------------------------------------------------------------------------------
// Reading (no communicator; the zero8-checkpoint tool)
// ---------------------------------------------------------------------------------------------

// One contiguous piece of a shard file. Element kinds (master, codesK, stateK) cover the global
// element range [begin, end) of their group; absmaxK covers the global block range [begin, end)
// (block = state_block elements); residual is rank-local: [0, padded) of the saving rank.
struct SectionInfo {
  std::string group;   // "8bit" | "fp32" (shard::group_name)
  std::string kind;    // master, codes1, absmax1, codes2, absmax2, state1, state2, residual
  int64_t begin = 0, end = 0;
  int64_t offset = 0;  // byte offset in the file
  int64_t bytes = 0;
};

struct FileInfo {
  std::string name;  // relative to the tag directory
  std::string role;  // "shard" | "model" | "extra" (SaveOptions::extra_files)
  int rank = -1;     // shards: the saving rank
  int64_t bytes = 0;
  uint64_t xxh3 = 0;  // XXH3 64-bit (seed 0) of the whole file
  std::vector<SectionInfo> sections;
};

// One key of the module's state_dict (the manifest's `state_dict`, in state_dict order).
struct StateDictEntry {
  std::string name;            // the key
  std::string source;          // "param": a parameter of `params` (trained); "model_rest": a tensor of kModelRestName
  std::string tensor;          // its name there (another name than `name`: a tied alias)
  std::string dtype;           // model_rest: the saved safetensors dtype
  std::vector<int64_t> shape;  // model_rest: the shape
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  std::string group;
  int64_t offset = 0, numel = 0;  // in the group's flat buffer
  bool fp32_state = false;
  int hyper_group = 0;  // shard::ParamSpec::hyper_group (absent from manifests before it existed: 0)
};

struct GroupInfo {
  std::string name;
  int64_t numel = 0, align = 0, chunk = 0, padded = 0;
  int state_bits = 8;
  int64_t num_blocks = 0;  // state blocks over numel (8-bit group) or 0
};

struct MapInfo {
  int state = 1;
  std::string kind;   // quant::map_kind_name
  uint64_t xxh3 = 0;  // XXH3 64-bit of the 256 float32 values (little endian)
};

struct Manifest {
  int format_version = 0;
  std::string zero8_version, tag;
  uint64_t nonce = 0;          // identifies one save; also in every shard header
  double saved_unix_s = 0.0;   // wall clock at save (orders tags for keep_last)
  int64_t step = 0;
  int world = 0;
  optim::Algo algo = optim::Algo::adamw;
  int state_bits = 8;          // of the 8-bit group (8 or 32); the fp32 group is always 32
  int num_states = 2;
  optim::Hyper hyper;
  float initial_accumulator = 0.0f;
  int32_t state_block = 256, wire_block = 2048;
  int64_t min_8bit_size = 4096;
  DType working_dtype = DType::f32;
  bool error_feedback = false;
  bool fp16 = false;
  LossScalerState loss_scaler;
  std::vector<MapInfo> maps;
  GroupInfo groups[shard::kNumGroups];
  std::vector<ParamInfo> params;
  std::vector<FileInfo> files;
  // Every key of the module's state_dict; empty when the save had none (written before it existed, or by
  // a caller without a module): then only the trained parameters are in the checkpoint's safetensors.
  std::vector<StateDictEntry> state_dict;
  std::string config_json = "null", client_state = "null";
};

// Parse and validate a manifest's text (structure, the layout recomputed from the parameters, and
// that the sections of all shards cover every global range exactly once). `source` names the file
// in errors. Throws Error(io) "<source>: <problem>".
Manifest manifest_parse(const std::string& text, const std::string& source);
// <tag_dir>/manifest.json, parsed and validated.
Manifest manifest_read(const std::string& tag_dir);
// manifest_read, then the size and xxh3 of every extra file it lists (SaveOptions::extra_files), as
// load checks them: for a caller that reads only those (the engine's module-only load). model_rest: also
// kModelRestName, which no load reads (load checks it on rank 0 only; a caller on several ranks passes
// true on one of them and agrees on the outcome).
Manifest manifest_read_extras_checked(const std::string& tag_dir, bool model_rest = true);
// The tag <dir>/latest names (validated); throws Error(io) naming the file when missing or bad.
std::string latest_read(const std::string& dir);
// The directory holding tag `tag` of `dir`: <dir>/<tag>, or the copy an interrupted two-rename
// replace left (see ZERO8_CKPT_RENAME_EXCHANGE). Throws Error(io) when there is none, and
// Error(invalid_argument) naming the tag when it is not a tag name (empty, '/', a leading '.', ...).
std::string tag_path(const std::string& dir, const std::string& tag);
// Complete tags of dir (subdirectories with a manifest.json), oldest save first.
std::vector<std::string> tags_list(const std::string& dir);

// Bytes per part of a checkpoint, from its manifest.
struct Summary {
  int64_t master = 0;    // fp32 masters (all shards)
  int64_t codes = 0;     // 8-bit state codes
  int64_t absmax = 0;    // 8-bit state block scales
  int64_t fp32 = 0;      // fp32 optimizer states (fp32 group, or 32-bit optimizers)
  int64_t residual = 0;  // error-feedback residuals
  int64_t model = 0;     // model.safetensors
  int64_t other = 0;     // headers, alignment padding, manifest
  int64_t total = 0;     // all files
  int64_t numel = 0;     // parameter elements
};
Summary summarize(const Manifest& m, int64_t manifest_bytes);

// Every check: the manifest, each file's presence, size, header and checksum, the shard sections
// (inside their file, not overlapping, covering each global range exactly once) and the model
// file's tensors. Collects every problem as "<file>: <problem>" instead of stopping at the first.
// checksums false: all but the checksums, so only a few bytes of each file are read (a missing,
// truncated or overlong file, a bad header); `zero8-checkpoint inspect` checks that much.
struct VerifyResult {
  std::vector<std::string> problems;
  int files = 0;      // files checked
  int64_t bytes = 0;  // bytes hashed
  bool ok() const { return problems.empty(); }
};
VerifyResult verify(const std::string& tag_dir, bool checksums = true);

// Consolidated fp32 weights as one safetensors file at out_path (written to a temporary name beside it,
// synced, renamed: an existing file is replaced atomically and keeps its permission bits; a symbolic
// link is written through, replacing the file it leads to). Refused before anything is read, with
// Error(io) naming out_path: a missing parent directory, an existing directory, device, fifo or socket,
// any path inside a tag directory of tag_dir's checkpoint directory (any tag's), and an existing file of
// that directory elsewhere (another name of a tag's file, by inode, or its latest); an
// empty out_path is Error(invalid_argument). With the manifest's state_dict: every key of the module's state_dict, in its order; the
// trained parameters F32 from the masters of all shards, the other entries from kModelRestName with
// 16-bit floats widened to F32 (exact) and any other dtype as saved; a tied alias is written under
// each of its names. Trained parameters the state_dict does not name follow. Without it (older
// checkpoints): one F32 tensor per trained parameter. verify_files: first run verify(tag_dir), which
// checks every file of the tag (also those the export does not read: model.safetensors, the engine's
// model-states file), and throw Error(io) with its problems ("<file>: <problem>; ...") if it finds any;
// false: sizes and headers of the files read are still checked, checksums are not.
struct ExportResult {
  int64_t tensors = 0;   // tensors written
  int64_t trained = 0;   // of which from the masters (aliases included)
  int64_t rest = 0;      // of which from kModelRestName (aliases included)
  bool complete = false; // the manifest had a state_dict: the output is the module's whole state_dict
};
ExportResult export_fp32(const std::string& tag_dir, const std::string& out_path, bool verify_files = true);

}  // namespace zero8::ckpt
