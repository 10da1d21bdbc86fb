// DeepSpeed JSON config: parsing with key-path errors, DeepSpeed's defaults and resolution rules
// (deepspeed/runtime/config.py, zero/config.py, precision_config.py, engine.py's optimizer choice),
// the normalized dump for checkpoint manifests, and the LR schedules of deepspeed/runtime/lr_schedules.py.
#include "zero8/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "zero8/error.h"

namespace zero8::config {

namespace {

// ordered_json keeps the file's key order, so warnings come out in reading order and to_json in ours.
using json = nlohmann::ordered_json;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

const char* const kAutoHint =
    "\"auto\" is filled in by the Hugging Face Trainer's DeepSpeed integration before DeepSpeed reads the "
    "config; DeepSpeed itself does not resolve it here: give a value";

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string fmt_num(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// An admissible interval for a number, which also words itself for error messages. f32: the value goes
// to a float32 (every hyperparameter of the kernels, the learning rates of the schedules, loss scales), so
// it must be 0 or of a magnitude float32 holds, neither rounded to inf nor to 0.
struct Range {
  double lo = -kInf, hi = kInf;
  bool lo_open = false, hi_open = false;
  bool f32 = true;
  bool contains(double x) const {
    return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
  }
  std::string text() const {
    const bool has_lo = lo > -kInf, has_hi = hi < kInf;
    if (!has_lo && !has_hi) return "a number";
    if (!has_hi) return std::string("a number ") + (lo_open ? "> " : ">= ") + fmt_num(lo);
    if (!has_lo) return std::string("a number ") + (hi_open ? "< " : "<= ") + fmt_num(hi);
    return "a number in " + std::string(lo_open ? "(" : "[") + fmt_num(lo) + ", " + fmt_num(hi) + (hi_open ? ")" : "]");
  }
};
Range any_number() { return {}; }
Range ge(double lo) { return {lo, kInf, false, false}; }
Range gt(double lo) { return {lo, kInf, true, false}; }
Range in_co(double lo, double hi) { return {lo, hi, false, true}; }  // [lo, hi)
Range f64(Range r) {  // a value kept in double (a timeout), not limited to float32's range
  r.f32 = false;
  return r;
}

std::string int_range_text(int64_t lo, int64_t hi) {
  if (lo == kI64Min && hi == kI64Max) return "an integer";
  if (hi == kI64Max) return "an integer >= " + std::to_string(lo);
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

// How a section treats the string "auto". DeepSpeed's pydantic sections (fp16, bf16,
// zero_optimization and its offload blocks) drop "auto" values, so the default applies; everywhere
// else DeepSpeed would use the string itself and fail later, so it is an error here.
enum class Auto { reject, use_default };

struct Ctx {
  std::string source;
  std::vector<std::string>* warnings = nullptr;
  const json* root = nullptr;  // the whole config, to list every "auto" in one error
  // Settings zero8 does not support ("path: why"), reported together at the end of the parse: a ported
  // DeepSpeed config often has several (offload, a ZeRO++ key, a monitor...), and one error naming them
  // all saves a parse per setting. A value zero8 cannot read at all still fails at once.
  std::vector<std::string> unsupported;
  // The text of every floating-point number as the file writes it, by key path ("optimizer.params.lr" ->
  // "1e39"), so that messages quote a value as written rather than as a double (1e+39) or float32 (inf)
  // prints it.
  std::unordered_map<std::string, std::string> number_text;
};

std::string join_path(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

void collect_auto(const json& v, const std::string& path, std::vector<std::string>& out) {
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it) collect_auto(it.value(), join_path(path, it.key()), out);
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) collect_auto(v[i], path + "[" + std::to_string(i) + "]", out);
  } else if (v.is_string() && v.get<std::string>() == "auto" && path != "zero8.comm_backend") {
    out.push_back(path);
  }
}

// Every "auto" zero8 rejects, in file order: a Hugging Face config carries a dozen, and one error naming
// them all saves a parse per value. Left out: the sections where "auto" takes the default (fp16, bf16,
// zero_optimization) and those zero8 does not read.
std::vector<std::string> rejected_auto_paths(const json& root) {
  static const std::set<std::string> read_top = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
      "steps_per_print", "wall_clock_breakdown", "managed_gradient_accumulation", "prescale_gradients",
      "gradient_predivide_factor", "zero_allow_untested_optimizer", "communication_data_type", "allgather_size",
      "optimizer", "scheduler", "checkpoint", "zero8"};
  std::vector<std::string> out;
  if (!root.is_object()) return out;
  for (auto it = root.begin(); it != root.end(); ++it)
    if (read_top.count(it.key())) collect_auto(it.value(), it.key(), out);
  return out;
}

[[noreturn]] void fail_at(const Ctx& ctx, const std::string& path, const std::string& msg,
                          ErrorCode code = ErrorCode::invalid_argument) {
  throw Error(code, ctx.source + ": " + (path.empty() ? std::string() : path + ": ") + msg);
}

// A setting zero8 does not support: recorded, reported with the others by throw_unsupported.
void unsupported_at(Ctx& ctx, const std::string& path, const std::string& msg) {
  ctx.unsupported.push_back((path.empty() ? std::string() : path + ": ") + msg);
}

void throw_unsupported(const Ctx& ctx) {
  if (ctx.unsupported.empty()) return;
  if (ctx.unsupported.size() == 1) throw Error(ErrorCode::unsupported, ctx.source + ": " + ctx.unsupported[0]);
  std::string all = ctx.source + ": " + std::to_string(ctx.unsupported.size()) + " settings zero8 does not support:";
  for (size_t i = 0; i < ctx.unsupported.size(); ++i) all += "\n  (" + std::to_string(i + 1) + ") " + ctx.unsupported[i];
  throw Error(ErrorCode::unsupported, all);
}

void warn_at(const Ctx& ctx, const std::string& path, const std::string& msg) {
  ctx.warnings->push_back(ctx.source + ": " + (path.empty() ? std::string() : path + ": ") + msg);
}

// The value at `path` as the file writes it (a number's own text), shortened for messages.
std::string show(const Ctx& ctx, const std::string& path, const json& v) {
  std::string s;
  const auto it = v.is_number_float() ? ctx.number_text.find(path) : ctx.number_text.end();
  s = it != ctx.number_text.end() ? it->second : v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// A number read from `path` (or its default when the file has none), for messages: as written if written.
std::string num_text(const Ctx& ctx, const std::string& path, double x) {
  const auto it = ctx.number_text.find(path);
  return it != ctx.number_text.end() ? it->second : json(x).dump();
}

[[noreturn]] void fail_expected(const Ctx& ctx, const std::string& path, const std::string& what, const json& v) {
  fail_at(ctx, path, "expected " + what + ", got " + show(ctx, path, v));
}

double value_num(const Ctx& ctx, const std::string& path, const json& v, const Range& r) {
  if (!v.is_number()) fail_expected(ctx, path, r.text(), v);
  const double x = v.get<double>();
  if (!std::isfinite(x) || !r.contains(x)) fail_expected(ctx, path, r.text(), v);
  // FLT_TRUE_MIN: the smallest positive float32 (a subnormal); anything nonzero below it rounds to 0.
  if (r.f32 && x != 0.0 && (std::fabs(x) > double(FLT_MAX) || std::fabs(x) < double(FLT_TRUE_MIN)))
    fail_at(ctx, path, "expected " + r.text() + " that float32 can hold (zero8 computes with it in float32, where " +
                           show(ctx, path, v) + " would be " + (std::fabs(x) > 1.0 ? "inf" : "0") +
                           "; largest float32 3.4028235e38), got " + show(ctx, path, v));
  return x;
}

// Integers also accept integral floats (5e8 is how DeepSpeed configs write bucket sizes; pydantic
// accepts them too).
int64_t value_int(const Ctx& ctx, const std::string& path, const json& v, int64_t lo, int64_t hi) {
  bool ok = false;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= uint64_t(kI64Max);
    x = ok ? int64_t(u) : 0;
  } else if (v.is_number_integer()) {
    ok = true;
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    ok = std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.2e18;
    x = ok ? int64_t(d) : 0;
  }
  if (!ok || x < lo || x > hi) fail_expected(ctx, path, int_range_text(lo, hi), v);
  return x;
}

// Optimal string alignment distance, case-insensitive: the insertions, deletions, substitutions and
// swaps of two adjacent characters that turn a into b ("stgae" -> "stage": 1, "zer08" -> "zero8": 1).
size_t edit_distance(const std::string& a0, const std::string& b0) {
  const std::string a = lower(a0), b = lower(b0);
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// A view of one JSON object at a key path, which records the keys it read so that finish() can reject
// the rest (and suggest the key meant). A missing section (nullptr) reads as all defaults.
class Section {
 public:
  Section(Ctx& ctx, const json* obj, std::string path, Auto policy)
      : ctx_(ctx), obj_(obj), path_(std::move(path)), policy_(policy) {}

  bool present() const { return obj_ != nullptr; }
  const std::string& path() const { return path_; }
  std::string key_path(const std::string& key) const { return join_path(path_, key); }
  Ctx& ctx() const { return ctx_; }

  // The raw value (null included), marking the key as read; nullptr when absent.
  const json* raw(const std::string& key) {
    know(key);
    if (!obj_) return nullptr;
    auto it = obj_->find(key);
    if (it == obj_->end()) return nullptr;
    seen_.insert(key);
    return &*it;
  }
  bool has(const std::string& key) {
    know(key);
    return obj_ && obj_->find(key) != obj_->end();
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    if (obj_)
      for (auto it = obj_->begin(); it != obj_->end(); ++it) k.push_back(it.key());
    return k;
  }

  // The value to use, or nullptr for "take the default": absent, null, or "auto" where DeepSpeed drops it.
  const json* find(const std::string& key) {
    const json* v = raw(key);
    if (!v || v->is_null()) return nullptr;
    if (v->is_string() && v->get<std::string>() == "auto") {
      if (policy_ == Auto::reject) {
        std::string others;
        if (ctx_.root)
          for (const std::string& p : rejected_auto_paths(*ctx_.root))
            if (p != key_path(key)) others += (others.empty() ? "" : ", ") + p;
        fail_at(ctx_, key_path(key),
                std::string(kAutoHint) + (others.empty() ? "" : " (\"auto\" also at: " + others + ")"));
      }
      warn_at(ctx_, key_path(key),
              "\"auto\" is not resolved here: the default is used, as DeepSpeed does (the Hugging Face "
              "Trainer fills \"auto\" in before DeepSpeed reads the config)");
      return nullptr;
    }
    return v;
  }

  bool get_bool(const std::string& key, bool def) {
    const json* v = find(key);
    if (!v) return def;
    if (!v->is_boolean()) fail_expected(ctx_, key_path(key), "a boolean (true or false)", *v);
    return v->get<bool>();
  }
  double get_num(const std::string& key, double def, const Range& r) {
    const json* v = find(key);
    return v ? value_num(ctx_, key_path(key), *v, r) : def;
  }
  std::optional<double> get_num_opt(const std::string& key, const Range& r) {
    const json* v = find(key);
    if (!v) return std::nullopt;
    return value_num(ctx_, key_path(key), *v, r);
  }
  int64_t get_int(const std::string& key, int64_t def, int64_t lo, int64_t hi = kI64Max) {
    const json* v = find(key);
    return v ? value_int(ctx_, key_path(key), *v, lo, hi) : def;
  }
  std::optional<int64_t> get_int_opt(const std::string& key, int64_t lo, int64_t hi = kI64Max) {
    const json* v = find(key);
    if (!v) return std::nullopt;
    return value_int(ctx_, key_path(key), *v, lo, hi);
  }
  // auto_is_value: "auto" is one of the key's own values (zero8.comm_backend), not DeepSpeed's placeholder.
  std::optional<std::string> get_str_opt(const std::string& key, bool auto_is_value = false) {
    const json* v = auto_is_value ? raw(key) : find(key);
    if (!v || v->is_null()) return std::nullopt;
    if (!v->is_string()) fail_expected(ctx_, key_path(key), "a string", *v);
    return v->get<std::string>();
  }
  // One of `names` (matched case-insensitively); returns its index.
  int get_choice(const std::string& key, int def, const std::vector<std::string>& names, bool auto_is_value = false) {
    const auto s = get_str_opt(key, auto_is_value);
    if (!s) return def;
    for (size_t i = 0; i < names.size(); ++i)
      if (lower(*s) == lower(names[i])) return int(i);
    std::string list;
    for (size_t i = 0; i < names.size(); ++i) list += (i ? ", \"" : "\"") + names[i] + "\"";
    fail_at(ctx_, key_path(key), "expected one of " + list + ", got \"" + *s + "\"");
  }
  Section child(const std::string& key, Auto policy) {
    const json* v = find(key);
    if (v && !v->is_object()) fail_expected(ctx_, key_path(key), "an object", *v);
    return Section(ctx_, v, key_path(key), policy);
  }

  // A DeepSpeed key zero8 accepts and ignores without comment.
  void ignore(const std::string& key) { raw(key); }
  // A DeepSpeed key that asks for something zero8 does not do: fail (unsupported) when the value
  // requests it (`active` tells), else accept.
  template <class Active>
  void reject_if(const std::string& key, Active active, const std::string& why) {
    const json* v = raw(key);
    if (v && active(*v)) unsupported_at(ctx_, key_path(key), why);
  }
  template <class Active>
  void warn_if(const std::string& key, Active active, const std::string& why) {
    const json* v = raw(key);
    if (v && active(*v)) warn_at(ctx_, key_path(key), why);
  }

  [[noreturn]] void fail(const std::string& key, const std::string& msg,
                         ErrorCode code = ErrorCode::invalid_argument) const {
    fail_at(ctx_, key_path(key), msg, code);
  }
  // A value zero8 does not support: reported with the others at the end of the parse (Ctx::unsupported).
  void unsupported(const std::string& key, const std::string& msg) { unsupported_at(ctx_, key_path(key), msg); }
  void warn(const std::string& key, const std::string& msg) const { warn_at(ctx_, key_path(key), msg); }

  // Fail on the first key of this section that was not read (the keys zero8 ignores are read, see
  // ignore()): a misspelt key would otherwise leave its setting at the default and run another job than
  // the one written, and DeepSpeed's own config models forbid unknown keys as well. `why` says what
  // DeepSpeed does with such a key here.
  void finish(const std::string& why) {
    if (!obj_) return;
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      if (seen_.count(it.key())) continue;
      const std::string near = closest_key(it.key());
      std::string known;
      if (near.empty() && known_order_.size() <= 20)
        for (const std::string& k : known_order_) known += (known.empty() ? "" : ", ") + k;
      fail_at(ctx_, key_path(it.key()),
              "unknown key" + (!near.empty() ? "; did you mean \"" + near + "\"?"
                               : !known.empty() ? " (the keys zero8 reads here: " + known + ")"
                                                : std::string(" (docs/CONFIG.md lists the keys zero8 reads here)")) +
                  (why.empty() ? "" : " " + why));
    }
  }

  // The top level: DeepSpeed ignores keys it does not know there, and so does zero8 (a warning), except a
  // near miss of a key zero8 reads ("zer08", "zero_optimisation"): a misspelt section, which would be
  // skipped whole.
  void finish_top() {
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      if (seen_.count(it.key())) continue;
      const std::string near = closest_key(it.key());
      if (!near.empty())
        fail_at(ctx_, it.key(), "unknown top-level key; did you mean \"" + near + "\"? (DeepSpeed would ignore a "
                                "misspelt section, and every setting in it, without a word)");
      warn_at(ctx_, it.key(), "unknown key, ignored (DeepSpeed ignores unknown top-level keys too)");
    }
  }

