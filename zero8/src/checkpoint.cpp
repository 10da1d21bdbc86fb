// Checkpoints of the sharded optimizer (see checkpoint.h and docs/CHECKPOINT.md): the shard and
// model file writers, the manifest, the atomic commit (temporary directory, rename, latest), the
// loader that copies global element/block ranges from the old shards, and verify/export.
#include "zero8/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "zero8/error.h"
#include "zero8/kernels/quant_map.h"
#include "zero8/version.h"

namespace zero8::ckpt {

// The shard files and safetensors hold raw little-endian numbers: the bytes in memory are written.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the checkpoint format is little endian");

constexpr const char* kShardPrefix = "zero8_shard_rank";
std::string shard_file_name(int rank) { return kShardPrefix + std::to_string(rank) + ".bin"; }

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using shard::Group;
using shard::kNumGroups;
using shard::ShardedOptimizer;

constexpr const char* kFormatName = "zero8-checkpoint";
constexpr const char* kLatestTmpName = "latest.tmp";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr const char* kReplacedPrefix = ".replaced-";
constexpr int64_t kSectionAlign = 64;

// ---- shard file header ----

constexpr char kShardMagic[8] = {'Z', 'E', 'R', 'O', '8', 'S', 'H', 'D'};

// First 64 bytes of every shard file. The nonce ties the file to the manifest of its save, so a
// shard copied in from another save is caught even when its size happens to match.
struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  int32_t rank;
  int32_t world;
  int64_t step;
  uint64_t nonce;
  uint8_t reserved[24];
};
static_assert(sizeof(ShardHeader) == 64, "the shard header is part of the format");

// ---- environment (declared in checkpoint.h) ----

struct Env {
  std::string crash_point;
  int crash_rank = -1;
  bool rename_exchange = true;
  double io_timeout = 3600.0;
};

Env env_read() {
  Env e;
  if (const char* v = std::getenv("ZERO8_CKPT_CRASH_AT"); v && *v) {
    const std::string s(v);
    const size_t colon = s.rfind(':');
    ZERO8_CHECK_ARG(colon != std::string::npos && colon + 1 < s.size(), "ZERO8_CKPT_CRASH_AT",
                    "expected <point>:<rank>, got '" << s << "'");
    e.crash_point = s.substr(0, colon);
    bool known = false;
    for (const char* p : kCrashPoints) known = known || e.crash_point == p;
    ZERO8_CHECK_ARG(known, "ZERO8_CKPT_CRASH_AT", "unknown point '" << e.crash_point << "'");
    try {
      e.crash_rank = std::stoi(s.substr(colon + 1));
    } catch (const std::exception&) {
      ZERO8_CHECK_ARG(false, "ZERO8_CKPT_CRASH_AT", "bad rank in '" << s << "'");
    }
  }
  if (const char* v = std::getenv("ZERO8_CKPT_RENAME_EXCHANGE"); v && *v) e.rename_exchange = std::string(v) != "0";
  if (const char* v = std::getenv("ZERO8_CKPT_TIMEOUT"); v && *v) {
    char* end = nullptr;
    e.io_timeout = std::strtod(v, &end);
    ZERO8_CHECK_ARG(end && *end == '\0' && e.io_timeout > 0.0 && e.io_timeout <= 1e9, "ZERO8_CKPT_TIMEOUT",
                    "expected seconds in (0, 1e9], got '" << v << "'");
  }
  return e;
}

// While ranks wait for each other's file I/O (rank 0 writes the model file and the manifest), a
// collective may take much longer than a training step: the communicator's timeout is raised to
// ZERO8_CKPT_TIMEOUT for the save or load. A dead peer is still detected at once (comm liveness).
class TimeoutRaise {
 public:
  TimeoutRaise(comm::Communicator& c, double seconds) : c_(c), before_(c.timeout()) {
    c.set_timeout(std::max(before_, seconds));
  }
  ~TimeoutRaise() { c_.set_timeout(before_); }
  TimeoutRaise(const TimeoutRaise&) = delete;
  TimeoutRaise& operator=(const TimeoutRaise&) = delete;

 private:
  comm::Communicator& c_;
  double before_;
};

void crash_at(const Env& e, const char* point, int rank) {
  if (e.crash_rank == rank && e.crash_point == point) raise(SIGKILL);
}

// ---- errors ----

// "<path>: <what>", thrown as Error(io) from the line that found the problem.
#define CKPT_FAIL(path, what) ZERO8_THROW(io, (path) << ": " << (what))

std::string errno_text(int e) { return std::strerror(e); }

// Error text without the " [file:line]" suffix ZERO8_THROW appends (for verify's problem list).
std::string strip_where(const std::string& s) {
  const size_t p = s.rfind(" [");
  return p != std::string::npos && s.back() == ']' ? s.substr(0, p) : s;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool hex64_parse(const std::string& s, uint64_t* v) {
  if (s.size() != 16) return false;
  uint64_t x = 0;
  for (char ch : s) {
    int d;
    if (ch >= '0' && ch <= '9') d = ch - '0';
    else if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
    else return false;
    x = x << 4 | uint64_t(d);
  }
  *v = x;
  return true;
}

std::string join(const std::string& a, const std::string& b) { return (fs::path(a) / b).string(); }

// ---- files ----

struct HashState {
  XXH3_state_t* s;
  HashState() : s(XXH3_createState()) {
    if (!s) throw std::bad_alloc();
    XXH3_64bits_reset(s);
  }
  ~HashState() { XXH3_freeState(s); }
  HashState(const HashState&) = delete;
  HashState& operator=(const HashState&) = delete;
  void update(const void* p, size_t n) { XXH3_64bits_update(s, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};

// Sequential writer that hashes what it writes; finish() syncs the data to disk.
// Errors name `shown` (default: the path written): export_fp32 names the user's output path rather
// than its temporary file.
class FileWriter {
 public:
  FileWriter(const std::string& path, bool exclusive, const std::string& shown = "") : path_(shown.empty() ? path : shown) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (exclusive ? O_EXCL : O_TRUNC), 0644);
    if (fd_ < 0) CKPT_FAIL(path_, "cannot create: " + errno_text(errno));
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, int64_t n) {
    const char* p = static_cast<const char*>(data);
    hash_.update(p, size_t(n));
    while (n > 0) {
      const ssize_t k = ::write(fd_, p, size_t(std::min<int64_t>(n, int64_t(1) << 30)));
      if (k < 0) {
        if (errno == EINTR) continue;
        CKPT_FAIL(path_, "write failed: " + errno_text(errno));
      }
      p += k;
      n -= k;
      off_ += k;
    }
  }
  void pad_to(int64_t align) {
    static const char zeros[kSectionAlign] = {};
    const int64_t pad = (align - off_ % align) % align;
    write(zeros, pad);
  }
  int64_t offset() const { return off_; }
  uint64_t digest() const { return hash_.digest(); }
  void chmod(mode_t mode) {
    if (::fchmod(fd_, mode) != 0) CKPT_FAIL(path_, "cannot set the permissions: " + errno_text(errno));
  }
  void finish() {
    if (::fsync(fd_) != 0) CKPT_FAIL(path_, "fsync failed: " + errno_text(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) CKPT_FAIL(path_, "close failed: " + errno_text(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t off_ = 0;
  HashState hash_;
};

class FileReader {
 public:
  explicit FileReader(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) CKPT_FAIL(path, errno == ENOENT ? std::string("missing") : "cannot open: " + errno_text(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) CKPT_FAIL(path, "cannot stat: " + errno_text(errno));
    if (!S_ISREG(st.st_mode)) CKPT_FAIL(path, "not a regular file");
    size_ = int64_t(st.st_size);
  }
  ~FileReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  void read_at(int64_t off, void* dst, int64_t n) const {
    char* p = static_cast<char*>(dst);
    const int64_t want = n, at = off;
    while (n > 0) {
      const ssize_t k = ::pread(fd_, p, size_t(std::min<int64_t>(n, int64_t(1) << 30)), off_t(off));
      if (k < 0) {
        if (errno == EINTR) continue;
        CKPT_FAIL(path_, "read failed: " + errno_text(errno));
      }
      if (k == 0)
        CKPT_FAIL(path_, "truncated: " + std::to_string(want) + " bytes wanted at offset " + std::to_string(at) +
                           ", the file has " + std::to_string(size_));
      p += k;
      n -= k;
      off += k;
    }
  }
  uint64_t hash_all() const {
    HashState h;
    std::vector<char> buf(size_t(std::min<int64_t>(std::max<int64_t>(size_, 1), int64_t(8) << 20)));
    for (int64_t off = 0; off < size_;) {
      const int64_t n = std::min<int64_t>(int64_t(buf.size()), size_ - off);
      read_at(off, buf.data(), n);
      h.update(buf.data(), size_t(n));
      off += n;
    }
    return h.digest();
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

std::string file_read_text(const std::string& path, int64_t limit = int64_t(1) << 30) {
  FileReader f(path);
  if (f.size() > limit) CKPT_FAIL(path, "too large (" + std::to_string(f.size()) + " bytes)");
  std::string s(size_t(f.size()), '\0');
  f.read_at(0, s.data(), f.size());
  return s;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) CKPT_FAIL(dir, "cannot open the directory to sync it: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL) CKPT_FAIL(dir, "fsync of the directory failed: " + errno_text(e));
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) CKPT_FAIL(from, "cannot rename to " + to + ": " + errno_text(errno));
}

bool exists(const std::string& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

void remove_tree(const std::string& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) CKPT_FAIL(p, "cannot remove: " + ec.message());
}

// ---- names and enums ----

bool tag_check(const std::string& t, std::string* why) {
  if (t.empty()) *why = "is empty";
  else if (t.size() > 200) *why = "is longer than 200 characters";
  else if (std::any_of(t.begin(), t.end(), [](char ch) { return ch == '/' || (unsigned char)ch < 0x20 || ch == 0x7f; }))
    *why = "contains '/' or a control character";
  else if (t[0] == '.') *why = "starts with '.' (names of temporary directories do)";
  else if (t == kLatestName || t == kLatestTmpName) *why = "is reserved";
  else return true;
  return false;
}

const char* safetensors_dtype(DType t) { return t == DType::f32 ? "F32" : t == DType::bf16 ? "BF16" : "F16"; }

// Bytes per element of a safetensors dtype this format stores (the module's other state_dict entries
// may be of any of these); 0 for any other.
int st_dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                   {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U64", 8},  {"U32", 4},
                                                   {"U16", 2}, {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

bool dtype_parse(const std::string& s, DType* t) {
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    if (s == dtype_name(d) || s == safetensors_dtype(d)) {
      *t = d;
      return true;
    }
  return false;
}

bool algo_parse(const std::string& s, optim::Algo* a) {
  for (int i = 0; i <= int(optim::Algo::lars); ++i)
    if (s == optim::algo_name(optim::Algo(i))) {
      *a = optim::Algo(i);
      return true;
    }
  return false;
}

int group_index(const std::string& name) {
  for (int g = 0; g < kNumGroups; ++g)
    if (name == shard::group_name(Group(g))) return g;
  return -1;
}

// Element size of a section kind (absmax: one float32 per block).
int kind_esize(const std::string& kind) { return kind.rfind("codes", 0) == 0 ? 1 : 4; }
bool kind_is_blocks(const std::string& kind) { return kind.rfind("absmax", 0) == 0; }

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// ---- maps ----

uint64_t map_hash(const quant::QuantTable& t) { return XXH3_64bits(t.values, sizeof(t.values)); }

std::string map_kind_of(const quant::QuantTable* t) {
  for (int k = 0; k <= int(quant::MapKind::linear_unsigned); ++k)
    if (t == &quant::table_get(quant::MapKind(k))) return quant::map_kind_name(quant::MapKind(k));
  return "custom";
}

// ---- collectives ----

struct Failure {
  bool failed = false;
  ErrorCode code = ErrorCode::io;
  std::string what;
};

template <class F>
Failure attempt(F&& f) {
  try {
    f();
    return {};
  } catch (const Error& e) {
    return {true, e.code(), e.what()};
  } catch (const std::exception& e) {
    return {true, ErrorCode::io, e.what()};
  }
}

std::string broadcast_string(comm::Communicator& c, const std::string& s, int root) {
  int64_t n = c.rank() == root ? int64_t(s.size()) : 0;
  c.broadcast(&n, sizeof(n), root);
  std::string out = c.rank() == root ? s : std::string(size_t(n), '\0');
  if (n > 0) c.broadcast(out.data(), n, root);
  return out;
}

// Every rank passes its own outcome; when any rank failed, every rank throws the first failing
// rank's error (so no rank goes on to a collective the others will not join).
void agree(comm::Communicator& c, const Failure& mine) {
  const int32_t first = c.all_reduce_value<int32_t>(mine.failed ? c.rank() : c.size(), comm::ReduceOp::min);
  if (first == c.size()) return;
  int32_t code = int32_t(mine.code);
  c.broadcast(&code, sizeof(code), first);
  const std::string what = broadcast_string(c, mine.what, first);
  throw Error(ErrorCode(code), c.size() > 1 ? "rank " + std::to_string(first) + ": " + what : what);
}

std::vector<std::string> all_gather_strings(comm::Communicator& c, const std::string& s) {
  const size_t w = size_t(c.size());
  std::vector<int64_t> lens(w);
  const int64_t mine = int64_t(s.size());
  c.all_gather(&mine, lens.data(), sizeof(int64_t));
  std::vector<int64_t> displs(w, 0);
  for (size_t p = 1; p < w; ++p) displs[p] = displs[p - 1] + lens[p - 1];
  std::string all(size_t(displs[w - 1] + lens[w - 1]), '\0');
  c.all_gather_v(s.data(), mine, all.data(), lens, displs);
  std::vector<std::string> out(w);
  for (size_t p = 0; p < w; ++p) out[p] = all.substr(size_t(displs[p]), size_t(lens[p]));
  return out;
}

// ---- manifest <-> JSON ----

json hyper_to_json(const optim::Hyper& h) {
  return json{{"lr", h.lr},
              {"beta1", h.beta1},
              {"beta2", h.beta2},
              {"eps", h.eps},
              {"weight_decay", h.weight_decay},
              {"dampening", h.dampening},
              {"nesterov", h.nesterov},
              {"bias_correction", h.bias_correction},
              {"lr_decay", h.lr_decay},
              {"initial_accumulator", h.initial_accumulator},
              {"trust_coefficient", h.trust_coefficient},
              {"max_trust_ratio", h.max_trust_ratio},
              {"min_trust_ratio", h.min_trust_ratio}};
}

json file_to_json(const FileInfo& f) {
  json j{{"name", f.name}, {"role", f.role}};
  if (f.role == "shard") j["rank"] = f.rank;
  j["bytes"] = f.bytes;
  j["xxh3_64"] = hex64(f.xxh3);
  if (f.role == "shard") {
    json secs = json::array();
    for (const SectionInfo& s : f.sections)
      secs.push_back(json{{"group", s.group},
                          {"kind", s.kind},
                          {"unit", kind_is_blocks(s.kind) ? "block" : "element"},
                          {"dtype", kind_esize(s.kind) == 1 ? "uint8" : "float32"},
                          {"begin", s.begin},
                          {"end", s.end},
                          {"offset", s.offset},
                          {"bytes", s.bytes}});
    j["sections"] = std::move(secs);
  }
  return j;
}

// The manifest's own checksum: xxh3 of the compact dump of every other field, keys in the order the file
// lists them (json is nlohmann's ordered_json, so a parsed manifest dumps to the same text). It covers what no file checksum
// does: the layout, the config and the client state (the engine's step counters, the scheduler).
constexpr const char* kManifestHashKey = "manifest_xxh3";
uint64_t manifest_hash(json j) {
  j.erase(kManifestHashKey);
  const std::string text = j.dump();
  return XXH3_64bits(text.data(), text.size());
}

json manifest_to_json(const Manifest& m) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] = m.format_version;
  j["zero8_version"] = m.zero8_version;
  j["tag"] = m.tag;
  j["nonce"] = hex64(m.nonce);
  j["saved_unix_s"] = m.saved_unix_s;
  j["step"] = m.step;
  j["world_size"] = m.world;
  json hyper = hyper_to_json(m.hyper);
  j["optimizer"] = json{{"algo", optim::algo_name(m.algo)},
                        {"state_bits", m.state_bits},
                        {"num_states", m.num_states},
                        {"initial_accumulator", m.initial_accumulator},
                        {"hyper", hyper}};
  j["blocks"] = json{{"state_block", m.state_block}, {"wire_block", m.wire_block}, {"min_8bit_size", m.min_8bit_size}};
  json maps = json::array();
  for (const MapInfo& mi : m.maps) maps.push_back(json{{"state", mi.state}, {"kind", mi.kind}, {"xxh3_64", hex64(mi.xxh3)}});
  j["maps"] = std::move(maps);
  j["working_dtype"] = dtype_name(m.working_dtype);
  j["error_feedback"] = m.error_feedback;
  j["loss_scaler"] = json{{"fp16", m.fp16},
                          {"scale", m.loss_scaler.scale},
                          {"cur_iter", m.loss_scaler.cur_iter},
                          {"last_overflow_iter", m.loss_scaler.last_overflow_iter},
                          {"cur_hysteresis", m.loss_scaler.cur_hysteresis}};
  json groups = json::array();
  for (const GroupInfo& g : m.groups)
    groups.push_back(json{{"name", g.name},
                          {"numel", g.numel},
                          {"align", g.align},
                          {"chunk", g.chunk},
                          {"padded", g.padded},
                          {"state_bits", g.state_bits},
                          {"num_blocks", g.num_blocks}});
  j["groups"] = std::move(groups);
  json params = json::array();
  for (const ParamInfo& p : m.params)
    params.push_back(json{{"name", p.name},
                          {"shape", p.shape},
                          {"dtype", dtype_name(m.working_dtype)},
                          {"group", p.group},
                          {"offset", p.offset},
                          {"numel", p.numel},
                          {"fp32_state", p.fp32_state},
                          {"hyper_group", p.hyper_group}});
  j["params"] = std::move(params);
  json files = json::array();
  for (const FileInfo& f : m.files) files.push_back(file_to_json(f));
  j["files"] = std::move(files);
  if (!m.state_dict.empty()) {
    json sd = json::array();
    for (const StateDictEntry& e : m.state_dict) {
      json x{{"name", e.name}, {"source", e.source}, {"tensor", e.tensor}};
      if (e.source == "model_rest") {
        x["dtype"] = e.dtype;
        x["shape"] = e.shape;
      }
      sd.push_back(std::move(x));
    }
    j["state_dict"] = std::move(sd);
  }
  j["config"] = json::parse(m.config_json);
  j["client_state"] = json::parse(m.client_state);
  j[kManifestHashKey] = hex64(manifest_hash(j));
  return j;
}

// Typed field access for the parser: every failure names the file and the field.
struct Fields {
  const std::string& src;

  const json& at(const json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) CKPT_FAIL(src, "'" + where + "' is not an object");
    auto it = j.find(key);
    if (it == j.end()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is missing");
    return *it;
  }
  int64_t i64(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_number_integer()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not an integer");
    return v.get<int64_t>();
  }
  double num(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_number()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not a number");
    return v.get<double>();
  }
  bool boolean(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_boolean()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not true/false");
    return v.get<bool>();
  }
  std::string str(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_string()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not a string");
    return v.get<std::string>();
  }
  uint64_t hash(const json& j, const char* key, const std::string& where = "") const {
    uint64_t h = 0;
    if (!hex64_parse(str(j, key, where), &h))
      CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not 16 lowercase hex digits");
    return h;
  }
  const json& arr(const json& j, const char* key, const std::string& where = "") const {
    const json& v = at(j, key, where);
    if (!v.is_array()) CKPT_FAIL(src, "field '" + where + (where.empty() ? "" : ".") + key + "' is not an array");
    return v;
  }
};

FileInfo file_from_json(const json& j, const Fields& F, const std::string& where) {
  FileInfo f;
  f.name = F.str(j, "name", where);
  f.role = F.str(j, "role", where);
  if (f.role != "shard" && f.role != "model" && f.role != "extra")
    CKPT_FAIL(F.src, where + ": unknown file role '" + f.role + "'");
  f.bytes = F.i64(j, "bytes", where);
  f.xxh3 = F.hash(j, "xxh3_64", where);
  if (f.role == "shard") {
    f.rank = int(F.i64(j, "rank", where));
    const json& secs = F.arr(j, "sections", where);
    for (size_t i = 0; i < secs.size(); ++i) {
      const std::string w = where + ".sections[" + std::to_string(i) + "]";
      SectionInfo s;
      s.group = F.str(secs[i], "group", w);
      s.kind = F.str(secs[i], "kind", w);
      s.begin = F.i64(secs[i], "begin", w);
      s.end = F.i64(secs[i], "end", w);
      s.offset = F.i64(secs[i], "offset", w);
      s.bytes = F.i64(secs[i], "bytes", w);
      f.sections.push_back(s);
    }
  }
  return f;
}

// The section kinds a group holds (besides the rank-local residual).
std::vector<std::string> group_kinds(const Manifest& m, int g) {
  std::vector<std::string> k = {"master"};
  const bool q8 = m.groups[g].state_bits == 8;
  for (int s = 1; s <= m.num_states; ++s) {
    if (q8) {
      k.push_back("codes" + std::to_string(s));
      k.push_back("absmax" + std::to_string(s));
    } else {
      k.push_back("state" + std::to_string(s));
    }
  }
  return k;
}

// An extra file's name: one plain path component that no file of the checkpoint itself uses.
bool extra_name_ok(const std::string& name) {
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos || name.find('\\') != std::string::npos)
    return false;
  if (name == kManifestName || name == kModelName) return false;
  return name.rfind(kShardPrefix, 0) != 0;
}

// Sections of all shards: each (group, kind) must tile its global range exactly once.
void manifest_check_sections(const Manifest& m, const std::string& src) {
  int model_files = 0;
  std::vector<int> shard_of_rank(size_t(m.world), -1);
  std::map<std::string, int> names;
  for (size_t fi = 0; fi < m.files.size(); ++fi) {
    const FileInfo& f = m.files[fi];
    if (!names.emplace(f.name, int(fi)).second) CKPT_FAIL(src, "file '" + f.name + "' is listed twice");
    if (f.bytes < 0) CKPT_FAIL(src, f.name + ": negative size");
    if (f.role == "model") {
      ++model_files;
      if (f.name != kModelName) CKPT_FAIL(src, "the model file is named '" + f.name + "', expected " + kModelName);
      continue;
    }
    if (f.role == "extra") {
      if (!extra_name_ok(f.name)) CKPT_FAIL(src, "extra file '" + f.name + "': not a plain file name of its own");
      continue;
    }
    if (f.rank < 0 || f.rank >= m.world)
      CKPT_FAIL(src, f.name + ": rank " + std::to_string(f.rank) + " outside the world size " + std::to_string(m.world));
    if (shard_of_rank[size_t(f.rank)] >= 0) CKPT_FAIL(src, "two shard files for rank " + std::to_string(f.rank));
    shard_of_rank[size_t(f.rank)] = int(fi);
    if (f.name != shard_file_name(f.rank))
      CKPT_FAIL(src, "the shard of rank " + std::to_string(f.rank) + " is named '" + f.name + "', expected " +
                       shard_file_name(f.rank));
    // Sections lie inside the file, after the header, without overlapping.
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const SectionInfo& s : f.sections) {
      const std::string what = f.name + " section " + s.group + " " + s.kind;
      const int g = group_index(s.group);
      if (g < 0) CKPT_FAIL(src, what + ": unknown group");
      const std::vector<std::string> kinds = group_kinds(m, g);
      if (s.kind != "residual" && std::find(kinds.begin(), kinds.end(), s.kind) == kinds.end())
        CKPT_FAIL(src, what + ": this optimizer's " + s.group + " group has no such state");
      if (s.kind == "residual" && !m.error_feedback) CKPT_FAIL(src, what + ": error_feedback is false");
      if (s.begin < 0 || s.end <= s.begin)
        CKPT_FAIL(src, what + ": bad range [" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")");
      if (s.bytes != (s.end - s.begin) * kind_esize(s.kind))
        CKPT_FAIL(src, what + ": " + std::to_string(s.bytes) + " bytes for " + std::to_string(s.end - s.begin) +
                         (kind_is_blocks(s.kind) ? " blocks" : " elements"));
      if (s.offset < int64_t(sizeof(ShardHeader)) || s.offset + s.bytes > f.bytes)
        CKPT_FAIL(src, what + ": bytes [" + std::to_string(s.offset) + ", " + std::to_string(s.offset + s.bytes) +
                         ") outside the file's data (" + std::to_string(f.bytes) + " bytes)");
      spans.emplace_back(s.offset, s.offset + s.bytes);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second)
        CKPT_FAIL(src, f.name + ": sections overlap at byte " + std::to_string(spans[i].first));
  }
  if (model_files != 1) CKPT_FAIL(src, std::to_string(model_files) + " model files listed, expected 1");
  for (int r = 0; r < m.world; ++r)
    if (shard_of_rank[size_t(r)] < 0) CKPT_FAIL(src, "no shard file listed for rank " + std::to_string(r));

  struct Piece {
    int64_t begin, end;
    const std::string* file;
  };
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupInfo& gi = m.groups[g];
    std::vector<std::string> kinds = group_kinds(m, g);
    if (m.error_feedback && gi.padded > 0) kinds.push_back("residual");
    for (const std::string& kind : kinds) {
      if (kind == "residual") {
        // Rank-local: each shard holds its own residual over the whole padded group.
        for (const FileInfo& f : m.files) {
          if (f.role != "shard") continue;
          int n = 0;
          for (const SectionInfo& s : f.sections)
            if (s.group == gi.name && s.kind == kind) {
              ++n;
              if (s.begin != 0 || s.end != gi.padded)
                CKPT_FAIL(src, f.name + ": " + gi.name + " residual covers [" + std::to_string(s.begin) + ", " +
                                 std::to_string(s.end) + "), expected [0, " + std::to_string(gi.padded) + ")");
            }
          if (n != 1) CKPT_FAIL(src, f.name + ": " + std::to_string(n) + " " + gi.name + " residual sections, expected 1");
        }
        continue;
      }
      const bool blocks = kind_is_blocks(kind);
      const int64_t total = blocks ? gi.num_blocks : gi.numel;
      const char* unit = blocks ? "blocks" : "elements";
      std::vector<Piece> pieces;
      for (const FileInfo& f : m.files)
        for (const SectionInfo& s : f.sections)
          if (s.group == gi.name && s.kind == kind) pieces.push_back(Piece{s.begin, s.end, &f.name});
      std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
      int64_t pos = 0;
      const std::string* prev = nullptr;
      for (const Piece& p : pieces) {
        if (p.begin > pos)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(pos) + ", " + std::to_string(p.begin) +
                           ") are in no shard");
        if (p.begin < pos)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(p.begin) + ", " +
                           std::to_string(std::min(pos, p.end)) + ") are covered twice (" + *prev + " and " + *p.file + ")");
        if (p.end > total)
          CKPT_FAIL(src, gi.name + " " + kind + ": " + *p.file + " covers " + unit + " up to " + std::to_string(p.end) +
                           ", the group has " + std::to_string(total));
        pos = p.end;
        prev = p.file;
      }
      if (pos < total)
        CKPT_FAIL(src, gi.name + " " + kind + ": " + unit + " [" + std::to_string(pos) + ", " + std::to_string(total) +
                         ") are in no shard");
    }
  }
}

// The manifest's state_dict: unique keys, each resolving to a parameter or to a tensor of the model_rest
// file (listed), the aliases of one tensor agreeing on its dtype and shape.
void state_dict_parse(Manifest& m, const json& arr, const Fields& F) {
  const std::string& src = F.src;
  std::set<std::string> params, keys;
  for (const ParamInfo& p : m.params) params.insert(p.name);
  std::map<std::string, const StateDictEntry*> rest;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string w = "state_dict[" + std::to_string(i) + "]";
    StateDictEntry e;
    e.name = F.str(arr[i], "name", w);
    e.source = F.str(arr[i], "source", w);
    e.tensor = F.str(arr[i], "tensor", w);
    if (e.name.empty() || e.name == "__metadata__") CKPT_FAIL(src, w + ": key '" + e.name + "' cannot be a safetensors name");
    if (!keys.insert(e.name).second) CKPT_FAIL(src, w + ": key '" + e.name + "' is listed twice");
    if (e.source == "param") {
      if (!params.count(e.tensor)) CKPT_FAIL(src, w + " '" + e.name + "': no parameter '" + e.tensor + "'");
    } else if (e.source == "model_rest") {
      e.dtype = F.str(arr[i], "dtype", w);
      if (st_dtype_size(e.dtype) == 0) CKPT_FAIL(src, w + " '" + e.name + "': unknown dtype '" + e.dtype + "'");
      for (const json& d : F.arr(arr[i], "shape", w)) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) CKPT_FAIL(src, w + " '" + e.name + "': bad shape");
        e.shape.push_back(d.get<int64_t>());
      }
    } else {
      CKPT_FAIL(src, w + " '" + e.name + "': unknown source '" + e.source + "'");
    }
    m.state_dict.push_back(std::move(e));
  }
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source != "model_rest") continue;
    auto [it, fresh] = rest.emplace(e.tensor, &e);
    if (!fresh && (it->second->dtype != e.dtype || it->second->shape != e.shape))
      CKPT_FAIL(src, "state_dict: '" + e.name + "' and '" + it->second->name + "' name the same tensor with another dtype or shape");
  }
  if (!rest.empty() && std::none_of(m.files.begin(), m.files.end(), [](const FileInfo& f) { return f.name == kModelRestName; }))
    CKPT_FAIL(src, std::string("state_dict names tensors of ") + kModelRestName + ", which is not listed in 'files'");
}