 private:
  void know(const std::string& key) {
    if (known_.insert(key).second) known_order_.push_back(key);
  }
  // The key of this section that `key` is a likely misspelling of ("" if none): the nearest by
  // edit_distance, within 1 edit for keys of up to 7 characters and 2 for longer ones, so that "stgae",
  // "zer08" and "int8_gradeints" find theirs but distinct short names ("amp", "aio") are not confused.
  std::string closest_key(const std::string& key) const {
    std::string best;
    size_t best_d = key.size() <= 7 ? 1 : 2;
    for (const std::string& k : known_order_) {
      const size_t d = edit_distance(key, k);
      if (d <= best_d && (best.empty() || d < best_d)) {
        best = k;
        best_d = d;
      }
    }
    return best;
  }

  Ctx& ctx_;
  const json* obj_;
  std::string path_;
  Auto policy_;
  std::set<std::string> seen_;
  std::set<std::string> known_;            // every key the parser asked this section for, present or not
  std::vector<std::string> known_order_;   // the same, in the order asked
};

bool is_true(const json& v) { return v.is_boolean() && v.get<bool>(); }
bool is_enabled_section(const json& v) {
  if (!v.is_object()) return false;
  auto it = v.find("enabled");
  return it != v.end() && is_true(*it);
}
bool is_non_null(const json& v) { return !v.is_null(); }

// ---------------------------------------------------------------------------------------------------
// JSON text -> tree, with line:column for syntax errors and DeepSpeed's duplicate-key rejection.

struct LineCol {
  int64_t line = 1, col = 1;
};

// nlohmann reports the count of bytes read when it failed; the offending byte is the last one read.
LineCol line_col_at(const std::string& text, size_t bytes_read) {
  const size_t i = std::min(bytes_read == 0 ? size_t(0) : bytes_read - 1, text.size());
  LineCol lc;
  size_t line_start = 0;
  for (size_t k = 0; k < i; ++k)
    if (text[k] == '\n') {
      ++lc.line;
      line_start = k + 1;
    }
  lc.col = int64_t(i - line_start) + 1;
  return lc;
}

// Path of the key being parsed, for duplicate-key errors.
struct ParseFrame {
  bool is_array = false;
  std::string key;
  int64_t index = 0;
  std::unordered_set<std::string> keys;
};

std::string frames_path(const std::vector<ParseFrame>& st) {
  std::string p;
  for (size_t i = 0; i + 1 < st.size(); ++i) {
    const ParseFrame& f = st[i];
    if (f.is_array) p += "[" + std::to_string(f.index) + "]";
    else p = join_path(p, f.key);
  }
  return p;
}

json parse_json_text(const Ctx& ctx, const std::string& text) {
  std::vector<ParseFrame> st;
  std::string duplicate;
  auto element_done = [&st]() {
    if (!st.empty() && st.back().is_array) ++st.back().index;
  };
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& v) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start: st.push_back(ParseFrame{}); break;
      case json::parse_event_t::array_start: {
        ParseFrame f;
        f.is_array = true;
        st.push_back(std::move(f));
        break;
      }
      case json::parse_event_t::key: {
        ParseFrame& f = st.back();
        f.key = v.get<std::string>();
        if (!f.keys.insert(f.key).second && duplicate.empty()) {
          st.push_back(ParseFrame{});  // frames_path() names every frame but the innermost
          duplicate = frames_path(st);
          st.pop_back();
        }
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        st.pop_back();
        element_done();
        break;
      case json::parse_event_t::value: element_done(); break;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    const LineCol lc = line_col_at(text, e.byte);
    // e.what() is "[json.exception.parse_error.N] parse error at line L, column C: <reason>".
    std::string reason = e.what();
    const size_t col = reason.find("column ");
    const size_t colon = col == std::string::npos ? std::string::npos : reason.find(": ", col);
    if (colon != std::string::npos) reason = reason.substr(colon + 2);
    throw Error(ErrorCode::invalid_argument, ctx.source + ":" + std::to_string(lc.line) + ":" +
                                                 std::to_string(lc.col) + ": malformed JSON: " + reason);
  } catch (const json::exception& e) {
    // e.g. out_of_range 406 "number overflow parsing '1e999'" (no position is given).
    std::string reason = e.what();
    const size_t tag = reason.find("] ");
    if (tag != std::string::npos) reason = reason.substr(tag + 2);
    throw Error(ErrorCode::invalid_argument, ctx.source + ": malformed JSON: " + reason);
  }
  if (!duplicate.empty())
    fail_at(ctx, duplicate, "duplicate key (DeepSpeed rejects duplicate keys too; only one value can apply)");
  return root;
}

// The text of every floating-point number of a well-formed document, by key path (Ctx::number_text): the
// SAX interface hands over each number's own characters, which the parsed tree no longer has.
class NumberTextSax : public nlohmann::json_sax<json> {
 public:
  explicit NumberTextSax(std::unordered_map<std::string, std::string>* out) : out_(out) {}
  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t& s) override {
    (*out_)[path()] = s;
    return value();
  }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(false); }
  bool key(string_t& k) override {
    frames_.back().key = k;
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(true); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  struct Frame {
    bool array;
    std::string key;
    int64_t index;
  };
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) p = f.array ? p + "[" + std::to_string(f.index) + "]" : join_path(p, f.key);
    return p;
  }
  bool value() {  // one value done: the next one of an array has the next index
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
    return true;
  }
  bool open(bool array) {
    frames_.push_back(Frame{array, "", 0});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return value();
  }
  std::unordered_map<std::string, std::string>* out_;
  std::vector<Frame> frames_;
};

// ---------------------------------------------------------------------------------------------------
// Sections.

int64_t mul_checked(const Ctx& ctx, int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail_at(ctx, "train_batch_size", "batch sizes overflow a 64-bit integer");
  return r;
}