// ---- tags in a directory ----

struct TagEntry {
  std::string name;
  double saved = 0.0;
  int64_t step = 0;
};

// Subdirectories holding a zero8 manifest (read lightly: format, save time, step), oldest first.
std::vector<TagEntry> tags_scan(const std::string& dir) {
  std::vector<TagEntry> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::string why;
    if (!tag_check(name, &why) || !e.is_directory(ec)) continue;
    try {
      const json j = json::parse(file_read_text(join(e.path().string(), kManifestName), int64_t(1) << 28));
      if (!j.is_object() || j.value("format", "") != kFormatName) continue;
      out.push_back(TagEntry{name, j.value("saved_unix_s", 0.0), j.value("step", int64_t(0))});
    } catch (const std::exception&) {
      // not a complete tag (no manifest, or an unreadable one): never listed, never removed
    }
  }
  if (ec) CKPT_FAIL(dir, "cannot list: " + ec.message());
  std::sort(out.begin(), out.end(), [](const TagEntry& a, const TagEntry& b) {
    return a.saved != b.saved ? a.saved < b.saved : a.name < b.name;
  });
  return out;
}

// The tag a .replaced-* directory holds ("" when it has no readable manifest).
std::string replaced_tag(const std::string& path) {
  try {
    const json j = json::parse(file_read_text(join(path, kManifestName), int64_t(1) << 28));
    return j.value("tag", "");
  } catch (const std::exception&) {
    return "";
  }
}

// Leftovers of interrupted saves: temporary directories and latest.tmp are removed. A moved-aside
// tag (two-rename replace) is removed when its replacement is in place, and otherwise renamed back:
// it is then the only copy of its tag, and latest may name it.
void leftovers_remove(const std::string& dir) {
  std::vector<fs::path> entries;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  if (ec) CKPT_FAIL(dir, "cannot list: " + ec.message());
  bool renamed = false;
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0 || name == kLatestTmpName) {
      remove_tree(p.string());
    } else if (name.rfind(kReplacedPrefix, 0) == 0) {
      const std::string t = replaced_tag(p.string());
      std::string why;
      if (t.empty() || !tag_check(t, &why) || exists(join(join(dir, t), kManifestName))) {
        remove_tree(p.string());
      } else {
        if (exists(join(dir, t))) remove_tree(join(dir, t));  // an incomplete directory of that name
        rename_or_fail(p.string(), join(dir, t));
        renamed = true;
      }
    }
  }
  if (renamed) fsync_dir(dir);
}

// ---- writing ----

struct SectionSource {
  SectionInfo info;
  const void* data;
};

FileInfo shard_write(ShardedOptimizer& opt, const std::string& tmp, uint64_t nonce, const Env& env) {
  const int r = opt.rank();
  const shard::Layout& lay = opt.layout();
  std::vector<SectionSource> secs;
  auto add = [&](int g, const std::string& kind, int64_t b, int64_t e, const void* p) {
    SectionInfo s;
    s.group = shard::group_name(Group(g));
    s.kind = kind;
    s.begin = b;
    s.end = e;
    s.bytes = (e - b) * kind_esize(kind);
    secs.push_back(SectionSource{s, p});
  };
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    const int64_t b = gl.part_begin(r), valid = gl.part_valid(r);
    if (valid > 0) {
      add(g, "master", b, b + valid, opt.master(Group(g)));
      optim::State* st = opt.state(Group(g));
      const optim::StateLayout& sl = st->layout();
      for (int k = 1; k <= sl.num_states; ++k) {
        const std::string n = std::to_string(k);
        if (sl.bits == 8) {
          add(g, "codes" + n, b, b + valid, st->codes(k));
          add(g, "absmax" + n, b / sl.block, b / sl.block + sl.num_blocks(), st->absmax(k));
        } else {
          add(g, "state" + n, b, b + valid, st->fp32(k));
        }
      }
    }
    const std::vector<float>& res = opt.residual(Group(g));
    if (!res.empty() && gl.padded() > 0) add(g, "residual", 0, gl.padded(), res.data());
  }

  FileInfo fi;
  fi.name = shard_file_name(r);
  fi.role = "shard";
  fi.rank = r;
  FileWriter w(join(tmp, fi.name), true);
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, sizeof(h.magic));
  h.version = uint32_t(kFormatVersion);
  h.header_bytes = sizeof(ShardHeader);
  h.rank = r;
  h.world = opt.world();
  h.step = opt.steps();
  h.nonce = nonce;
  w.write(&h, sizeof(h));
  for (size_t i = 0; i < secs.size(); ++i) {
    if (i == secs.size() / 2) crash_at(env, "mid_shard", r);
    w.pad_to(kSectionAlign);
    secs[i].info.offset = w.offset();
    w.write(secs[i].data, secs[i].info.bytes);
    fi.sections.push_back(secs[i].info);
  }
  if (secs.empty()) crash_at(env, "mid_shard", r);
  w.finish();
  fi.bytes = w.offset();
  fi.xxh3 = w.digest();
  return fi;
}

// One tensor of a safetensors file being written: its header entry and its bytes.
struct SafetensorsTensor {
  const std::string& name;
  const std::string& dtype;
  const std::vector<int64_t>& shape;
  const void* data;
  int64_t bytes;
};

// The head of a safetensors file (https://github.com/huggingface/safetensors): u64 LE header length, then
// a JSON header (the metadata, then each tensor's dtype, shape and data offsets, the tensors in the
// given order) padded with spaces to 8 bytes. The tensors' bytes follow it.
void safetensors_header_write(FileWriter& w, const json& metadata, const std::vector<SafetensorsTensor>& tensors) {
  json h;
  h["__metadata__"] = metadata;
  int64_t off = 0;
  for (const SafetensorsTensor& t : tensors) {
    h[t.name] = json{{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes}}};
    off += t.bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t hl = text.size();
  w.write(&hl, 8);
  w.write(text.data(), int64_t(text.size()));
}

// A safetensors file of the tag, the tensors' bytes in memory.
FileInfo safetensors_write(const std::string& tmp, const char* name, const char* role, const std::string& tag,
                           int64_t step, const std::vector<SafetensorsTensor>& tensors) {
  FileInfo fi;
  fi.name = name;
  fi.role = role;
  FileWriter w(join(tmp, fi.name), true);
  safetensors_header_write(w, json{{"format", "pt"}, {"zero8_tag", tag}, {"zero8_step", std::to_string(step)}},
                           tensors);
  for (const SafetensorsTensor& t : tensors) w.write(t.data, t.bytes);
  w.finish();
  fi.bytes = w.offset();
  fi.xxh3 = w.digest();
  return fi;
}

// The working copy in its dtype, in model order.
FileInfo model_write(ShardedOptimizer& opt, const std::string& tmp, const std::string& tag) {
  const shard::Layout& lay = opt.layout();
  const std::string dtype = safetensors_dtype(opt.config().working_dtype);
  const int es = dtype_size(opt.config().working_dtype);
  std::vector<SafetensorsTensor> tensors;
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSpec& p = lay.params[i];
    ZERO8_CHECK_ARG(p.name != "__metadata__", "params", "a parameter named '__metadata__' cannot be saved as safetensors");
    tensors.push_back({p.name, dtype, p.shape, opt.param_working(int(i)), lay.slots[i].numel * es});
  }
  return safetensors_write(tmp, kModelName, "model", tag, opt.steps(), tensors);
}

// SaveOptions::state_dict and module_tensors checked and resolved against opt (rank 0, before anything
// is written): the manifest's state_dict.
std::vector<StateDictEntry> state_dict_of(ShardedOptimizer& opt, const SaveOptions& o) {
  std::vector<StateDictEntry> out;
  if (o.state_dict.empty()) {
    ZERO8_CHECK_ARG(o.module_tensors.empty(), "module_tensors", "given without a state_dict naming them");
    return out;
  }
  std::set<std::string> params;
  for (const shard::ParamSpec& p : opt.layout().params) params.insert(p.name);
  std::map<std::string, const SaveOptions::ModuleTensor*> rest;
  for (const SaveOptions::ModuleTensor& t : o.module_tensors) {
    const int es = st_dtype_size(t.dtype);
    ZERO8_CHECK_ARG(es > 0, "module_tensors", "'" << t.name << "': unsupported dtype '" << t.dtype << "'");
    ZERO8_CHECK_ARG(!t.name.empty() && t.name != "__metadata__", "module_tensors", "'" << t.name << "' cannot be a safetensors name");
    ZERO8_CHECK_ARG(!params.count(t.name), "module_tensors", "'" << t.name << "' is also the name of a trained parameter");
    int64_t n = 1;
    for (int64_t d : t.shape) {
      ZERO8_CHECK_ARG(d >= 0, "module_tensors", "'" << t.name << "': negative dimension");
      n *= d;
    }
    ZERO8_CHECK_ARG(t.bytes.size == n * es, "module_tensors",
                    "'" << t.name << "': " << t.bytes.size << " bytes for " << n << " elements of " << t.dtype);
    ZERO8_CHECK_ARG(t.bytes.data != nullptr || n == 0, "module_tensors", "'" << t.name << "': no data (null pointer)");
    ZERO8_CHECK_ARG(rest.emplace(t.name, &t).second, "module_tensors", "'" << t.name << "' is given twice");
  }
  std::set<std::string> keys, used;
  for (const auto& [key, from] : o.state_dict) {
    ZERO8_CHECK_ARG(!key.empty() && key != "__metadata__", "state_dict", "key '" << key << "' cannot be a safetensors name");
    ZERO8_CHECK_ARG(keys.insert(key).second, "state_dict", "key '" << key << "' is given twice");
    StateDictEntry e;
    e.name = key;
    e.tensor = from;
    auto it = rest.find(from);
    if (it != rest.end()) {
      e.source = "model_rest";
      e.dtype = it->second->dtype;
      e.shape = it->second->shape;
      used.insert(from);
    } else {
      ZERO8_CHECK_ARG(params.count(from), "state_dict",
                      "key '" << key << "': '" << from << "' is neither a trained parameter nor one of module_tensors");
      e.source = "param";
    }
    out.push_back(std::move(e));
  }
  for (const SaveOptions::ModuleTensor& t : o.module_tensors)
    ZERO8_CHECK_ARG(used.count(t.name), "module_tensors", "'" << t.name << "' is not the source of any state_dict key");
  return out;
}

// The module's other state_dict entries (SaveOptions::module_tensors) at their dtype.
FileInfo model_rest_write(const std::vector<SaveOptions::ModuleTensor>& tensors, const std::string& tmp, const std::string& tag,
                          int64_t step) {
  std::vector<SafetensorsTensor> out;
  for (const SaveOptions::ModuleTensor& t : tensors)
    out.push_back({t.name, t.dtype, t.shape, t.bytes.data, t.bytes.size});
  return safetensors_write(tmp, kModelRestName, "extra", tag, step, out);
}

// What the manifest says about the optimizer itself (everything but the files and the names).
Manifest manifest_of(ShardedOptimizer& opt) {
  const shard::ShardConfig& cfg = opt.config();
  const shard::Layout& lay = opt.layout();
  Manifest m;
  m.format_version = kFormatVersion;
  m.zero8_version = zero8::version();
  m.step = opt.steps();
  m.world = opt.world();
  m.algo = cfg.algo;
  m.state_bits = cfg.bits;
  m.num_states = optim::algo_num_states(cfg.algo);
  m.hyper = cfg.hyper;
  m.initial_accumulator = cfg.initial_accumulator;
  m.state_block = lay.cfg.state_block;
  m.wire_block = lay.cfg.wire_block;
  m.min_8bit_size = lay.cfg.min_8bit_size;
  m.working_dtype = cfg.working_dtype;
  m.error_feedback = !opt.residual(Group::q8).empty() || !opt.residual(Group::fp32).empty();
  m.fp16 = cfg.fp16;
  m.loss_scaler = opt.scaler().state();
  if (cfg.bits == 8) {
    optim::State* st = opt.state(Group::q8);
    for (int k = 1; k <= m.num_states; ++k)
      m.maps.push_back(MapInfo{k, map_kind_of(st->map(k)), map_hash(*st->map(k))});
  }
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    GroupInfo& gi = m.groups[g];
    gi.name = shard::group_name(Group(g));
    gi.numel = gl.numel;
    gi.align = gl.align;
    gi.chunk = gl.chunk;
    gi.padded = gl.padded();
    gi.state_bits = g == int(Group::q8) ? cfg.bits : 32;
    gi.num_blocks = gi.state_bits == 8 ? (gl.numel + m.state_block - 1) / m.state_block : 0;
  }
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSlot& s = lay.slots[i];
    m.params.push_back(ParamInfo{lay.params[i].name, lay.params[i].shape, shard::group_name(s.group), s.offset, s.numel,
                                 lay.params[i].fp32_state, lay.params[i].hyper_group});
  }
  return m;
}

std::string json_option(const std::string& text, const char* name) {
  if (text.empty()) return "null";
  try {
    return json::parse(text).dump();
  } catch (const json::exception& e) {
    ZERO8_CHECK_ARG(false, name, "not valid JSON: " << e.what());
  }
  return "null";
}

uint64_t nonce_make() {
  std::random_device rd;
  uint64_t x = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  x ^= uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  x ^= uint64_t(::getpid()) << 17;
  return x ? x : 1;
}

// Replace <dir>/<tag> by the complete temporary directory. Returns the path now holding the old
// tag, to remove once latest has moved on ("" when there was none).
std::string tag_install(const std::string& dir, const std::string& tag, const std::string& tmp, uint64_t nonce,
                        const Env& env) {
  const std::string final_path = join(dir, tag);
  if (!exists(final_path)) {
    rename_or_fail(tmp, final_path);
    return "";
  }
  if (env.rename_exchange) {
    // One atomic step: <tag> is the new checkpoint, tmp holds the old one.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) return tmp;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      CKPT_FAIL(tmp, "cannot exchange with " + final_path + ": " + errno_text(errno));
  }
  // Two renames; in between, tag_path() finds the old tag under its .replaced- name.
  const std::string aside = join(dir, kReplacedPrefix + tag + "-" + hex64(nonce));
  rename_or_fail(final_path, aside);
  fsync_dir(dir);
  crash_at(env, "after_move_aside", 0);
  rename_or_fail(tmp, final_path);
  return aside;
}

void latest_write(const std::string& dir, const std::string& tag, const Env& env) {
  const std::string tmp = join(dir, kLatestTmpName);
  FileWriter w(tmp, false);
  w.write(tag.data(), int64_t(tag.size()));
  w.finish();
  crash_at(env, "before_latest_rename", 0);
  rename_or_fail(tmp, join(dir, kLatestName));
  fsync_dir(dir);
}

// Removes all but the `keep` most recently saved tags; `saved` (just saved) and `latest` ("" when
// there is none) always stay, and count toward `keep`.
std::vector<std::string> keep_last_prune(const std::string& dir, int keep, const std::string& saved,
                                         const std::string& latest) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  std::vector<TagEntry> tags = tags_scan(dir);  // oldest first
  int kept = 0;
  for (const TagEntry& t : tags) kept += t.name == saved || (t.name == latest && latest != saved);
  for (auto it = tags.rbegin(); it != tags.rend(); ++it) {
    if (it->name == saved || it->name == latest) continue;
    if (kept < keep) {
      ++kept;
      continue;
    }
    remove_tree(join(dir, it->name));
    removed.push_back(it->name);
  }
  if (!removed.empty()) fsync_dir(dir);
  std::reverse(removed.begin(), removed.end());
  return removed;
}

// ---- reading ----

// The files of one tag, opened on demand and checked once: size, shard header, checksum.
class FileSet {
 public:
  FileSet(const std::string& tag_dir, const Manifest& m, bool verify) : dir_(tag_dir), m_(m), verify_(verify) {}

  const FileInfo& info(const std::string& name) const {
    for (const FileInfo& f : m_.files)
      if (f.name == name) return f;
    CKPT_FAIL(join(dir_, kManifestName), "no file '" + name + "' listed");
  }

  const FileReader& get(const std::string& name) {
    auto it = open_.find(name);
    if (it != open_.end()) return *it->second;
    const FileInfo& fi = info(name);
    auto r = std::make_unique<FileReader>(join(dir_, name));
    if (r->size() < fi.bytes)
      CKPT_FAIL(r->path(), "truncated: " + std::to_string(r->size()) + " bytes, the manifest says " + std::to_string(fi.bytes));
    if (r->size() > fi.bytes)
      CKPT_FAIL(r->path(), std::to_string(r->size()) + " bytes, the manifest says " + std::to_string(fi.bytes));
    if (fi.role == "shard") header_check(*r, fi);
    if (verify_) {
      const uint64_t h = r->hash_all();
      hashed_ += r->size();
      if (h != fi.xxh3)
        CKPT_FAIL(r->path(), "checksum mismatch: xxh3 " + hex64(h) + ", the manifest says " + hex64(fi.xxh3) +
                               " (the file is corrupt)");
    }
    return *open_.emplace(name, std::move(r)).first->second;
  }

  int64_t hashed() const { return hashed_; }

  // Global range [lo, hi) (elements, or blocks for absmax) of one kind of group g into dst.
  void read_range(int g, const std::string& kind, int64_t lo, int64_t hi, void* dst) {
    if (hi <= lo) return;
    const std::string gname = shard::group_name(Group(g));
    const int es = kind_esize(kind);
    int64_t covered = 0;
    for (const FileInfo& f : m_.files)
      for (const SectionInfo& s : f.sections) {
        if (s.group != gname || s.kind != kind) continue;
        const int64_t a = std::max(lo, s.begin), b = std::min(hi, s.end);
        if (a >= b) continue;
        get(f.name).read_at(s.offset + (a - s.begin) * es, static_cast<char*>(dst) + (a - lo) * es, (b - a) * es);
        covered += b - a;
      }
    if (covered != hi - lo)
      CKPT_FAIL(join(dir_, kManifestName), gname + " " + kind + ": [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                             ") is not covered by the shards");
  }

  // Rank-local section (the residual) of the shard of `rank`.
  void read_local(int g, const std::string& kind, int rank, void* dst, int64_t bytes) {
    const FileInfo& f = info(shard_file_name(rank));
    for (const SectionInfo& s : f.sections)
      if (s.group == shard::group_name(Group(g)) && s.kind == kind) {
        if (s.bytes != bytes) CKPT_FAIL(join(dir_, f.name), kind + " of " + s.group + " has " + std::to_string(s.bytes) + " bytes");
        get(f.name).read_at(s.offset, dst, bytes);
        return;
      }
    CKPT_FAIL(join(dir_, f.name), "no " + kind + " section for the " + std::string(shard::group_name(Group(g))) + " group");
  }