// DeepSpeed's _set_batch_related_parameters + _batch_assertion, with the division checked instead of
// truncated (DeepSpeed divides with // and then fails its equality assertion).
void parse_batch(Section& top, int world, Config& c) {
  const Ctx& ctx = top.ctx();
  const auto tbs = top.get_int_opt("train_batch_size", 1);
  const auto mbs = top.get_int_opt("train_micro_batch_size_per_gpu", 1);
  const auto gas = top.get_int_opt("gradient_accumulation_steps", 1);
  const std::string rule =
      " (DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
      "* world_size)";
  const std::string w = std::to_string(world);
  BatchConfig& b = c.batch;
  if (tbs && mbs && gas) {
    const int64_t prod = mul_checked(ctx, mul_checked(ctx, *mbs, *gas), world);
    if (prod != *tbs)
      fail_at(ctx, "train_batch_size",
              std::to_string(*tbs) + " != train_micro_batch_size_per_gpu " + std::to_string(*mbs) +
                  " * gradient_accumulation_steps " + std::to_string(*gas) + " * world_size " + w + " = " +
                  std::to_string(prod) + rule);
    b = {*tbs, *mbs, *gas};
  } else if (tbs && mbs) {
    const int64_t d = mul_checked(ctx, *mbs, world);
    if (*tbs % d != 0)
      fail_at(ctx, "train_batch_size",
              std::to_string(*tbs) + " is not divisible by train_micro_batch_size_per_gpu " + std::to_string(*mbs) +
                  " * world_size " + w + " = " + std::to_string(d) +
                  ", so gradient_accumulation_steps cannot be derived" + rule);
    b = {*tbs, *mbs, *tbs / d};
  } else if (tbs && gas) {
    const int64_t d = mul_checked(ctx, *gas, world);
    if (*tbs % d != 0)
      fail_at(ctx, "train_batch_size",
              std::to_string(*tbs) + " is not divisible by gradient_accumulation_steps " + std::to_string(*gas) +
                  " * world_size " + w + " = " + std::to_string(d) +
                  ", so train_micro_batch_size_per_gpu cannot be derived" + rule);
    b = {*tbs, *tbs / d, *gas};
  } else if (mbs && gas) {
    b = {mul_checked(ctx, mul_checked(ctx, *mbs, *gas), world), *mbs, *gas};
  } else if (tbs) {
    // DeepSpeed: gradient_accumulation_steps = 1, micro batch = train_batch_size / world_size.
    if (*tbs % world != 0)
      fail_at(ctx, "train_batch_size",
              std::to_string(*tbs) + " is not divisible by world_size " + w +
                  ", so train_micro_batch_size_per_gpu cannot be derived (gradient_accumulation_steps "
                  "defaults to 1 when only train_batch_size is given)");
    b = {*tbs, *tbs / world, 1};
  } else if (mbs) {
    b = {mul_checked(ctx, *mbs, world), *mbs, 1};  // DeepSpeed: gradient_accumulation_steps = 1
  } else {
    fail_at(ctx, "train_batch_size",
            std::string("missing: give train_batch_size or train_micro_batch_size_per_gpu") +
                (gas ? " (gradient_accumulation_steps alone does not determine the batch)" : "") + rule);
  }
}

void parse_precision(Section& top, Config& c) {
  {
    Section s = top.child("fp16", Auto::use_default);
    Fp16Config& f = c.fp16;
    f.enabled = s.get_bool("enabled", false);
    f.loss_scale = s.get_num("loss_scale", 0.0, ge(0.0));
    f.initial_scale_power = int(s.get_int("initial_scale_power", 16, 0, 63));
    f.loss_scale_window = s.get_int("loss_scale_window", 1000, 1);
    f.hysteresis = int(s.get_int("hysteresis", 2, 1, kI32Max));
    f.consecutive_hysteresis = s.get_bool("consecutive_hysteresis", false);
    f.min_loss_scale = s.get_num("min_loss_scale", 1.0, ge(0.0));
    f.auto_cast = s.get_bool("auto_cast", false);
    s.ignore("fused_mode");
    s.reject_if("fp16_master_weights_and_grads", is_true,
                "fp16 master weights are not supported: zero8 keeps an fp32 master of each partition");
    s.finish("(DeepSpeed rejects unknown fp16 keys too)");
  }
  {
    // "bfloat16" is DeepSpeed's old name, read only when "bf16" is absent.
    const char* key = top.has("bf16") ? "bf16" : "bfloat16";
    if (top.has("bf16") && top.has("bfloat16"))
      top.warn("bfloat16", "ignored: \"bf16\" is also given and takes precedence, as in DeepSpeed");
    top.ignore("bfloat16");
    Section s = top.child(key, Auto::use_default);
    Bf16Config& b = c.bf16;
    b.enabled = s.get_bool("enabled", false);
    b.immediate_grad_update = s.get_bool("immediate_grad_update", false);
    // DeepSpeed 0.19.8's default (precision_config.py): its bf16 ZeRO stage 1/2 steps skip a non-finite
    // gradient unless this is false. zero8 skips such a step in every precision, so false changes nothing.
    b.check_grad_overflow = s.get_bool("check_grad_overflow", true);
    if (b.enabled && !b.check_grad_overflow)
      s.warn("check_grad_overflow",
             "false has no effect: zero8 skips every step with a non-finite gradient (DeepSpeed's bf16 ZeRO steps "
             "would apply it)");
    s.reject_if("bf16_master_weights_and_grads", is_true,
                "bf16 master weights are not supported: zero8 keeps an fp32 master of each partition");
    s.reject_if("bf16_optimizer_states", is_true,
                "bf16 optimizer states are not supported: zero8 keeps them as 8-bit blocks (or fp32)");
    s.finish("(DeepSpeed rejects unknown bf16 keys too)");
  }
  if (c.fp16.enabled && c.bf16.enabled)
    fail_at(top.ctx(), "bf16.enabled", "fp16 and bf16 cannot both be enabled (DeepSpeed asserts the same)");
}

// The names a CommDataType is written with (to_json, messages), indexed by its value.
const char* const kDtypeNames[] = {"", "fp32", "fp16", "bf16"};

// A dtype of "data_types" by DeepSpeed's DtypeEnum names (matched exactly, as there).
CommDataType read_data_type(Section& s, const std::string& key) {
  const auto v = s.get_str_opt(key);
  if (!v) return CommDataType::unset;
  using D = CommDataType;
  static const std::pair<const char*, D> names[] = {
      {"fp32", D::fp32}, {"float32", D::fp32}, {"torch.float32", D::fp32}, {"float", D::fp32},
      {"fp16", D::fp16}, {"float16", D::fp16}, {"torch.float16", D::fp16}, {"half", D::fp16},
      {"bf16", D::bf16}, {"bfloat16", D::bf16}, {"torch.bfloat16", D::bf16}};
  for (const auto& [name, d] : names)
    if (*v == name) return d;
  if (*v == "int8" || *v == "torch.int8") {
    s.unsupported(key, "int8 is not supported: zero8 trains in fp32, fp16 or bf16");
    return CommDataType::unset;
  }
  s.fail(key, "expected one of \"fp32\", \"fp16\", \"bf16\" (or DeepSpeed's other names for them: \"float32\", "
              "\"float16\", \"half\", \"bfloat16\", ...), got \"" + *v + "\"");
}

// "data_types" (DeepSpeed's runtime/config.py and engine._cast_module_mixed_precision): the engine applies
// buffer_dtype and keep_in_fp32_modules when it casts the module (engine/precision.py).
void parse_data_types(Section& top, Config& c) {
  Section s = top.child("data_types", Auto::use_default);
  DataTypesConfig& d = c.data_types;
  d.grad_accum_dtype = read_data_type(s, "grad_accum_dtype");
  d.param_dtype = read_data_type(s, "param_dtype");
  d.buffer_dtype = read_data_type(s, "buffer_dtype");
  const CommDataType training = c.fp16.enabled ? CommDataType::fp16 : c.bf16.enabled ? CommDataType::bf16
                                                                                      : CommDataType::fp32;
  if (d.param_dtype != CommDataType::unset && d.param_dtype != training)
    s.fail("param_dtype", std::string("\"") + kDtypeNames[int(d.param_dtype)] + "\" is not the training dtype, " +
                              kDtypeNames[int(training)] + " (the fp16 / bf16 sections decide it; DeepSpeed asserts the "
                              "same): give the matching section or remove param_dtype");
  // "auto" is the key's own value here (the model's lists), not DeepSpeed's placeholder; null takes it too.
  const std::string what = "\"auto\" or a list of name patterns (strings)";
  if (const json* k = s.raw("keep_in_fp32_modules"); k && !k->is_null() && *k != json("auto")) {
    if (!k->is_array()) fail_expected(s.ctx(), s.key_path("keep_in_fp32_modules"), what, *k);
    std::vector<std::string> patterns;
    for (const json& e : *k) {
      if (!e.is_string()) fail_expected(s.ctx(), s.key_path("keep_in_fp32_modules"), what, *k);
      patterns.push_back(e.get<std::string>());
    }
    d.keep_in_fp32_modules = std::move(patterns);
  }
  s.finish("(DeepSpeed ignores unknown data_types keys, leaving the setting meant at its default)");
}

void parse_offload(Section& z, const std::string& key, const std::string& what) {
  Section o = z.child(key, Auto::use_default);
  if (!o.present()) return;
  const int dev = o.get_choice("device", 0, {"none", "cpu", "nvme"});
  if (dev != 0)
    o.unsupported("device",
                  what + " offload is not supported by zero8 (" +
                      (what == "optimizer" ? std::string("its 8-bit states already cut optimizer memory about 4x")
                                           : std::string("it shards optimizer states and gradients, ZeRO stages 1 "
                                                         "and 2, and keeps the parameters on every rank")) +
                      "): use \"none\" or remove " + z.key_path(key));
  for (const char* k : {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline_read",
                        "pipeline_write", "fast_init", "ratio", "super_offload", "convert_grad_on_cpu",
                        "cpuadam_cores_perc"})
    o.ignore(k);
  o.finish("(DeepSpeed rejects unknown offload keys too)");
}

void parse_zero(Section& top, Config& c) {
  ZeroConfig& z = c.zero;
  const json* raw = top.raw("zero_optimization");
  if (raw && raw->is_boolean()) {
    // DeepSpeed's deprecated form: true means stage 1, with "allgather_size" at the top level.
    z.stage = raw->get<bool>() ? 1 : 0;
    z.allgather_bucket_size = top.get_int("allgather_size", z.allgather_bucket_size, 1);
    top.warn("zero_optimization", "the boolean form is deprecated (as in DeepSpeed): use {\"stage\": N}");
    return;
  }
  top.ignore("allgather_size");
  Section s = top.child("zero_optimization", Auto::use_default);
  z.stage = int(s.get_int("stage", 0, 0, 3));
  if (z.stage == 3)
    s.unsupported("stage", "ZeRO stage 3 (parameter partitioning) is not supported by zero8: use stage 1 or 2");
  // Element counts; DeepSpeed allows 0, which no bucketing can use.
  z.reduce_bucket_size = s.get_int("reduce_bucket_size", z.reduce_bucket_size, 1);
  z.allgather_bucket_size = s.get_int("allgather_bucket_size", z.allgather_bucket_size, 1);
  // zero8 overlaps by default (DeepSpeed: only in stage 3); either way the results are the same bits.
  z.overlap_comm = s.get_bool("overlap_comm", true);
  z.contiguous_gradients = s.get_bool("contiguous_gradients", true);
  z.reduce_scatter = s.get_bool("reduce_scatter", true);
  z.allgather_partitions = s.get_bool("allgather_partitions", true);
  z.round_robin_gradients = s.get_bool("round_robin_gradients", false);
  z.load_from_fp32_weights = s.get_bool("load_from_fp32_weights", true);
  z.ignore_unused_parameters = s.get_bool("ignore_unused_parameters", true);
  z.parameter_alignment = s.get_bool("parameter_alignment", false);
  z.compute_grad_norm = s.get_bool("compute_grad_norm", true);
  parse_offload(s, "offload_optimizer", "optimizer");
  parse_offload(s, "offload_param", "parameter");
  s.reject_if("cpu_offload", is_true, "optimizer offload is not supported by zero8");
  s.reject_if("cpu_offload_param", is_true, "parameter offload is not supported by zero8");
  s.reject_if("legacy_stage1", is_true, "the legacy stage 1 is gone from DeepSpeed too (>= 0.5.9)");
  s.reject_if("zenflow", is_non_null, "ZenFlow is not supported by zero8");
  const std::string zpp =
      "ZeRO++ quantized communication is not used: zero8 sends its own int8 blocks (zero8.int8_gradients, "
      "zero8.int8_params)";
  s.warn_if("zero_quantized_gradients", is_true, zpp);
  s.warn_if("zero_quantized_weights", is_true, zpp);
  s.warn_if("zero_quantized_nontrainable_weights", is_true, zpp);
  s.warn_if("zero_hpz_partition_size", [](const json& v) { return v.is_number() && v.get<double>() > 1; },
            "hierarchical partitioning (ZeRO++ hpZ) is not implemented: ignored");
  s.warn_if("mics_shard_size", [](const json& v) { return v.is_number() && v.get<double>() > 0; },
            "MiCS sharding is not implemented: ignored");
  // Tuning knobs of stage 3, offload and other DeepSpeed internals: accepted, no effect here.
  for (const char* k : {"cpu_offload_use_pin_memory", "elastic_checkpoint", "sub_group_size",
                        "use_multi_rank_bucket_allreduce", "mics_hierarchical_params_gather", "memory_efficient_linear",
                        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                        "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
                        "zeropp_loco_param", "prefetch_bucket_size", "param_persistence_threshold",
                        "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                        "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                        "use_all_reduce_for_fetch_params", "allgather_sequential", "partition_stream_chunk_size"})
    s.ignore(k);
  for (const std::string& k : s.keys())
    if (k.rfind("stage3_", 0) == 0) s.ignore(k);
  s.finish("(DeepSpeed rejects unknown zero_optimization keys too)");
}

std::string supported_list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s;
}

// The DeepSpeed types of the algorithm table, in its order.
std::vector<std::string> optimizer_type_names() {
  std::vector<std::string> names;
  for (const optim::AlgoSpec& r : optim::kAlgos)
    if (r.deepspeed) names.emplace_back(r.deepspeed);
  return names;
}

// "betas[1]" -> "betas" (and element 1); a scalar key is its own base.
std::string key_base(const char* key) {
  const char* bracket = std::strchr(key, '[');
  return bracket ? std::string(key, size_t(bracket - key)) : std::string(key);
}

bool is_sequence_key(const char* key) { return std::strchr(key, '[') != nullptr; }

// The admissible values of a table entry in a config: its range, with 0 excluded where 0 means "off" in
// zero8 but is a value in DeepSpeed (HyperRange::zero_off).
Range config_range(const optim::HyperRange& r) {
  Range out{r.lo, r.hi, r.lo_open || r.zero_off, r.hi_open};
  return out;
}

std::string count_word(size_t n) {
  static const char* const words[] = {"zero", "one", "two", "three", "four"};
  return n < 5 ? words[n] : std::to_string(n);
}

// torch.optim flags that select an implementation, not the math: accepted and ignored.
void ignore_torch_flags(Section& p) {
  for (const char* k : {"foreach", "fused", "capturable", "differentiable", "set_grad_none"}) p.ignore(k);
  p.reject_if("maximize", is_true, "maximize is not supported");
}

// Entry i of the row from optimizer.params; a sequence (betas) is read whole at its first element.
void read_optimizer_entry(Section& p, const optim::AlgoSpec& row, int i, OptimizerConfig& o) {
  using optim::HyperRole;
  const optim::HyperSpec& e = row.hyper[i];
  if (is_sequence_key(e.deepspeed)) {
    // The entries whose keys are elements of this sequence, in the row's order: an array of as many numbers.
    const std::string base = key_base(e.deepspeed);
    std::vector<int> elems;
    std::string names;
    for (int j = 0; j < row.num_hyper; ++j)
      if (row.hyper[j].deepspeed && is_sequence_key(row.hyper[j].deepspeed) && key_base(row.hyper[j].deepspeed) == base) {
        names += (elems.empty() ? "" : ", ") + std::string(optim::hyper_field_name(row.hyper[j].field));
        elems.push_back(j);
      }
    if (elems.front() != i) return;
    const json* v = p.find(base);
    if (!v) return;
    const std::string path = p.key_path(base);
    if (!v->is_array() || v->size() != elems.size())
      fail_expected(p.ctx(), path, "an array of " + count_word(elems.size()) + " numbers [" + names + "]", *v);
    for (size_t k = 0; k < elems.size(); ++k)
      o.values[size_t(elems[k])] = value_num(p.ctx(), path + "[" + std::to_string(k) + "]", (*v)[k],
                                              config_range(row.hyper[elems[k]].range));
    return;
  }
  const std::string key = e.deepspeed;
  const bool flag = e.type == optim::HyperType::flag;
  const double def = e.ds_default;
  const double x = flag ? (p.get_bool(key, def != 0.0) ? 1.0 : 0.0) : p.get_num(key, def, config_range(e.range));
  switch (e.role) {
    case HyperRole::value:
    case HyperRole::init: o.values[size_t(i)] = x; break;
    // The decoupled form itself ("AdamW") stays decoupled whatever the flag says, as in DeepSpeed's engine.
    case HyperRole::decouple: o.values[size_t(i)] = row.decoupled == row.algo ? 1.0 : x; break;
    case HyperRole::fixed:
      if (x != def)
        p.unsupported(key, std::string(row.deepspeed) + " with " + key + " is not supported: " + e.why);
      o.values[size_t(i)] = def;
      break;
    case HyperRole::ignored:
      if (x != def) p.warn(key, std::string("ignored: ") + e.why);
      o.values[size_t(i)] = def;
      break;
    case HyperRole::bnb_const: break;
  }
}

void parse_optimizer(Section& top, Config& c) {
  Section s = top.child("optimizer", Auto::reject);
  if (!s.present()) return;
  const std::string supported = supported_list(optimizer_type_names());
  const auto type = s.get_str_opt("type");
  if (!type) s.fail("type", "missing: name the optimizer (" + supported + ")");
  const std::string t = lower(*type);
  static const std::vector<std::string> deepspeed_only = {"onebitadam", "zerooneadam", "onebitlamb", "muadam",
                                                          "muadamw",    "musgd",       "muon"};
  if (std::find(deepspeed_only.begin(), deepspeed_only.end(), t) != deepspeed_only.end())
    s.fail("type", "\"" + *type + "\" is a DeepSpeed optimizer zero8 does not implement; supported: " + supported,
           ErrorCode::unsupported);
  const optim::AlgoSpec* row = nullptr;
  for (const optim::AlgoSpec& r : optim::kAlgos)
    if (r.deepspeed && t == lower(r.deepspeed)) row = &r;
  if (!row)
    s.fail("type", "\"" + *type + "\" is not an optimizer zero8 implements (DeepSpeed would look it up in "
                   "torch.optim); supported: " + supported,
           ErrorCode::unsupported);
  OptimizerConfig& o = c.optimizer;
  o = OptimizerConfig(row->algo);
  o.present = true;
  s.ignore("legacy_fusion");

  Section p = s.child("params", Auto::reject);
  // DeepSpeed's engine rejects it for every optimizer.
  if (p.raw("max_grad_norm"))
    p.fail("max_grad_norm",
           "not supported as an optimizer parameter (DeepSpeed rejects it too): use the top-level gradient_clipping");
  // Each type reads the entries of its row that have a DeepSpeed key, with the defaults of the optimizer
  // DeepSpeed builds for it.
  for (int i = 0; i < row->num_hyper; ++i)
    if (row->hyper[i].deepspeed) read_optimizer_entry(p, *row, i, o);
  // Rules between entries, for every row that has the fields.
  const optim::Hyper h = optimizer_hyper(o);
  auto has = [&](optim::HyperField f) {
    for (int i = 0; i < row->num_hyper; ++i)
      if (row->hyper[i].field == f && row->hyper[i].deepspeed) return row->hyper[i].deepspeed;
    return static_cast<const char*>(nullptr);
  };
  // torch.optim.SGD raises the same.
  if (const char* nesterov = has(optim::HyperField::nesterov); nesterov && h.nesterov && (h.beta1 <= 0.0f || h.dampening != 0.0f)) {
    const char* momentum = has(optim::HyperField::beta1);
    const char* dampening = has(optim::HyperField::dampening);
    p.fail(nesterov, std::string("Nesterov momentum requires ") + momentum + " > 0 and " + dampening + " 0 (got " +
                         momentum + " " + num_text(p.ctx(), p.key_path(momentum), o.get(momentum)) + ", " +
                         dampening + " " + num_text(p.ctx(), p.key_path(dampening), o.get(dampening)) + ")");
  }
  const char* max_key = has(optim::HyperField::max_trust_ratio);
  const char* min_key = has(optim::HyperField::min_trust_ratio);
  if (max_key && min_key && o.get(min_key) > o.get(max_key))
    p.fail(min_key, std::string("expected <= ") + max_key + " " +
                        num_text(p.ctx(), p.key_path(max_key), o.get(max_key)) + ", got " +
                        num_text(p.ctx(), p.key_path(min_key), o.get(min_key)));
  if (row->torch_flags) ignore_torch_flags(p);
  p.finish(std::string("(DeepSpeed would pass it to the ") + row->deepspeed +
           " constructor, which rejects unknown arguments)");
  s.finish("(DeepSpeed reads the optimizer's settings from optimizer.params only)");
}