 private:
  void header_check(const FileReader& r, const FileInfo& fi) {
    ShardHeader h;
    if (r.size() < int64_t(sizeof(h))) CKPT_FAIL(r.path(), "truncated: shorter than the 64-byte header");
    r.read_at(0, &h, sizeof(h));
    if (std::memcmp(h.magic, kShardMagic, sizeof(h.magic)) != 0) CKPT_FAIL(r.path(), "not a zero8 shard file (bad magic)");
    if (h.version != uint32_t(kFormatVersion))
      CKPT_FAIL(r.path(), "unknown shard format version " + std::to_string(h.version) + " (this zero8 reads version " +
                            std::to_string(kFormatVersion) + ")");
    if (h.rank != fi.rank || h.world != m_.world)
      CKPT_FAIL(r.path(), "header says rank " + std::to_string(h.rank) + " of " + std::to_string(h.world) +
                            ", the manifest rank " + std::to_string(fi.rank) + " of " + std::to_string(m_.world));
    if (h.nonce != m_.nonce)
      CKPT_FAIL(r.path(), "belongs to another save (nonce " + hex64(h.nonce) + ", the manifest's " + hex64(m_.nonce) + ")");
  }

  std::string dir_;
  const Manifest& m_;
  bool verify_;
  int64_t hashed_ = 0;
  std::map<std::string, std::unique_ptr<FileReader>> open_;
};

// The size and (with verify) checksum of the extra files (SaveOptions::extra_files), which zero8 does not
// read itself: its caller does, on every rank (the engine's model-states file). model_rest: also
// kModelRestName, which no load reads; one rank checking it is enough to fail a load that agrees.
void extras_check(FileSet& files, const Manifest& m, bool model_rest) {
  for (const FileInfo& fi : m.files)
    if (fi.role == "extra" && (model_rest || fi.name != kModelRestName)) files.get(fi.name);
}

struct SafetensorsEntry {
  std::string dtype;  // safetensors name (F32, BF16, I64, ...)
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // relative to the data start
};

struct Safetensors {
  int64_t data_start = 0;
  std::map<std::string, SafetensorsEntry> tensors;
};

Safetensors safetensors_parse(const FileReader& r) {
  Safetensors st;
  if (r.size() < 8) CKPT_FAIL(r.path(), "truncated: shorter than the 8-byte safetensors header length");
  uint64_t hl = 0;
  r.read_at(0, &hl, 8);
  if (hl > uint64_t(r.size() - 8) || hl > (uint64_t(1) << 30))
    CKPT_FAIL(r.path(), "safetensors header length " + std::to_string(hl) + " exceeds the file");
  std::string text(size_t(hl), '\0');
  r.read_at(8, text.data(), int64_t(hl));
  json h;
  try {
    h = json::parse(text);
  } catch (const json::exception& e) {
    CKPT_FAIL(r.path(), std::string("safetensors header is not valid JSON: ") + e.what());
  }
  if (!h.is_object()) CKPT_FAIL(r.path(), "safetensors header is not a JSON object");
  st.data_start = 8 + int64_t(hl);
  const int64_t data = r.size() - st.data_start;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const json& t = it.value();
    SafetensorsEntry e;
    const std::string what = "tensor '" + it.key() + "'";
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || st_dtype_size(t["dtype"].get<std::string>()) == 0)
      CKPT_FAIL(r.path(), what + ": missing or unsupported dtype");
    e.dtype = t["dtype"].get<std::string>();
    if (!t.contains("shape") || !t["shape"].is_array()) CKPT_FAIL(r.path(), what + ": missing shape");
    int64_t n = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) CKPT_FAIL(r.path(), what + ": bad shape");
      e.shape.push_back(d.get<int64_t>());
      n *= e.shape.back();
    }
    if (!t.contains("data_offsets") || !t["data_offsets"].is_array() || t["data_offsets"].size() != 2 ||
        !t["data_offsets"][0].is_number_integer() || !t["data_offsets"][1].is_number_integer())
      CKPT_FAIL(r.path(), what + ": missing data_offsets");
    e.begin = t["data_offsets"][0].get<int64_t>();
    e.end = t["data_offsets"][1].get<int64_t>();
    if (e.begin < 0 || e.end < e.begin || e.end > data)
      CKPT_FAIL(r.path(), what + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                            ") outside the " + std::to_string(data) + " data bytes");
    if (e.end - e.begin != n * st_dtype_size(e.dtype))
      CKPT_FAIL(r.path(), what + ": " + std::to_string(e.end - e.begin) + " bytes for shape " + shape_text(e.shape));
    spans.emplace_back(e.begin, e.end);
    st.tensors.emplace(it.key(), std::move(e));
  }
  // The format requires the tensors to fill the data without holes or overlaps.
  std::sort(spans.begin(), spans.end());
  int64_t pos = 0;
  for (const auto& s : spans) {
    if (s.first != pos) CKPT_FAIL(r.path(), "safetensors data has a hole or an overlap at byte " + std::to_string(pos));
    pos = s.second;
  }
  if (pos != data) CKPT_FAIL(r.path(), "safetensors data is " + std::to_string(data) + " bytes, the tensors " + std::to_string(pos));
  return st;
}

// The model file's tensors against the manifest's parameters.
void model_check(const Safetensors& st, const Manifest& m, const std::string& path) {
  for (const ParamInfo& p : m.params) {
    auto it = st.tensors.find(p.name);
    if (it == st.tensors.end()) CKPT_FAIL(path, "parameter '" + p.name + "' is missing");
    if (it->second.dtype != safetensors_dtype(m.working_dtype))
      CKPT_FAIL(path, "parameter '" + p.name + "' is " + it->second.dtype + ", the manifest says " +
                        safetensors_dtype(m.working_dtype));
    if (it->second.shape != p.shape)
      CKPT_FAIL(path, "parameter '" + p.name + "' has shape " + shape_text(it->second.shape) + ", the manifest says " +
                        shape_text(p.shape));
  }
  if (st.tensors.size() != m.params.size())
    CKPT_FAIL(path, std::to_string(st.tensors.size()) + " tensors, the manifest lists " + std::to_string(m.params.size()) +
                      " parameters");
}

// The model_rest file's tensors against the manifest's state_dict: exactly its model_rest tensors.
void model_rest_check(const Safetensors& st, const Manifest& m, const std::string& path) {
  std::set<std::string> want;
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source != "model_rest" || !want.insert(e.tensor).second) continue;
    auto it = st.tensors.find(e.tensor);
    if (it == st.tensors.end()) CKPT_FAIL(path, "tensor '" + e.tensor + "' (state_dict key '" + e.name + "') is missing");
    if (it->second.dtype != e.dtype || it->second.shape != e.shape)
      CKPT_FAIL(path, "tensor '" + e.tensor + "' is " + it->second.dtype + " " + shape_text(it->second.shape) +
                        ", the manifest says " + e.dtype + " " + shape_text(e.shape));
  }
  if (st.tensors.size() != want.size())
    CKPT_FAIL(path, std::to_string(st.tensors.size()) + " tensors, the manifest's state_dict names " +
                      std::to_string(want.size()));
}

// The checkpoint against the optimizer it is loaded into: what must match exactly.
void compat_check(const Manifest& m, ShardedOptimizer& opt, const std::string& src) {
  const shard::Layout& lay = opt.layout();
  const shard::ShardConfig& cfg = opt.config();
  const size_t n = std::min(m.params.size(), lay.params.size());
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& a = m.params[i];
    const shard::ParamSpec& b = lay.params[i];
    if (a.name != b.name) {
      std::vector<std::string> saved, here;
      for (const ParamInfo& p : m.params) saved.push_back(p.name);
      for (const shard::ParamSpec& p : lay.params) here.push_back(p.name);
      std::sort(saved.begin(), saved.end());
      std::sort(here.begin(), here.end());
      CKPT_FAIL(src, (saved == here ? "the same parameters in another order" : "another model") + std::string(": parameter ") +
                       std::to_string(i) + " is '" + a.name + "' in the checkpoint, '" + b.name + "' in this model" +
                       (saved == here ? " (the optimizer keeps the order it was given, param groups included)" : ""));
    }
    if (a.shape != b.shape)
      CKPT_FAIL(src, "another model: parameter '" + a.name + "' has shape " + shape_text(a.shape) + " in the checkpoint, " +
                       shape_text(b.shape) + " in this model");
  }
  if (m.params.size() != lay.params.size())
    CKPT_FAIL(src, "another model: the checkpoint has " + std::to_string(m.params.size()) + " parameters, this model " +
                     std::to_string(lay.params.size()) + " ('" +
                     (m.params.size() > n ? m.params[n].name : lay.params[n].name) + "' is only in the " +
                     (m.params.size() > n ? "checkpoint" : "model") + ")");
  if (m.algo != cfg.algo)
    CKPT_FAIL(src, std::string("different optimizer: the checkpoint holds ") + optim::algo_name(m.algo) + " states, this optimizer is " +
                     optim::algo_name(cfg.algo));
  if (m.state_bits != cfg.bits)
    CKPT_FAIL(src, "different optimizer: the checkpoint holds " + std::to_string(m.state_bits) + "-bit states, this optimizer " +
                     std::to_string(cfg.bits) + "-bit ones");
  if (m.state_bits == 8 && m.state_block != lay.cfg.state_block)
    CKPT_FAIL(src, "different state block size: " + std::to_string(m.state_block) + " in the checkpoint, " +
                     std::to_string(lay.cfg.state_block) + " in this optimizer (8-bit blocks cannot be re-cut)");
  for (size_t i = 0; i < n; ++i)
    if (m.params[i].hyper_group != lay.params[i].hyper_group)
      CKPT_FAIL(src, "parameter '" + m.params[i].name + "' is in param group " + std::to_string(m.params[i].hyper_group) +
                       " in the checkpoint, param group " + std::to_string(lay.params[i].hyper_group) +
                       " here (the optimizer states are laid out by param group; load with the same groups, or "
                       "without the optimizer states)");
  for (size_t i = 0; i < n; ++i)
    if (m.params[i].group != shard::group_name(lay.slots[i].group))
      CKPT_FAIL(src, "parameter '" + m.params[i].name + "' has " + m.params[i].group + " states in the checkpoint, " +
                       shard::group_name(lay.slots[i].group) + " states here (min_8bit_size " + std::to_string(m.min_8bit_size) +
                       " vs " + std::to_string(lay.cfg.min_8bit_size) + ", fp32_state " + (m.params[i].fp32_state ? "true" : "false") +
                       " vs " + (lay.params[i].fp32_state ? "true" : "false") + ")");
  if (cfg.bits == 8) {
    optim::State* st = opt.state(Group::q8);
    if (int(m.maps.size()) != m.num_states)
      CKPT_FAIL(src, std::to_string(m.maps.size()) + " quantization maps listed for " + std::to_string(m.num_states) + " states");
    for (const MapInfo& mi : m.maps) {
      if (mi.state < 1 || mi.state > m.num_states) CKPT_FAIL(src, "map of state " + std::to_string(mi.state) + " out of range");
      const quant::QuantTable* t = st->map(mi.state);
      const std::string kind = map_kind_of(t);
      const uint64_t h = map_hash(*t);
      if (kind != mi.kind || h != mi.xxh3)
        CKPT_FAIL(src, "state " + std::to_string(mi.state) + " quantization map: '" + mi.kind + "' (xxh3 " + hex64(mi.xxh3) +
                         ") in the checkpoint, '" + kind + "' (xxh3 " + hex64(h) + ") here");
    }
  }
}

// This rank's partitions read from the old shards, held until everything has been read and checked.
struct Staged {
  std::vector<float> master[kNumGroups];
  std::vector<uint8_t> codes[kNumGroups][2];
  std::vector<float> absmax[kNumGroups][2];
  std::vector<float> fp32[kNumGroups][2];
  std::vector<float> residual[kNumGroups];
  bool residual_restore = false;
  std::vector<uint8_t> working[kNumGroups];  // rank 0 only, when the working dtype matches
  bool working_restore = false;
  bool scaler_restore = false;
};

void stage_read(ShardedOptimizer& opt, FileSet& files, Staged& s) {
  const int r = opt.rank();
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = opt.layout().groups[g];
    const int64_t b = gl.part_begin(r), valid = gl.part_valid(r);
    s.master[g].resize(size_t(valid));
    files.read_range(g, "master", b, b + valid, s.master[g].data());
    const optim::StateLayout& sl = opt.state(Group(g))->layout();
    ZERO8_ASSERT(sl.n == valid);
    for (int k = 1; k <= sl.num_states; ++k) {
      const std::string n = std::to_string(k);
      if (sl.bits == 8) {
        s.codes[g][k - 1].resize(size_t(valid));
        files.read_range(g, "codes" + n, b, b + valid, s.codes[g][k - 1].data());
        s.absmax[g][k - 1].resize(size_t(sl.num_blocks()));
        files.read_range(g, "absmax" + n, b / sl.block, b / sl.block + sl.num_blocks(), s.absmax[g][k - 1].data());
      } else {
        s.fp32[g][k - 1].resize(size_t(valid));
        files.read_range(g, "state" + n, b, b + valid, s.fp32[g][k - 1].data());
      }
    }
    if (s.residual_restore && gl.padded() > 0) {
      s.residual[g].resize(size_t(gl.padded()));
      files.read_local(g, "residual", r, s.residual[g].data(), gl.padded() * 4);
    }
  }
}

void model_stage(const Manifest& m, ShardedOptimizer& opt, FileSet& files, Staged& s) {
  const FileReader& f = files.get(kModelName);
  const Safetensors st = safetensors_parse(f);
  model_check(st, m, f.path());
  if (!s.working_restore) return;
  const shard::Layout& lay = opt.layout();
  const int es = dtype_size(m.working_dtype);
  for (int g = 0; g < kNumGroups; ++g) s.working[g].assign(size_t(lay.groups[g].padded() * es), 0);
  for (size_t i = 0; i < lay.params.size(); ++i) {
    const shard::ParamSlot& slot = lay.slots[i];
    const SafetensorsEntry& e = st.tensors.at(lay.params[i].name);
    f.read_at(st.data_start + e.begin, s.working[int(slot.group)].data() + slot.offset * es, slot.numel * es);
  }
}

void commit(const Manifest& m, ShardedOptimizer& opt, Staged& s) {
  opt.discard_gradients();  // of the weights being replaced; the saved residuals are restored below
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = opt.layout().groups[g];
    float* master = opt.master(Group(g));
    std::fill(master, master + gl.chunk, 0.0f);
    std::copy(s.master[g].begin(), s.master[g].end(), master);
    optim::State* st = opt.state(Group(g));
    for (int k = 1; k <= st->layout().num_states; ++k) {
      if (st->layout().bits == 8) {
        std::copy(s.codes[g][k - 1].begin(), s.codes[g][k - 1].end(), st->codes(k));
        std::copy(s.absmax[g][k - 1].begin(), s.absmax[g][k - 1].end(), st->absmax(k));
      } else {
        std::copy(s.fp32[g][k - 1].begin(), s.fp32[g][k - 1].end(), st->fp32(k));
      }
    }
    std::vector<float>& res = opt.residual(Group(g));
    if (s.residual_restore && !s.residual[g].empty()) res = s.residual[g];
    else std::fill(res.begin(), res.end(), 0.0f);
  }
  opt.set_steps(m.step);
  if (s.scaler_restore) opt.scaler().set_state(m.loss_scaler);
  if (s.working_restore) {
    const int es = dtype_size(opt.config().working_dtype);
    for (int g = 0; g < kNumGroups; ++g) {
      const int64_t bytes = opt.layout().groups[g].padded() * es;
      if (bytes == 0) continue;
      if (opt.rank() == 0) std::memcpy(opt.working(Group(g)), s.working[g].data(), size_t(bytes));
      opt.comm().broadcast(opt.working(Group(g)), bytes, 0);
    }
    opt.mark_initialized();
  } else {
    opt.sync_working_from_master();
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// save
// ---------------------------------------------------------------------------------------------

SaveResult save(ShardedOptimizer& opt, const std::string& dir, const SaveOptions& opts) {
  comm::Communicator& c = opt.comm();
  const int r = c.rank();
  // Its masters would be zeros beside the model's real weights, and a load of them would zero the model.
  if (!opt.initialized())
    throw Error(ErrorCode::invalid_argument, "checkpoint save (rank " + std::to_string(r) +
                                                 "): the optimizer was never initialized (init() or a load): "
                                                 "its fp32 masters are not the model's weights");
  const Env env = env_read();
  const std::string tag = opts.tag.empty() ? "global_step" + std::to_string(opt.steps()) : opts.tag;
  std::string why;
  ZERO8_CHECK_ARG(tag_check(tag, &why), "tag", "'" << tag << "' " << why);
  ZERO8_CHECK_ARG(!dir.empty(), "dir", "is empty");
  ZERO8_CHECK_ARG(opts.keep_last >= 0, "keep_last", "must be >= 0, got " << opts.keep_last);
  for (size_t i = 0; i < opts.extra_files.size(); ++i) {
    const std::string& name = opts.extra_files[i].first;
    ZERO8_CHECK_ARG(extra_name_ok(name), "extra_files",
                    "'" << name << "' is not a plain file name of its own (no '/', no leading '.', not the "
                        "manifest, model or shard names)");
    for (size_t k = 0; k < i; ++k)
      ZERO8_CHECK_ARG(opts.extra_files[k].first != name, "extra_files", "'" << name << "' is given twice");
    ZERO8_CHECK_ARG(name != kModelRestName, "extra_files", "'" << name << "' is reserved for module_tensors");
    const ByteSpan& b = opts.extra_files[i].second;
    ZERO8_CHECK_ARG(b.size >= 0 && (b.data != nullptr || b.size == 0), "extra_files",
                    "'" << name << "': " << b.size << " bytes at " << b.data);
  }
  const TimeoutRaise patient(c, env.io_timeout);

  // 1. Rank 0 prepares the temporary directory; its nonce names it for everyone.
  uint64_t nonce = 0;
  std::string client_state, config_json;
  std::vector<StateDictEntry> state_dict;
  Failure f = attempt([&] {
    if (r != 0) return;
    client_state = json_option(opts.client_state, "client_state");
    state_dict = state_dict_of(opt, opts);
    config_json = json_option(opts.config_json, "config_json");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) CKPT_FAIL(dir, "cannot create the checkpoint directory: " + ec.message());
    leftovers_remove(dir);
    nonce = nonce_make();
    const std::string tmp = join(dir, kTmpPrefix + tag + "-" + hex64(nonce));
    if (::mkdir(tmp.c_str(), 0755) != 0) CKPT_FAIL(tmp, "cannot create: " + errno_text(errno));
    crash_at(env, "begin", r);
  });
  agree(c, f);
  c.broadcast(&nonce, sizeof(nonce), 0);
  const std::string tmp = join(dir, kTmpPrefix + tag + "-" + hex64(nonce));
  auto tmp_remove = [&] {
    if (r != 0) return;
    std::error_code ec;
    fs::remove_all(tmp, ec);
  };

  // 2. Every rank writes and syncs its shard; rank 0 also the model file.
  std::string entries;
  f = attempt([&] {
    json arr = json::array();
    arr.push_back(file_to_json(shard_write(opt, tmp, nonce, env)));
    if (r == 0) {
      arr.push_back(file_to_json(model_write(opt, tmp, tag)));
      if (!opts.module_tensors.empty()) arr.push_back(file_to_json(model_rest_write(opts.module_tensors, tmp, tag, opt.steps())));
      for (const auto& [name, bytes] : opts.extra_files) {
        FileInfo fi;
        fi.name = name;
        fi.role = "extra";
        FileWriter w(join(tmp, name), true);
        w.write(bytes.data, bytes.size);
        w.finish();
        fi.bytes = w.offset();
        fi.xxh3 = w.digest();
        arr.push_back(file_to_json(fi));
      }
    }
    entries = arr.dump();
    crash_at(env, "after_shard", r);
  });
  try {
    agree(c, f);
  } catch (...) {
    tmp_remove();
    throw;
  }
  const std::vector<std::string> all = all_gather_strings(c, entries);

  // 3. Rank 0: manifest, rename into place, latest, cleanup.
  std::string outcome;
  bool installed = false;
  f = attempt([&] {
    if (r != 0) return;
    Manifest m = manifest_of(opt);
    m.tag = tag;
    m.nonce = nonce;
    m.saved_unix_s = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    m.config_json = config_json;
    m.client_state = client_state;
    m.state_dict = state_dict;
    FileInfo model;
    const std::string src = join(tmp, kManifestName);
    for (const std::string& e : all)
      for (const json& j : json::parse(e)) {
        FileInfo fi = file_from_json(j, Fields{src}, "files");
        if (fi.role == "model") model = fi;
        else m.files.push_back(fi);
      }
    m.files.push_back(model);
    crash_at(env, "before_manifest", r);
    const std::string text = manifest_to_json(m).dump(1) + "\n";
    manifest_parse(text, src);  // what load will check, checked before anything is renamed
    FileWriter w(src, true);
    const int64_t half = int64_t(text.size()) / 2;
    w.write(text.data(), half);
    crash_at(env, "mid_manifest", r);
    w.write(text.data() + half, int64_t(text.size()) - half);
    w.finish();
    fsync_dir(tmp);
    crash_at(env, "before_rename", r);
    const std::string old = tag_install(dir, tag, tmp, nonce, env);
    installed = true;
    fsync_dir(dir);
    crash_at(env, "before_latest", r);
    if (opts.update_latest) latest_write(dir, tag, env);
    crash_at(env, "before_cleanup", r);
    if (!old.empty()) remove_tree(old);
    leftovers_remove(dir);
    std::string latest = tag;
    if (!opts.update_latest) {
      try {
        latest = latest_read(dir);
      } catch (const Error&) {
        latest.clear();  // none (or unreadable): only the new tag is protected
      }
    }
    const std::vector<std::string> removed = keep_last_prune(dir, opts.keep_last, tag, latest);
    int64_t bytes = int64_t(text.size());
    for (const FileInfo& fi : m.files) bytes += fi.bytes;
    outcome = json{{"bytes", bytes}, {"removed", removed}}.dump();
  });
  if (f.failed && !installed) tmp_remove();
  agree(c, f);
  const json o = json::parse(broadcast_string(c, outcome, 0));
  SaveResult res;
  res.tag = tag;
  res.path = join(dir, tag);
  res.bytes = o.at("bytes").get<int64_t>();
  res.removed = o.at("removed").get<std::vector<std::string>>();
  return res;
}

// ---------------------------------------------------------------------------------------------
// load
// ---------------------------------------------------------------------------------------------

LoadResult load(ShardedOptimizer& opt, const std::string& dir, const LoadOptions& opts) {
  comm::Communicator& c = opt.comm();
  const int r = c.rank();
  const TimeoutRaise patient(c, env_read().io_timeout);

  // 1. Rank 0 resolves the tag and reads the manifest; every rank works from that same text.
  std::string tag, path, text;
  Failure f = attempt([&] {
    if (r != 0) return;
    if (opts.tag.empty()) {
      tag = latest_read(dir);
    } else {
      std::string why;
      ZERO8_CHECK_ARG(tag_check(opts.tag, &why), "tag", "'" << opts.tag << "' " << why);
      tag = opts.tag;
    }
    path = tag_path(dir, tag);
    text = file_read_text(join(path, kManifestName));
  });
  agree(c, f);
  tag = broadcast_string(c, tag, 0);
  path = broadcast_string(c, path, 0);
  text = broadcast_string(c, text, 0);

  // 2. Validate and read everything into staging buffers.
  LoadResult res;
  res.tag = tag;
  res.path = path;
  Manifest m;
  Staged s;
  f = attempt([&] {
    const std::string src = join(path, kManifestName);
    m = manifest_parse(text, src);
    if (m.tag != tag)  // a renamed tag directory: harmless, the nonce ties its files together
      res.warnings.push_back("the manifest was saved as tag '" + m.tag + "', it is now in '" + path + "'");
    compat_check(m, opt, src);
    const shard::ShardConfig& cfg = opt.config();
    const bool has_residual = !opt.residual(Group::q8).empty() || !opt.residual(Group::fp32).empty();
    // A residual is one rank's share of the gradient in flat coordinates: it carries over only to
    // the same rank of the same layout.
    bool same_layout = m.world == opt.world() && m.wire_block == opt.layout().cfg.wire_block;
    for (int g = 0; g < kNumGroups; ++g) same_layout = same_layout && m.groups[g].padded == opt.layout().groups[g].padded();
    s.residual_restore = has_residual && m.error_feedback && same_layout;
    if (has_residual && !m.error_feedback)
      res.warnings.push_back("the checkpoint holds no error-feedback residuals: they start from zero");
    else if (has_residual && !same_layout)
      res.warnings.push_back("error-feedback residuals dropped: saved with " + std::to_string(m.world) + " ranks and wire block " +
                             std::to_string(m.wire_block) + ", loaded with " + std::to_string(opt.world()) + " and " +
                             std::to_string(opt.layout().cfg.wire_block) + "; they start from zero");
    else if (!has_residual && m.error_feedback)
      res.warnings.push_back("the checkpoint's error-feedback residuals are not used: error feedback is off");
    s.working_restore = m.working_dtype == cfg.working_dtype;
    if (!s.working_restore)
      res.warnings.push_back(std::string("the checkpoint's working copy is ") + dtype_name(m.working_dtype) + ", this optimizer's " +
                             dtype_name(cfg.working_dtype) + ": the working copy is recomputed from the fp32 masters");
    // Without fp16 the scaler is static (scale 1) but still counts iterations: restored too.
    s.scaler_restore = m.fp16 == cfg.fp16;
    if (m.fp16 != cfg.fp16)
      res.warnings.push_back(std::string("loss scaler state not restored: the checkpoint was saved ") + (m.fp16 ? "with" : "without") +
                             " fp16 loss scaling, this optimizer runs " + (cfg.fp16 ? "with" : "without"));
    FileSet files(path, m, opts.verify);
    stage_read(opt, files, s);
    if (r == 0) model_stage(m, opt, files, s);
    extras_check(files, m, r == 0);
    res.bytes_hashed = files.hashed();
    res.step = m.step;
    res.saved_world = m.world;
    res.client_state = m.client_state;
    res.config_json = m.config_json;
    if (opts.before_commit) opts.before_commit(res);
  });
  agree(c, f);

  // 3. Nothing failed anywhere: install.
  commit(m, opt, s);
  return res;
}