const std::vector<std::string> kSchedulerNames = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                                  "LRRangeTest"};

void read_warmup_type(Section& p, SchedulerConfig& sc) {
  const auto w = p.get_str_opt("warmup_type");
  if (!w) return;
  if (*w == "log") sc.warmup_type = WarmupType::log;
  else if (*w == "linear") sc.warmup_type = WarmupType::linear;
  else {
    // lr_schedules.py does the same: a warning, then the log ramp.
    p.warn("warmup_type", "unknown value \"" + *w + "\": the log warmup is used, as DeepSpeed does");
    sc.warmup_type = WarmupType::log;
  }
}

void parse_scheduler(Section& top, Config& c) {
  SchedulerConfig& sc = c.scheduler;
  if (c.optimizer.present) sc.base_lr = c.optimizer.get("lr");
  Section s = top.child("scheduler", Auto::reject);
  if (!s.present()) return;
  const auto type = s.get_str_opt("type");
  if (!type) s.fail("type", "missing: name the schedule (" + supported_list(kSchedulerNames) + ")");
  int idx = -1;
  for (size_t i = 0; i < kSchedulerNames.size(); ++i)
    if (lower(*type) == lower(kSchedulerNames[i])) idx = int(i);
  if (idx < 0)
    s.fail("type", "\"" + *type + "\" is not a schedule zero8 implements (DeepSpeed would look it up in "
                   "torch.optim.lr_scheduler); supported: " + supported_list(kSchedulerNames),
           ErrorCode::unsupported);
  sc.type = SchedulerType(idx + 1);
  Section p = s.child("params", Auto::reject);
  p.warn_if("last_batch_iteration", [](const json& v) { return !(v.is_number() && v.get<double>() == -1.0); },
            "ignored: the schedule's position is restored from checkpoints");
  switch (sc.type) {
    case SchedulerType::warmup_lr:
    case SchedulerType::warmup_decay_lr: {
      const bool decay = sc.type == SchedulerType::warmup_decay_lr;
      if (decay) {
        const auto t = p.get_int_opt("total_num_steps", 1);
        if (!t) p.fail("total_num_steps", "missing: WarmupDecayLR needs the total number of steps");
        sc.total_num_steps = *t;
      }
      sc.warmup_min_lr = p.get_num("warmup_min_lr", 0.0, ge(0.0));
      sc.warmup_max_lr = p.get_num_opt("warmup_max_lr", ge(0.0));
      sc.warmup_max_lr_given = sc.warmup_max_lr.has_value();
      // WarmupLR defaults to the optimizer's lr; WarmupDecayLR's constructor default is 0.001.
      if (!sc.warmup_max_lr) {
        sc.warmup_max_lr = decay ? std::optional<double>(0.001) : sc.base_lr;
        // DeepSpeed applies that 0.001 without a word; a config whose optimizer lr differs rarely means it.
        if (decay && sc.base_lr && *sc.base_lr != 0.001)
          p.warn("warmup_max_lr", "not given: WarmupDecayLR peaks at DeepSpeed's default 0.001, not "
                                  "optimizer.params.lr " + fmt_num(*sc.base_lr) +
                                      " (WarmupLR would take the optimizer's); give it to choose");
      }
      // 0 is what the Hugging Face Trainer writes for "no warmup"; the formulas use max(2, n), DeepSpeed's
      // formula (current DeepSpeed raises for 0 before it: docs/CONFIG.md).
      sc.warmup_num_steps = p.get_int("warmup_num_steps", 1000, 0);
      read_warmup_type(p, sc);
      if (decay && sc.total_num_steps < sc.warmup_num_steps)
        p.warn("total_num_steps", "is less than warmup_num_steps " + std::to_string(sc.warmup_num_steps) +
                                      " (DeepSpeed warns the same)");
      break;
    }
    case SchedulerType::warmup_cosine_lr: {
      const auto t = p.get_int_opt("total_num_steps", 1);
      if (!t) p.fail("total_num_steps", "missing: WarmupCosineLR needs the total number of steps");
      sc.total_num_steps = *t;
      sc.warmup_min_ratio = p.get_num("warmup_min_ratio", 0.0, ge(0.0));
      sc.warmup_num_steps = p.get_int("warmup_num_steps", 1000, 0);
      sc.cos_min_ratio = p.get_num("cos_min_ratio", 0.0001, ge(0.0));
      read_warmup_type(p, sc);
      if (sc.total_num_steps < sc.warmup_num_steps)
        p.warn("total_num_steps", "is less than warmup_num_steps " + std::to_string(sc.warmup_num_steps) +
                                      " (DeepSpeed warns the same)");
      break;
    }
    case SchedulerType::one_cycle: {
      const auto lo = p.get_num_opt("cycle_min_lr", ge(0.0));
      const auto hi = p.get_num_opt("cycle_max_lr", ge(0.0));
      if (!lo) p.fail("cycle_min_lr", "missing: OneCycle needs cycle_min_lr and cycle_max_lr");
      if (!hi) p.fail("cycle_max_lr", "missing: OneCycle needs cycle_min_lr and cycle_max_lr");
      sc.cycle_min_lr = *lo;
      sc.cycle_max_lr = *hi;
      sc.decay_lr_rate = p.get_num("decay_lr_rate", 0.0, any_number());
      sc.cycle_first_step_size = p.get_int("cycle_first_step_size", 2000, 1);
      sc.cycle_second_step_size = p.get_int("cycle_second_step_size", sc.cycle_first_step_size, 1);
      // lr_schedules.py's command-line default is -1; any count <= 0 means no staircase.
      sc.cycle_first_stair_count = p.get_int("cycle_first_stair_count", 0, -1);
      sc.cycle_second_stair_count = p.get_int("cycle_second_stair_count", sc.cycle_first_stair_count, -1);
      // DeepSpeed documents these stairs, but its OneCycle (lr_schedules.py) stores the counts and never
      // reads them: its lr is the continuous triangle. zero8 applies them, so the run differs.
      for (const char* k : {"cycle_first_stair_count", "cycle_second_stair_count"}) {
        const json* v = p.raw(k);
        if (v && v->is_number() && v->get<double>() > 0) {
          p.warn(k, "staircase applied as DeepSpeed documents it, but DeepSpeed's OneCycle ignores it (its lr "
                    "rises and falls continuously): the lr differs from a DeepSpeed run's; 0 gives DeepSpeed's");
          break;  // once for the pair
        }
      }
      sc.decay_step_size = p.get_int("decay_step_size", 0, 0);
      sc.cycle_momentum = p.get_bool("cycle_momentum", true);
      sc.cycle_min_mom = p.get_num("cycle_min_mom", 0.8, in_co(0.0, 1.0));
      sc.cycle_max_mom = p.get_num("cycle_max_mom", 0.9, in_co(0.0, 1.0));
      sc.decay_mom_rate = p.get_num("decay_mom_rate", 0.0, any_number());
      const bool has_betas = optimizer_has_betas(c.optimizer.type);
      // Without an optimizer section the client optimizer decides, which the parse cannot see: momentum_cycled
      // then means "if it has betas", and zero8.lr_schedules checks its defaults for them as DeepSpeed's OneCycle
      // does (SGD's momentum is left alone, with DeepSpeed's warning).
      sc.momentum_cycled = sc.cycle_momentum && (!c.optimizer.present || has_betas);
      if (sc.cycle_momentum && c.optimizer.present && !has_betas)
        p.warn("cycle_momentum", std::string("momentum is not cycled: ") + optim::algo_spec(c.optimizer.type).deepspeed +
                                     " has no betas (DeepSpeed disables it the same way)");
      // After the cycle DeepSpeed's formula moves momentum by decay_mom_rate without a bound, so any
      // nonzero rate takes beta1 out of [0, 1) at some step (DeepSpeed then sets it silently; zero8's
      // scheduler stops there with an error naming this key). Say at initialize which step that is.
      if (sc.momentum_cycled && sc.decay_step_size > 0 && sc.decay_mom_rate != 0.0 && sc.cycle_max_mom > 0.0) {
        const double need = sc.decay_mom_rate > 0 ? (1.0 / sc.cycle_max_mom - 1.0) / sc.decay_mom_rate
                                                  : -1.0 / sc.decay_mom_rate;  // interval where it leaves [0, 1)
        const double total = double(sc.cycle_first_step_size) + double(sc.cycle_second_step_size);
        double t = std::max(total, std::floor(total - 1.0 + need * double(sc.decay_step_size)) - 1.0);
        while (t < 9e15) {
          const double m = momentum_at(sc, int64_t(t));
          if (!(m >= 0.0 && m < 1.0)) break;
          t += 1.0;
        }
        if (t < 9e15)
          p.warn("decay_mom_rate", "momentum after the cycle is cycle_max_mom * (1 + decay_mom_rate * k) for the k-th "
                                   "decay interval, which leaves [0, 1) at scheduler step " + fmt_num(t) + " (beta1 " +
                                   fmt_num(momentum_at(sc, int64_t(t))) + "); the step there raises. DeepSpeed "
                                   "sets such a beta1 silently; 0 keeps momentum at cycle_max_mom");
      }
      if (sc.momentum_cycled && c.optimizer.present && c.optimizer.get("betas[1]") != kOneCycleBeta2)
        p.warn("cycle_momentum", "cycling sets betas to (momentum, 0.99) as DeepSpeed does: optimizer beta2 " +
                                     fmt_num(c.optimizer.get("betas[1]")) + " is replaced by 0.99");
      break;
    }
    case SchedulerType::lr_range_test:
      sc.lr_range_test_min_lr = p.get_num("lr_range_test_min_lr", 1e-3, ge(0.0));
      sc.lr_range_test_step_size = p.get_int("lr_range_test_step_size", 2000, 1);
      sc.lr_range_test_step_rate = p.get_num("lr_range_test_step_rate", 1.0, ge(0.0));
      sc.lr_range_test_staircase = p.get_bool("lr_range_test_staircase", false);
      break;
    case SchedulerType::none: break;
  }
  p.finish("(DeepSpeed would pass it to the " + kSchedulerNames[size_t(idx)] +
           " constructor, which rejects unknown arguments)");
  s.finish("(DeepSpeed reads the schedule's settings from scheduler.params only)");
}

// DeepSpeed's monitor sections (monitor/config.py): pydantic models, so "auto" takes the default and an
// unknown key is an error there too.
const char* const kMonitorUnknown = "(DeepSpeed's monitor config rejects unknown keys too)";