// ---------------------------------------------------------------------------------------------
// reading
// ---------------------------------------------------------------------------------------------

Manifest manifest_parse(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    CKPT_FAIL(src, std::string("not valid JSON (truncated or corrupt?): ") + e.what());
  }
  const Fields F{src};
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormatName)
    CKPT_FAIL(src, std::string("not a zero8 checkpoint manifest (no \"format\": \"") + kFormatName + "\")");
  // Manifests written before the checksum existed have none: they are read as before.
  if (j.contains(kManifestHashKey)) {
    const uint64_t saved = F.hash(j, kManifestHashKey), now = manifest_hash(j);
    if (saved != now)
      CKPT_FAIL(src, "checksum mismatch: xxh3 " + hex64(now) + " of its fields, '" + kManifestHashKey + "' says " + hex64(saved) +
                       " (the manifest is corrupt or was edited; an edited manifest loads once its '" + kManifestHashKey +
                       "' field is removed)");
  }
  Manifest m;
  m.format_version = int(F.i64(j, "format_version"));
  if (m.format_version != kFormatVersion)
    CKPT_FAIL(src, "unknown format version " + std::to_string(m.format_version) + " (this zero8 reads version " +
                     std::to_string(kFormatVersion) + ")");
  m.zero8_version = F.str(j, "zero8_version");
  m.tag = F.str(j, "tag");
  m.nonce = F.hash(j, "nonce");
  m.saved_unix_s = F.num(j, "saved_unix_s");
  m.step = F.i64(j, "step");
  m.world = int(F.i64(j, "world_size"));
  if (m.world < 1) CKPT_FAIL(src, "world_size " + std::to_string(m.world));
  const json& o = F.at(j, "optimizer", "");
  if (!algo_parse(F.str(o, "algo", "optimizer"), &m.algo)) CKPT_FAIL(src, "unknown optimizer '" + F.str(o, "algo", "optimizer") + "'");
  m.state_bits = int(F.i64(o, "state_bits", "optimizer"));
  if (m.state_bits != 8 && m.state_bits != 32) CKPT_FAIL(src, "optimizer.state_bits " + std::to_string(m.state_bits));
  m.num_states = int(F.i64(o, "num_states", "optimizer"));
  if (m.num_states != optim::algo_num_states(m.algo))
    CKPT_FAIL(src, "optimizer.num_states " + std::to_string(m.num_states) + " for " + optim::algo_name(m.algo));
  m.initial_accumulator = float(F.num(o, "initial_accumulator", "optimizer"));
  const json& h = F.at(o, "hyper", "optimizer");
  const std::string hw = "optimizer.hyper";
  m.hyper.lr = float(F.num(h, "lr", hw));
  m.hyper.beta1 = float(F.num(h, "beta1", hw));
  m.hyper.beta2 = float(F.num(h, "beta2", hw));
  m.hyper.eps = float(F.num(h, "eps", hw));
  m.hyper.weight_decay = float(F.num(h, "weight_decay", hw));
  m.hyper.dampening = float(F.num(h, "dampening", hw));
  m.hyper.nesterov = F.boolean(h, "nesterov", hw);
  m.hyper.bias_correction = F.boolean(h, "bias_correction", hw);
  m.hyper.lr_decay = float(F.num(h, "lr_decay", hw));
  m.hyper.initial_accumulator = float(F.num(h, "initial_accumulator", hw));
  m.hyper.trust_coefficient = float(F.num(h, "trust_coefficient", hw));
  m.hyper.max_trust_ratio = float(F.num(h, "max_trust_ratio", hw));
  // Absent from checkpoints written before the field existed: those steps clipped from above only.
  m.hyper.min_trust_ratio = h.contains("min_trust_ratio") ? float(F.num(h, "min_trust_ratio", hw)) : 0.0f;
  const json& b = F.at(j, "blocks", "");
  m.state_block = int32_t(F.i64(b, "state_block", "blocks"));
  m.wire_block = int32_t(F.i64(b, "wire_block", "blocks"));
  m.min_8bit_size = F.i64(b, "min_8bit_size", "blocks");
  const json& maps = F.arr(j, "maps");
  for (size_t i = 0; i < maps.size(); ++i) {
    const std::string w = "maps[" + std::to_string(i) + "]";
    m.maps.push_back(MapInfo{int(F.i64(maps[i], "state", w)), F.str(maps[i], "kind", w), F.hash(maps[i], "xxh3_64", w)});
  }
  if (!dtype_parse(F.str(j, "working_dtype"), &m.working_dtype)) CKPT_FAIL(src, "unknown working_dtype '" + F.str(j, "working_dtype") + "'");
  m.error_feedback = F.boolean(j, "error_feedback");
  const json& ls = F.at(j, "loss_scaler", "");
  m.fp16 = F.boolean(ls, "fp16", "loss_scaler");
  m.loss_scaler.scale = F.num(ls, "scale", "loss_scaler");
  m.loss_scaler.cur_iter = F.i64(ls, "cur_iter", "loss_scaler");
  m.loss_scaler.last_overflow_iter = F.i64(ls, "last_overflow_iter", "loss_scaler");
  m.loss_scaler.cur_hysteresis = int(F.i64(ls, "cur_hysteresis", "loss_scaler"));
  const json& groups = F.arr(j, "groups");
  if (groups.size() != size_t(kNumGroups)) CKPT_FAIL(src, std::to_string(groups.size()) + " groups, expected 2");
  for (int g = 0; g < kNumGroups; ++g) {
    const std::string w = "groups[" + std::to_string(g) + "]";
    GroupInfo& gi = m.groups[g];
    gi.name = F.str(groups[g], "name", w);
    if (gi.name != shard::group_name(Group(g))) CKPT_FAIL(src, w + " is '" + gi.name + "', expected '" + shard::group_name(Group(g)) + "'");
    gi.numel = F.i64(groups[g], "numel", w);
    gi.align = F.i64(groups[g], "align", w);
    gi.chunk = F.i64(groups[g], "chunk", w);
    gi.padded = F.i64(groups[g], "padded", w);
    gi.state_bits = int(F.i64(groups[g], "state_bits", w));
    gi.num_blocks = F.i64(groups[g], "num_blocks", w);
  }
  const json& params = F.arr(j, "params");
  std::vector<shard::ParamSpec> specs;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string w = "params[" + std::to_string(i) + "]";
    ParamInfo p;
    p.name = F.str(params[i], "name", w);
    for (const json& d : F.arr(params[i], "shape", w)) {
      if (!d.is_number_integer()) CKPT_FAIL(src, w + ".shape holds a non-integer");
      p.shape.push_back(d.get<int64_t>());
    }
    p.group = F.str(params[i], "group", w);
    p.offset = F.i64(params[i], "offset", w);
    p.numel = F.i64(params[i], "numel", w);
    p.fp32_state = F.boolean(params[i], "fp32_state", w);
    p.hyper_group = params[i].contains("hyper_group") ? int(F.i64(params[i], "hyper_group", w)) : 0;
    specs.push_back(shard::ParamSpec{p.name, p.shape, p.fp32_state, p.hyper_group});
    m.params.push_back(std::move(p));
  }
  // The layout is a pure function of the parameters and the block sizes: recompute it and hold the
  // manifest to it.
  shard::Layout lay;
  try {
    shard::LayoutConfig lc;
    lc.world = m.world;
    lc.state_block = m.state_block;
    lc.wire_block = m.wire_block;
    lc.min_8bit_size = m.min_8bit_size;
    lay = shard::Layout::build(specs, lc);
  } catch (const Error& e) {
    CKPT_FAIL(src, "the parameters and block sizes do not form a layout: " + strip_where(e.what()));
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ParamInfo& p = m.params[i];
    const shard::ParamSlot& s = lay.slots[i];
    if (p.group != shard::group_name(s.group) || p.offset != s.offset || p.numel != s.numel)
      CKPT_FAIL(src, "parameter '" + p.name + "': group/offset/numel " + p.group + "/" + std::to_string(p.offset) + "/" +
                       std::to_string(p.numel) + " disagree with the layout (" + shard::group_name(s.group) + "/" +
                       std::to_string(s.offset) + "/" + std::to_string(s.numel) + ")");
  }
  for (int g = 0; g < kNumGroups; ++g) {
    const shard::GroupLayout& gl = lay.groups[g];
    const GroupInfo& gi = m.groups[g];
    const int bits = g == int(Group::q8) ? m.state_bits : 32;
    const int64_t nb = bits == 8 ? (gl.numel + m.state_block - 1) / m.state_block : 0;
    if (gi.numel != gl.numel || gi.align != gl.align || gi.chunk != gl.chunk || gi.padded != gl.padded() ||
        gi.state_bits != bits || gi.num_blocks != nb)
      CKPT_FAIL(src, "group " + gi.name + " disagrees with the layout of its parameters");
  }
  if (m.state_bits == 8 && int(m.maps.size()) != m.num_states)
    CKPT_FAIL(src, std::to_string(m.maps.size()) + " maps for " + std::to_string(m.num_states) + " 8-bit states");
  const json& files = F.arr(j, "files");
  for (size_t i = 0; i < files.size(); ++i) m.files.push_back(file_from_json(files[i], F, "files[" + std::to_string(i) + "]"));
  manifest_check_sections(m, src);
  if (j.contains("state_dict")) state_dict_parse(m, F.arr(j, "state_dict"), F);
  m.config_json = F.at(j, "config", "").dump();
  m.client_state = F.at(j, "client_state", "").dump();
  return m;
}

Manifest manifest_read(const std::string& tag_dir) {
  const std::string src = join(tag_dir, kManifestName);
  return manifest_parse(file_read_text(src), src);
}

Manifest manifest_read_extras_checked(const std::string& tag_dir, bool model_rest) {
  Manifest m = manifest_read(tag_dir);
  FileSet files(tag_dir, m, true);
  extras_check(files, m, model_rest);
  return m;
}

std::string latest_read(const std::string& dir) {
  const std::string path = join(dir, kLatestName);
  if (!exists(path)) {
    if (!exists(dir)) CKPT_FAIL(dir, "missing: no such checkpoint directory");
    CKPT_FAIL(path, "missing: no checkpoint was completed in " + dir + " (or it is not a zero8 checkpoint directory)");
  }
  std::string t = file_read_text(path, 4096);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  std::string why;
  if (!tag_check(t, &why)) CKPT_FAIL(path, "does not name a valid tag: '" + t + "' " + why);
  return t;
}