void parse_monitor_output(Section& top, const char* key, MonitorOutputConfig& m) {
  Section s = top.child(key, Auto::use_default);
  m.enabled = s.get_bool("enabled", false);
  m.output_path = s.get_str_opt("output_path").value_or("");
  m.job_name = s.get_str_opt("job_name").value_or("DeepSpeedJobName");
  s.finish(kMonitorUnknown);
}

void parse_monitors(Section& top, Config& c) {
  parse_monitor_output(top, "tensorboard", c.tensorboard);
  parse_monitor_output(top, "csv_monitor", c.csv_monitor);
  Section s = top.child("wandb", Auto::use_default);
  WandbConfig& w = c.wandb;
  w.enabled = s.get_bool("enabled", false);
  w.group = s.get_str_opt("group");
  w.team = s.get_str_opt("team");
  w.project = s.get_str_opt("project").value_or("deepspeed");
  s.finish(kMonitorUnknown);
}

void parse_misc(Section& top, Config& c) {
  // DeepSpeed's default since its PR #8068 (June 2026; in the 0.19.8 the tests pin): 1.0, where it was 0 (off).
  c.gradient_clipping = top.get_num("gradient_clipping", 1.0, ge(0.0));
  c.steps_per_print = top.get_int("steps_per_print", 10, 1);
  c.wall_clock_breakdown = top.get_bool("wall_clock_breakdown", false);
  c.managed_gradient_accumulation = top.get_bool("managed_gradient_accumulation", true);
  c.prescale_gradients = top.get_bool("prescale_gradients", false);
  c.gradient_predivide_factor = top.get_num("gradient_predivide_factor", 1.0, gt(0.0));
  c.zero_allow_untested_optimizer = top.get_bool("zero_allow_untested_optimizer", false);
  // Unset (null or absent): DeepSpeed derives it from the precision; so does zero8.
  c.communication_data_type = CommDataType(1 + top.get_choice("communication_data_type", -1, {"fp32", "fp16", "bf16"}));
  if (c.communication_data_type == CommDataType::fp16)
    top.warn("communication_data_type",
             "zero8 has no fp16 wire format: unquantized gradients are reduced in fp32 (use \"bf16\" or int8 "
             "gradients for less traffic)");
  // DeepSpeed matches the value case-insensitively; "sum" makes the reduced gradient world_size times the
  // mean zero8 computes, which changes the step of SGD-like optimizers and what gradient_clipping clips.
  if (const auto op = top.get_str_opt("gradient_allreduce_op")) {
    if (lower(*op) == "sum")
      top.unsupported("gradient_allreduce_op",
                      "\"sum\" is not supported: zero8 averages gradients over the data-parallel ranks (\"mean\"); "
                      "to get DeepSpeed's \"sum\" behaviour, scale the learning rate by the data-parallel world size");
    else if (lower(*op) != "mean")
      top.fail("gradient_allreduce_op", "expected one of \"mean\", \"sum\" (DeepSpeed's choices), got \"" + *op + "\"");
  }
  // zero8 is data-parallel only: every rank is a data-parallel rank and the batch rule uses the whole world size.
  // A sequence- or tensor-parallel degree above 1 would split the model or the sequence over ranks instead.
  const auto above_one = [](const json& v) { return v.is_number() && v.get<double>() > 1; };
  const std::string dp_only = "zero8 is data-parallel only (every rank trains the whole model on its own samples, "
                              "and the batch sizes count every rank as data-parallel); use 1 or remove it";
  top.reject_if("sequence_parallel_size", above_one, "a degree above 1 is not supported: " + dp_only);
  if (const json* tp = top.raw("tensor_parallel"); tp && tp->is_object()) {
    const std::string why = "a tensor-parallel degree above 1 is not supported: " + dp_only;
    Section tps(top.ctx(), tp, "tensor_parallel", Auto::use_default);
    tps.reject_if("autotp_size", above_one, why);
    tps.reject_if("tp_size", above_one, why);
    Section(top.ctx(), tps.raw("tp"), "tensor_parallel.tp", Auto::use_default).reject_if("tp_size", above_one, why);
  }
  // Features that change what training computes and that zero8 does not implement.
  top.reject_if("amp", is_enabled_section, "Apex AMP is not supported: use \"fp16\" or \"bf16\"");
  top.reject_if("torch_autocast", is_enabled_section,
                "DeepSpeed's torch.autocast mode is not supported (zero8 would train in fp32): use the \"bf16\" or "
                "\"fp16\" section (fp16's \"auto_cast\" casts the forward's inputs to fp16), or wrap your model's "
                "forward in torch.autocast yourself");
  top.reject_if("elasticity", is_enabled_section,
                "elastic training is not supported: it rewrites the batch sizes zero8 was configured with");
  // Model-side or data-side features: the caller's business; zero8 only notes that it does not apply them.
  for (const char* k : {"progressive_layer_drop", "curriculum_learning", "data_efficiency",
                        "eigenvalue"})
    top.warn_if(k, is_enabled_section, "not implemented by zero8: ignored");
  for (const char* k : {"sparse_attention", "weight_quantization", "compression_training", "quantize_training"})
    top.warn_if(k, is_non_null, "not implemented by zero8: ignored");
  top.warn_if("sparse_gradients", is_true, "sparse gradients are not implemented: gradients are reduced densely");
  parse_monitors(top, c);
  // The monitor and profilers zero8 does not implement: an enabled one would write files (or send runs) zero8
  // never produces, so one warning names all the enabled ones; disabled ones are silent.
  std::string ignored;
  for (const char* k : {"comet", "flops_profiler", "comms_logger"})
    if (const json* v = top.raw(k); v && is_enabled_section(*v)) ignored += (ignored.empty() ? "" : ", ") + std::string(k);
  if (!ignored.empty())
    warn_at(top.ctx(), ignored,
            "enabled, but zero8 does not implement this DeepSpeed monitor or profiler: it writes nothing for it "
            "(zero8 writes the tensorboard, csv_monitor and wandb monitors only)");
  // I/O tuning and other DeepSpeed subsystems: accepted, no effect here.
  for (const char* k : {"memory_breakdown", "dump_state", "dataloader_drop_last", "vocabulary_size", "timers",
                        "zero_force_ds_cpu_optimizer", "disable_allgather", "autotuning", "aio", "nebula",
                        "datastates", "log_level", "graph_harvesting", "seq_parallel_communication_data_type",
                        "use_data_before_expert_parallelism", "compile", "hybrid_engine", "expert_parallel",
                        "activation_checkpointing", "pipeline"})
    top.ignore(k);
}

// zero_optimization.compute_grad_norm false, where DeepSpeed 0.19.8 refuses it: below stage 1 (its ZeRO
// config), with gradient clipping (its stage 1/2 optimizer), and for bf16 ZeRO stage 1 with fp32 gradient
// accumulation (its engine, which uses its BF16 optimizer there).
void check_compute_grad_norm(Section& top, const Config& c) {
  if (c.zero.compute_grad_norm) return;
  const std::string key = "zero_optimization.compute_grad_norm";
  if (c.zero.stage != 1 && c.zero.stage != 2)
    fail_at(top.ctx(), key, "false is supported only with ZeRO stage 1 or 2 (as in DeepSpeed), the stage is " +
                                std::to_string(c.zero.stage));
  if (c.gradient_clipping > 0)
    fail_at(top.ctx(), key, "false requires gradient_clipping 0 (as in DeepSpeed: clipping needs the norm), got " +
                                num_text(top.ctx(), "gradient_clipping", c.gradient_clipping) +
                                " (DeepSpeed's default, and so zero8's, is 1.0)");
  if (c.bf16.enabled && c.zero.stage == 1 && c.data_types.grad_accum_dtype == CommDataType::fp32)
    fail_at(top.ctx(), key, "false does not support ZeRO stage 1 with bf16 parameters and fp32 gradient "
                            "accumulation (data_types.grad_accum_dtype), as in DeepSpeed");
}

void parse_checkpoint(Section& top, Config& c) {
  Section s = top.child("checkpoint", Auto::reject);
  CheckpointConfig& k = c.checkpoint;
  k.tag_validation = TagValidation(s.get_choice("tag_validation", 0, {"Warn", "Ignore", "Fail"}));
  k.load_universal = s.get_bool("load_universal", false);
  k.use_node_local_storage = s.get_bool("use_node_local_storage", false);
  if (k.use_node_local_storage)
    s.unsupported("use_node_local_storage",
                  "true is not supported by zero8: every rank must see the same file system at the checkpoint "
                  "directory (rank 0 creates the tag directory the others write into, and a load at another world "
                  "size reads other ranks' shards); use false or remove it");
  s.ignore("parallel_write");
  s.ignore("writer");
  s.finish("(DeepSpeed ignores unknown checkpoint keys, leaving the setting meant at its default)");
}

bool is_pow2_block(int64_t b) { return b >= 64 && b <= 4096 && (b & (b - 1)) == 0; }

void parse_zero8(Section& top, Config& c) {
  Zero8Config& z = c.zero8;
  Section s = top.child("zero8", Auto::reject);
  z.enabled = s.get_bool("enabled", s.present());  // the section turns zero8 on unless it says otherwise
  for (const char* key : {"state_block_size", "wire_block_size"}) {
    const int64_t def = std::string(key) == "state_block_size" ? 256 : 2048;
    const json* v = s.find(key);
    int64_t b = def;
    if (v) {
      b = value_int(s.ctx(), s.key_path(key), *v, kI64Min, kI64Max);
      if (!is_pow2_block(b)) fail_expected(s.ctx(), s.key_path(key), "a power of two in [64, 4096]", *v);
    }
    (std::string(key) == "state_block_size" ? z.state_block_size : z.wire_block_size) = int32_t(b);
  }
  z.int8_gradients = s.get_bool("int8_gradients", true);
  z.int8_params = s.get_bool("int8_params", true);
  z.int8_activations = s.get_bool("int8_activations", false);
  z.queued_stage_messages = s.get_bool("queued_stage_messages", false);
  z.error_feedback = s.get_bool("error_feedback", false);
  if (z.error_feedback && !z.int8_gradients)
    s.warn("error_feedback", "has no effect without int8_gradients (fp32 gradients have no quantization error)");
  z.release_gradients = s.get_bool("release_gradients", false);
  z.overlap_param_gather = s.get_bool("overlap_param_gather", true);
  z.min_8bit_size = s.get_int("min_8bit_size", 4096, 0);
  {
    const json* v = s.find("optim_bits");
    if (v) {
      z.optim_bits = int(value_int(s.ctx(), s.key_path("optim_bits"), *v, kI64Min, kI64Max));
      if (z.optim_bits != 8 && z.optim_bits != 32) fail_expected(s.ctx(), s.key_path("optim_bits"), "8 or 32", *v);
    }
  }
  z.stochastic_rounding = s.get_bool("stochastic_rounding", false);
  if (z.stochastic_rounding && !z.int8_gradients && !z.int8_params)
    s.warn("stochastic_rounding", "has no effect without int8_gradients or int8_params (it rounds the int8 blocks "
                                  "on the wire)");
  {
    const json* v = s.find("seed");
    if (v) {
      if (v->is_number_unsigned()) z.seed = v->get<uint64_t>();
      else z.seed = uint64_t(value_int(s.ctx(), s.key_path("seed"), *v, 0, kI64Max));
    }
  }
  // "nccl" needs a model on a GPU, which the engine checks (the config does not know where the model is).
  z.comm_backend = CommBackend(s.get_choice("comm_backend", 0, {"auto", "mpi", "single", "nccl", "tcp"}, true));
  z.comm_timeout_s = s.get_num("comm_timeout_s", 600.0, f64(gt(0.0)));
  Section ck = s.child("checkpoint", Auto::reject);
  z.checkpoint_keep_last = ck.get_int("keep_last", 0, 0);
  z.checkpoint_allow_pickle = ck.get_bool("allow_pickle", false);
  ck.finish("");
  s.finish("");
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

const char* scheduler_type_name(SchedulerType t) {
  return t == SchedulerType::none ? "" : kSchedulerNames[size_t(t) - 1].c_str();
}

std::string plain_json(const std::string& json_text, const std::string& source_name) {
  std::vector<std::string> unused;
  Ctx ctx{source_name, &unused, nullptr, {}, {}};
  return parse_json_text(ctx, json_text).dump();
}

Config parse_string(const std::string& json_text, int world_size, const std::string& source_name) {
  ZERO8_CHECK_ARG(world_size >= 1, "world_size", "must be >= 1, got " << world_size);
  Config c;
  c.source = source_name;
  c.world_size = world_size;
  Ctx ctx{source_name, &c.warnings, nullptr, {}, {}};
  const json root = parse_json_text(ctx, json_text);
  NumberTextSax numbers(&ctx.number_text);
  json::sax_parse(json_text, &numbers, nlohmann::json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/true);
  if (!root.is_object()) fail_at(ctx, "", "the config must be a JSON object, got " + show(ctx, "", root));
  ctx.root = &root;
  Section top(ctx, &root, "", Auto::reject);
  parse_batch(top, world_size, c);
  parse_precision(top, c);
  parse_zero(top, c);
  parse_optimizer(top, c);
  parse_scheduler(top, c);
  parse_misc(top, c);
  parse_data_types(top, c);
  check_compute_grad_norm(top, c);
  parse_checkpoint(top, c);
  parse_zero8(top, c);
  top.finish_top();
  throw_unsupported(ctx);
  return c;
}

Config parse_file(const std::string& path, int world_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::io, path + ": cannot open the config file: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(ErrorCode::io, path + ": cannot read the config file");
  return parse_string(ss.str(), world_size, path);
}

std::string to_json(const Config& c, int indent) {
  json j;
  j["train_batch_size"] = c.batch.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.batch.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.batch.gradient_accumulation_steps;
  j["steps_per_print"] = c.steps_per_print;
  j["gradient_clipping"] = c.gradient_clipping;
  j["wall_clock_breakdown"] = c.wall_clock_breakdown;
  if (!c.managed_gradient_accumulation) j["managed_gradient_accumulation"] = false;
  j["prescale_gradients"] = c.prescale_gradients;
  j["gradient_predivide_factor"] = c.gradient_predivide_factor;
  j["zero_allow_untested_optimizer"] = c.zero_allow_untested_optimizer;
  if (c.communication_data_type != CommDataType::unset)
    j["communication_data_type"] = kDtypeNames[int(c.communication_data_type)];

  if (c.optimizer.present) {
    // The row's entries with a DeepSpeed key that carry a value (not the fixed / ignored ones), in its order.
    const OptimizerConfig& o = c.optimizer;
    const optim::AlgoSpec& row = optim::algo_spec(o.type);
    json p = json::object();
    for (int i = 0; i < row.num_hyper; ++i) {
      const optim::HyperSpec& e = row.hyper[i];
      using optim::HyperRole;
      if (!e.deepspeed || !(e.role == HyperRole::value || e.role == HyperRole::init || e.role == HyperRole::decouple))
        continue;
      const double x = o.values[size_t(i)];
      if (is_sequence_key(e.deepspeed)) {
        const std::string base = key_base(e.deepspeed);
        if (!p.contains(base)) p[base] = json::array();
        p[base].push_back(x);
      } else if (e.type == optim::HyperType::flag) {
        p[e.deepspeed] = x != 0.0;
      } else {
        p[e.deepspeed] = x;
      }
    }
    j["optimizer"] = {{"type", row.deepspeed}, {"params", p}};
  }

  const SchedulerConfig& s = c.scheduler;
  if (s.type != SchedulerType::none) {
    json p = json::object();
    const char* const warm = s.warmup_type == WarmupType::log ? "log" : "linear";
    switch (s.type) {
      case SchedulerType::warmup_lr:
      case SchedulerType::warmup_decay_lr:
        if (s.type == SchedulerType::warmup_decay_lr) p["total_num_steps"] = s.total_num_steps;
        p["warmup_min_lr"] = s.warmup_min_lr;
        // Not given for WarmupLR: left out, so the reader sees each param group ramp to its own lr.
        if (s.warmup_max_lr && (s.warmup_max_lr_given || s.type == SchedulerType::warmup_decay_lr))
          p["warmup_max_lr"] = *s.warmup_max_lr;
        p["warmup_num_steps"] = s.warmup_num_steps;
        p["warmup_type"] = warm;
        break;
      case SchedulerType::warmup_cosine_lr:
        p["total_num_steps"] = s.total_num_steps;
        p["warmup_min_ratio"] = s.warmup_min_ratio;
        p["warmup_num_steps"] = s.warmup_num_steps;
        p["cos_min_ratio"] = s.cos_min_ratio;
        p["warmup_type"] = warm;
        break;
      case SchedulerType::one_cycle:
        p["cycle_min_lr"] = s.cycle_min_lr;
        p["cycle_max_lr"] = s.cycle_max_lr;
        p["decay_lr_rate"] = s.decay_lr_rate;
        p["cycle_first_step_size"] = s.cycle_first_step_size;
        p["cycle_second_step_size"] = s.cycle_second_step_size;
        p["cycle_first_stair_count"] = s.cycle_first_stair_count;
        p["cycle_second_stair_count"] = s.cycle_second_stair_count;
        p["decay_step_size"] = s.decay_step_size;
        p["cycle_momentum"] = s.cycle_momentum;
        p["cycle_min_mom"] = s.cycle_min_mom;
        p["cycle_max_mom"] = s.cycle_max_mom;
        p["decay_mom_rate"] = s.decay_mom_rate;
        break;
      case SchedulerType::lr_range_test:
        p["lr_range_test_min_lr"] = s.lr_range_test_min_lr;
        p["lr_range_test_step_size"] = s.lr_range_test_step_size;
        p["lr_range_test_step_rate"] = s.lr_range_test_step_rate;
        p["lr_range_test_staircase"] = s.lr_range_test_staircase;
        break;
      case SchedulerType::none: break;
    }
    j["scheduler"] = {{"type", scheduler_type_name(s.type)}, {"params", p}};
  }

  const Fp16Config& f = c.fp16;
  j["fp16"] = {{"enabled", f.enabled},
               {"loss_scale", f.loss_scale},
               {"initial_scale_power", f.initial_scale_power},
               {"loss_scale_window", f.loss_scale_window},
               {"hysteresis", f.hysteresis},
               {"consecutive_hysteresis", f.consecutive_hysteresis},
               {"min_loss_scale", f.min_loss_scale},
               {"auto_cast", f.auto_cast}};
  j["bf16"] = {{"enabled", c.bf16.enabled},
               {"immediate_grad_update", c.bf16.immediate_grad_update},
               {"check_grad_overflow", c.bf16.check_grad_overflow}};
  const ZeroConfig& z = c.zero;
  j["zero_optimization"] = {{"stage", z.stage},
                            {"reduce_bucket_size", z.reduce_bucket_size},
                            {"allgather_bucket_size", z.allgather_bucket_size},
                            {"overlap_comm", z.overlap_comm},
                            {"contiguous_gradients", z.contiguous_gradients},
                            {"reduce_scatter", z.reduce_scatter},
                            {"allgather_partitions", z.allgather_partitions},
                            {"round_robin_gradients", z.round_robin_gradients},
                            {"load_from_fp32_weights", z.load_from_fp32_weights},
                            {"ignore_unused_parameters", z.ignore_unused_parameters},
                            {"parameter_alignment", z.parameter_alignment},
                            {"compute_grad_norm", z.compute_grad_norm}};
  {
    const DataTypesConfig& d = c.data_types;
    json dt = {{"keep_in_fp32_modules", d.keep_in_fp32_modules ? json(*d.keep_in_fp32_modules) : json("auto")}};
    for (const auto& [key, n] : {std::pair<const char*, CommDataType>{"grad_accum_dtype", d.grad_accum_dtype},
                                 {"param_dtype", d.param_dtype}, {"buffer_dtype", d.buffer_dtype}})
      if (n != CommDataType::unset) dt[key] = kDtypeNames[int(n)];  // unset: absent, as DeepSpeed's default
    j["data_types"] = dt;
  }
  static const char* const tag_names[] = {"Warn", "Ignore", "Fail"};
  j["checkpoint"] = {{"tag_validation", tag_names[int(c.checkpoint.tag_validation)]},
                     {"load_universal", c.checkpoint.load_universal},
                     {"use_node_local_storage", c.checkpoint.use_node_local_storage}};
  for (const auto& [key, m] : {std::pair<const char*, const MonitorOutputConfig*>{"tensorboard", &c.tensorboard},
                                {"csv_monitor", &c.csv_monitor}})
    j[key] = {{"enabled", m->enabled}, {"output_path", m->output_path}, {"job_name", m->job_name}};
  const auto opt_str = [](const std::optional<std::string>& v) { return v ? json(*v) : json(nullptr); };
  j["wandb"] = {{"enabled", c.wandb.enabled},
                {"group", opt_str(c.wandb.group)},
                {"team", opt_str(c.wandb.team)},
                {"project", c.wandb.project}};
  const Zero8Config& q = c.zero8;
  static const char* const backend_names[] = {"auto", "mpi", "single", "nccl", "tcp"};
  j["zero8"] = {{"enabled", q.enabled},
                {"state_block_size", q.state_block_size},
                {"wire_block_size", q.wire_block_size},
                {"int8_gradients", q.int8_gradients},
                {"int8_params", q.int8_params},
                {"int8_activations", q.int8_activations},
                {"queued_stage_messages", q.queued_stage_messages},
                {"error_feedback", q.error_feedback},
                {"release_gradients", q.release_gradients},
                {"overlap_param_gather", q.overlap_param_gather},
                {"min_8bit_size", q.min_8bit_size},
                {"optim_bits", q.optim_bits},
                {"stochastic_rounding", q.stochastic_rounding},
                {"seed", q.seed},
                {"comm_backend", backend_names[int(q.comm_backend)]},
                {"comm_timeout_s", q.comm_timeout_s},
                {"checkpoint", {{"keep_last", q.checkpoint_keep_last}, {"allow_pickle", q.checkpoint_allow_pickle}}}};
  return j.dump(indent);
}

// ---------------------------------------------------------------------------------------------------
// Schedules: lr_schedules.py's arithmetic, in the same order of operations (double, like Python).

namespace {

constexpr double kPi = 3.14159265358979323846;  // Python's math.pi, the same double

double need_base_lr(const SchedulerConfig& s, const char* what) {
  if (!s.base_lr)
    ZERO8_THROW(invalid_argument, what << " needs the optimizer's lr, which the config does not give (no optimizer "
                                         "section): call scheduler_set_base_lr with the client optimizer's lr");
  return *s.base_lr;
}

// WarmupLR/WarmupDecayLR/WarmupCosineLR warmup fraction for t in [0, W).
double warmup_gamma(WarmupType type, int64_t t, int64_t w) {
  if (type == WarmupType::log) {
    const double inverse_log_warm_up = 1.0 / std::log(double(w));
    return inverse_log_warm_up * std::log(double(t + 1));
  }
  return double(t) / double(w);
}

// OneCycle's position in the cycle: 0 at cycle_min, 1 at the peak.
double one_cycle_scale(const SchedulerConfig& s, int64_t t) {
  const double first = double(s.cycle_first_step_size), second = double(s.cycle_second_step_size);
  const double total = first + second;
  const double step_ratio = first / total;
  const double bi = double(t + 1);
  const double cycle = std::floor(1.0 + bi / total);
  const double x = 1.0 + bi / total - cycle;
  double scale;
  int64_t stairs;
  if (x <= step_ratio) {
    scale = x / step_ratio;
    stairs = s.cycle_first_stair_count;
  } else {
    scale = (x - 1.0) / (step_ratio - 1.0);
    stairs = s.cycle_second_stair_count;
  }
  if (stairs > 0) {
    // Stairs are counted from the integer batch offset, not from `scale`: the float scale can land just
    // under an exact stair at a half-cycle boundary.
    const double ci = std::fmod(bi, total);
    const double pos = ci <= first ? ci * double(stairs) / first : (total - ci) * double(stairs) / second;
    scale = std::floor(pos) / double(stairs);
  }
  return scale;
}

}  // namespace

double lr_at(const SchedulerConfig& s, int64_t t) {
  ZERO8_CHECK_ARG(t >= -1, "last_batch_iteration", "must be >= -1, got " << t);
  switch (s.type) {
    case SchedulerType::none: return need_base_lr(s, "the constant learning rate");
    case SchedulerType::warmup_lr:
    case SchedulerType::warmup_decay_lr: {
      if (!s.warmup_max_lr)
        ZERO8_THROW(invalid_argument, "WarmupLR: warmup_max_lr is not set and the config has no optimizer "
                                      "section to take it from: call scheduler_set_base_lr");
      const double min_lr = s.warmup_min_lr, delta = *s.warmup_max_lr - s.warmup_min_lr;
      if (t < 0) return min_lr;  // before the first step(): the minimum (lr_schedules.py warns and returns it)
      const int64_t w = std::max<int64_t>(2, s.warmup_num_steps);
      double gamma;
      if (t < w) gamma = warmup_gamma(s.warmup_type, t, w);
      else if (s.type == SchedulerType::warmup_lr) gamma = 1.0;
      else
        gamma = std::max(0.0, double(s.total_num_steps - t) /
                                  std::max(1.0, double(s.total_num_steps - w)));
      return min_lr + delta * gamma;
    }
    case SchedulerType::warmup_cosine_lr: {
      const double base = need_base_lr(s, "WarmupCosineLR");
      if (t < 0) return 0.0;  // lr_schedules.py: lr 0 before the first step()
      const int64_t w = std::max<int64_t>(2, s.warmup_num_steps);
      double ratio;
      if (t < w) {
        ratio = warmup_gamma(s.warmup_type, t, w);
        ratio = s.warmup_min_ratio + ratio * (1.0 - s.warmup_min_ratio);
      } else {
        const double real_last_step = double(t - w + 1);
        const double real_total_steps = double(std::max<int64_t>(1, s.total_num_steps - w));
        const double progress = std::min(1.0, real_last_step / real_total_steps);
        ratio = (1.0 + std::cos(kPi * progress)) / 2.0;
        ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ratio);
      }
      return base * ratio;
    }
    case SchedulerType::one_cycle: {
      const double total = double(s.cycle_first_step_size) + double(s.cycle_second_step_size);
      if (double(t) < total) return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * one_cycle_scale(s, t);
      if (s.decay_step_size == 0 || s.decay_lr_rate == 0.0) return s.cycle_min_lr;
      const double interval = (double(t) - total + 1.0) / double(s.decay_step_size);
      return s.cycle_min_lr / (1.0 + s.decay_lr_rate * interval);
    }
    case SchedulerType::lr_range_test: {
      double interval = double(t + 1) / double(s.lr_range_test_step_size);
      if (s.lr_range_test_staircase) interval = std::floor(interval);
      return s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * interval);
    }
  }
  ZERO8_ASSERT(false);
  return 0.0;
}