std::string tag_path(const std::string& dir, const std::string& tag) {
  // A tag is a name in dir: "../other/global_step3" would read another directory's checkpoint.
  std::string why;
  ZERO8_CHECK_ARG(tag_check(tag, &why), "tag", "'" << tag << "' " << why << " (a tag is the name of a directory in " << dir << ")");
  const std::string p = join(dir, tag);
  if (exists(join(p, kManifestName))) return p;
  // An interrupted two-rename replace: the old tag waits under its .replaced- name.
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kReplacedPrefix + tag + "-", 0) == 0 && replaced_tag(e.path().string()) == tag) return e.path().string();
  }
  if (!exists(p)) CKPT_FAIL(p, "missing: tag '" + tag + "' is not in " + dir);
  CKPT_FAIL(join(p, kManifestName), "missing: tag '" + tag + "' is not a complete checkpoint");
}

std::vector<std::string> tags_list(const std::string& dir) {
  std::vector<std::string> out;
  for (const TagEntry& t : tags_scan(dir)) out.push_back(t.name);
  return out;
}

Summary summarize(const Manifest& m, int64_t manifest_bytes) {
  Summary s;
  for (const FileInfo& f : m.files) {
    s.total += f.bytes;
    if (f.role == "model") s.model += f.bytes;
    for (const SectionInfo& x : f.sections) {
      if (x.kind == "master") s.master += x.bytes;
      else if (x.kind.rfind("codes", 0) == 0) s.codes += x.bytes;
      else if (x.kind.rfind("absmax", 0) == 0) s.absmax += x.bytes;
      else if (x.kind.rfind("state", 0) == 0) s.fp32 += x.bytes;
      else if (x.kind == "residual") s.residual += x.bytes;
    }
  }
  s.total += manifest_bytes;
  s.other = s.total - (s.master + s.codes + s.absmax + s.fp32 + s.residual + s.model);
  for (const ParamInfo& p : m.params) s.numel += p.numel;
  return s;
}

VerifyResult verify(const std::string& tag_dir) {
  VerifyResult v;
  Manifest m;
  try {
    m = manifest_read(tag_dir);
  } catch (const Error& e) {
    v.problems.push_back(strip_where(e.what()));
    return v;
  }
  FileSet files(tag_dir, m, true);
  for (const FileInfo& fi : m.files) {
    ++v.files;
    try {
      const FileReader& f = files.get(fi.name);
      if (fi.role == "model") model_check(safetensors_parse(f), m, f.path());
      if (fi.name == kModelRestName && !m.state_dict.empty()) model_rest_check(safetensors_parse(f), m, f.path());
    } catch (const Error& e) {
      v.problems.push_back(strip_where(e.what()));
    }
  }
  v.bytes = files.hashed();
  return v;
}

namespace {

// Where export_fp32 writes out_path, checked before anything is read: out_path, or the file a symbolic
// link there leads to (written through: the link stays a link). Refused, naming out_path: an empty path,
// a missing parent directory, an existing directory, device, fifo or socket, any path inside a tag
// directory of the checkpoint directory (any tag's, not only the one read), and an existing file of the
// checkpoint directory (a file of a tag, found by inode so that hard links and links count, or its
// latest): the rename would put the export in its place.
struct ExportTarget {
  std::string path;   // the file to replace or create
  std::string shown;  // out_path in errors (and where it leads, for a link)
  int mode = -1;      // the permission bits of the file replaced (-1: a new file)
};

ExportTarget export_target(const std::string& tag_dir, const std::string& out_path) {
  ZERO8_CHECK_ARG(!out_path.empty(), "out_path", "is empty (the safetensors file to write)");
  ExportTarget t{out_path, out_path};
  struct stat st;
  bool found = false;
  for (int hops = 0;; ++hops) {
    if (::lstat(t.path.c_str(), &st) != 0) {
      if (errno != ENOENT) CKPT_FAIL(t.shown, "cannot write it: " + errno_text(errno));
      break;
    }
    if (!S_ISLNK(st.st_mode)) {
      found = true;
      break;
    }
    if (hops == 40) CKPT_FAIL(out_path, "too many levels of symbolic links");
    std::error_code ec;
    const fs::path to = fs::read_symlink(t.path, ec);
    if (ec) CKPT_FAIL(out_path, "cannot read the symbolic link " + t.path + ": " + ec.message());
    t.path = (to.is_absolute() ? to : fs::path(t.path).parent_path() / to).string();
    t.shown = out_path + " (a symbolic link to " + t.path + ")";
  }
  const fs::path parent = fs::path(t.path).has_parent_path() ? fs::path(t.path).parent_path() : fs::path(".");
  struct stat pst;
  if (::stat(parent.c_str(), &pst) != 0)
    CKPT_FAIL(t.shown, errno == ENOENT ? "the directory " + parent.string() + " does not exist"
                                       : "cannot write into " + parent.string() + ": " + errno_text(errno));
  if (!S_ISDIR(pst.st_mode)) CKPT_FAIL(t.shown, parent.string() + " is not a directory");
  // Nothing goes into a tag directory of the checkpoint directory (the tag read, another tag, a copy held
  // aside by a replace, a save in progress): a new file there is in no manifest, an existing one is data.
  const std::string root = fs::path(join(tag_dir, "..")).lexically_normal().string();
  std::vector<std::string> own = {join(root, kLatestName), join(root, kLatestTmpName)};
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root, ec)) {
    std::error_code dec;
    const bool staging = d.path().filename().string().rfind(kTmpPrefix, 0) == 0;
    if (!d.is_directory(dec) || !(staging || fs::exists(d.path() / kManifestName, dec))) continue;
    struct stat dst;
    if (::stat(d.path().c_str(), &dst) == 0 && dst.st_dev == pst.st_dev && dst.st_ino == pst.st_ino)
      CKPT_FAIL(t.shown, "is inside " + d.path().string() +
                             ", a tag directory of the checkpoint being exported: write the export elsewhere");
    for (const fs::directory_entry& e : fs::directory_iterator(d.path(), dec)) own.push_back(e.path().string());
  }
  if (!found) return t;
  if (S_ISDIR(st.st_mode)) CKPT_FAIL(t.shown, "is a directory (the output is one safetensors file: give its path)");
  if (!S_ISREG(st.st_mode)) CKPT_FAIL(t.shown, "is not a regular file (a device, fifo or socket): it is not replaced");
  for (const std::string& f : own) {
    struct stat fst;
    if (::stat(f.c_str(), &fst) == 0 && fst.st_dev == st.st_dev && fst.st_ino == st.st_ino)
      CKPT_FAIL(t.shown, "is a file of the checkpoint being exported (" + f + "): it is not replaced");
  }
  t.mode = int(st.st_mode & 07777);
  return t;
}

}  // namespace

ExportResult export_fp32(const std::string& tag_dir, const std::string& out_path, bool verify_files) {
  const ExportTarget target = export_target(tag_dir, out_path);
  const Manifest m = manifest_read(tag_dir);
  const std::string src = join(tag_dir, kManifestName);
  if (verify_files) {
    // Every file of the tag, as `zero8-checkpoint verify` checks it, not only those the export reads: a
    // corrupt model file or model-states file means a damaged checkpoint, which an export must not hide.
    const VerifyResult v = verify(tag_dir);
    if (!v.ok()) {
      std::string all = v.problems[0];
      for (size_t i = 1; i < v.problems.size(); ++i) all += "; " + v.problems[i];
      ZERO8_THROW(io, all);
    }
  }
  FileSet files(tag_dir, m, /*verify=*/false);  // verify() hashed every file; sizes and headers are checked again
  std::map<std::string, const ParamInfo*> params;
  for (const ParamInfo& p : m.params) params.emplace(p.name, &p);
  // What to write, in order: the state_dict's keys, then any trained parameter it does not name (all of
  // them for a manifest without a state_dict).
  struct Out {
    std::string name;
    const ParamInfo* param = nullptr;          // from the masters
    const StateDictEntry* rest = nullptr;      // from the model_rest file
    std::string dtype = "F32";                 // as written
    int64_t bytes = 0;                         // as written
  };
  std::vector<Out> outs;
  std::set<std::string> named;
  for (const StateDictEntry& e : m.state_dict) {
    if (e.source == "param") {
      outs.push_back(Out{e.name, params.at(e.tensor), nullptr});
      named.insert(e.tensor);
    } else {
      outs.push_back(Out{e.name, nullptr, &e});
    }
  }
  std::set<std::string> keys;
  for (const Out& o : outs) keys.insert(o.name);
  for (const ParamInfo& p : m.params) {
    if (named.count(p.name)) continue;
    if (!keys.insert(p.name).second) CKPT_FAIL(src, "parameter '" + p.name + "' is also the name of another state_dict entry");
    outs.push_back(Out{p.name, &p, nullptr});
  }
  Safetensors rest_st;
  const FileReader* rest_f = nullptr;
  if (std::any_of(outs.begin(), outs.end(), [](const Out& o) { return o.rest != nullptr; })) {
    rest_f = &files.get(kModelRestName);
    rest_st = safetensors_parse(*rest_f);
    model_rest_check(rest_st, m, rest_f->path());
  }

  ExportResult res;
  res.complete = !m.state_dict.empty();
  std::vector<SafetensorsTensor> head;
  for (Out& o : outs) {
    if (o.name == "__metadata__") CKPT_FAIL(src, "a parameter named '__metadata__' cannot be exported");
    if (o.param) {
      o.bytes = o.param->numel * 4;
    } else {
      // 16-bit floats are widened to F32 (exactly); every other dtype (F64, integers, BOOL) is kept.
      const SafetensorsEntry& e = rest_st.tensors.at(o.rest->tensor);
      if (e.dtype != "F16" && e.dtype != "BF16") o.dtype = e.dtype;
      o.bytes = (e.end - e.begin) / st_dtype_size(e.dtype) * st_dtype_size(o.dtype);
    }
    head.push_back({o.name, o.dtype, o.param ? o.param->shape : o.rest->shape, nullptr, o.bytes});
  }
  const std::string tmp = target.path + ".tmp-" + std::to_string(::getpid());
  try {
    FileWriter w(tmp, false, target.shown);
    if (target.mode >= 0) w.chmod(mode_t(target.mode));  // a replaced file keeps its permissions
    safetensors_header_write(w, json{{"format", "pt"}, {"zero8_tag", m.tag}, {"zero8_step", std::to_string(m.step)},
                                     {"zero8_source", res.complete ? "fp32 masters + model_rest" : "fp32 masters"}},
                             head);
    std::vector<float> buf;
    std::vector<char> raw;
    constexpr int64_t kChunk = int64_t(1) << 20;  // elements per read
    for (const Out& o : outs) {
      if (o.param) {
        const ParamInfo& p = *o.param;
        const int g = group_index(p.group);
        for (int64_t i = 0; i < p.numel; i += kChunk) {
          const int64_t n = std::min(kChunk, p.numel - i);
          buf.resize(size_t(n));
          files.read_range(g, "master", p.offset + i, p.offset + i + n, buf.data());
          w.write(buf.data(), n * 4);
        }
        ++res.trained;
        continue;
      }
      const SafetensorsEntry& e = rest_st.tensors.at(o.rest->tensor);
      const int es = st_dtype_size(e.dtype);
      const bool widen = o.dtype != e.dtype;
      const int64_t numel = (e.end - e.begin) / es;
      for (int64_t i = 0; i < numel; i += kChunk) {
        const int64_t n = std::min(kChunk, numel - i);
        raw.resize(size_t(n * es));
        rest_f->read_at(rest_st.data_start + e.begin + i * es, raw.data(), n * es);
        if (!widen) {
          w.write(raw.data(), n * es);
          continue;
        }
        buf.resize(size_t(n));
        const DType d = e.dtype == "F16" ? DType::f16 : DType::bf16;
        for (int64_t k = 0; k < n; ++k) buf[size_t(k)] = dtype_load(raw.data(), d, k);
        w.write(buf.data(), n * 4);
      }
      ++res.rest;
    }
    w.finish();
    if (::rename(tmp.c_str(), target.path.c_str()) != 0)
      CKPT_FAIL(target.shown, "cannot rename the written file into place: " + errno_text(errno));
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  const fs::path parent = fs::absolute(target.path).parent_path();
  fsync_dir(parent.string());
  res.tensors = int64_t(outs.size());
  return res;
}

}  // namespace zero8::ckpt