double momentum_at(const SchedulerConfig& s, int64_t t) {
  ZERO8_CHECK_ARG(s.type == SchedulerType::one_cycle && s.momentum_cycled, "scheduler",
                  "momentum is scheduled only by OneCycle with cycle_momentum (and an optimizer with betas)");
  ZERO8_CHECK_ARG(t >= -1, "last_batch_iteration", "must be >= -1, got " << t);
  // At construction OneCycle sets betas to (cycle_min_mom, 0.99); from the first step() on the cycle
  // starts at cycle_max_mom, the mirror image of the lr.
  if (t < 0) return s.cycle_min_mom;
  const double total = double(s.cycle_first_step_size) + double(s.cycle_second_step_size);
  if (double(t) < total) return s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * one_cycle_scale(s, t);
  if (s.decay_step_size == 0 || s.decay_mom_rate == 0.0) return s.cycle_max_mom;
  const double interval = (double(t) - total + 1.0) / double(s.decay_step_size);
  return s.cycle_max_mom * (1.0 + s.decay_mom_rate * interval);
}

void scheduler_set_base_lr(SchedulerConfig& s, double lr) {
  ZERO8_CHECK_ARG(std::isfinite(lr) && lr >= 0.0, "lr", "must be a finite number >= 0, got " << lr);
  if (s.base_lr) return;
  s.base_lr = lr;
  if (s.type == SchedulerType::warmup_lr && !s.warmup_max_lr) s.warmup_max_lr = lr;
}

// ---------------------------------------------------------------------------------------------------
// Mappings.

OptimizerConfig::OptimizerConfig(optim::Algo t) : type(t) {
  const optim::AlgoSpec& row = optim::algo_spec(t);
  for (int i = 0; i < row.num_hyper; ++i) values[size_t(i)] = row.hyper[i].ds_default;
}

double OptimizerConfig::get(const std::string& key) const {
  const optim::AlgoSpec& row = optim::algo_spec(type);
  for (int i = 0; i < row.num_hyper; ++i) {
    const optim::HyperSpec& e = row.hyper[i];
    if (key == e.key || (e.deepspeed && key == e.deepspeed)) return values[size_t(i)];
  }
  ZERO8_THROW(invalid_argument, "optimizer " << row.name << " has no parameter '" << key << "'");
}

bool optimizer_has_betas(optim::Algo type) {
  const optim::AlgoSpec& row = optim::algo_spec(type);
  for (int i = 0; i < row.num_hyper; ++i)
    if (row.hyper[i].deepspeed && key_base(row.hyper[i].deepspeed) == "betas") return true;
  return false;
}

optim::Algo optimizer_algo(const OptimizerConfig& o) {
  const optim::AlgoSpec& row = optim::algo_spec(o.type);
  for (int i = 0; i < row.num_hyper; ++i)
    if (row.hyper[i].role == optim::HyperRole::decouple && o.values[size_t(i)] != 0.0) return row.decoupled;
  return row.algo;
}

optim::Hyper optimizer_hyper(const OptimizerConfig& o) {
  const optim::AlgoSpec& row = optim::algo_spec(o.type);
  optim::Hyper h;
  for (int i = 0; i < row.num_hyper; ++i) {
    const optim::HyperSpec& e = row.hyper[i];
    if (e.role == optim::HyperRole::value || e.role == optim::HyperRole::init)
      optim::hyper_set(h, e.field, o.values[size_t(i)]);
  }
  return h;
}

int optimizer_state_bits(const Config& c) { return c.zero8.enabled ? c.zero8.optim_bits : 32; }

std::string optimizer_display_name(const Config& c) {
  if (!c.optimizer.present) return "";
  // bitsandbytes' class names (Adam8bit, LAMB8bit, ...), from the algorithm actually run.
  return std::string(optim::algo_spec(optimizer_algo(c.optimizer)).class_name) +
         std::to_string(optimizer_state_bits(c)) + "bit";
}

LossScalerConfig loss_scaler_config(const Config& c) {
  LossScalerConfig l;
  if (!c.fp16.enabled) {
    l.dynamic = false;
    l.static_scale = 1.0;
    return l;
  }
  const Fp16Config& f = c.fp16;
  l.dynamic = f.loss_scale == 0.0;
  l.static_scale = l.dynamic ? 1.0 : f.loss_scale;
  l.initial_scale_power = f.initial_scale_power;
  l.scale_window = f.loss_scale_window;
  l.hysteresis = f.hysteresis;
  l.consecutive_hysteresis = f.consecutive_hysteresis;
  // min_loss_scale 0 is DeepSpeed's max(scale / 2, 0): no floor. The scaler wants a positive floor;
  // the smallest positive double is one no halving from 2^initial_scale_power reaches in practice.
  l.min_scale = f.min_loss_scale > 0.0 ? f.min_loss_scale : std::numeric_limits<double>::denorm_min();
  return l;
}

DType working_dtype(const Config& c) {
  return c.fp16.enabled ? DType::f16 : c.bf16.enabled ? DType::bf16 : DType::f32;
}

shard::LayoutConfig layout_config(const Config& c) {
  shard::LayoutConfig l;
  l.world = c.world_size;
  l.state_block = c.zero8.state_block_size;
  l.wire_block = c.zero8.wire_block_size;
  l.min_8bit_size = c.zero8.min_8bit_size;
  return l;
}

}  // namespace zero8::config
