// safetensors files of checkpoints (safetensors.h): the writer of the model files and the export, and
// the checked parser that load, verify and export read them with.
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace zero8::ckpt::detail {

using json = nlohmann::ordered_json;

const char* safetensors_dtype(DType t) { return t == DType::f32 ? "F32" : t == DType::bf16 ? "BF16" : "F16"; }

int st_dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                   {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U64", 8},  {"U32", 4},
                                                   {"U16", 2}, {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

void safetensors_header_write(FileWriter& w, const SafetensorsMetadata& metadata,
                              const std::vector<SafetensorsTensor>& tensors) {
  json h;
  json& meta = h["__metadata__"] = json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
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

FileInfo safetensors_write(const std::string& tmp, const char* name, const char* role, const std::string& tag,
                           int64_t step, const std::vector<SafetensorsTensor>& tensors, const SafetensorsData& data) {
  FileInfo fi;
  fi.name = name;
  fi.role = role;
  FileWriter w(join(tmp, fi.name), true);
  safetensors_header_write(w, {{"format", "pt"}, {"zero8_tag", tag}, {"zero8_step", std::to_string(step)}}, tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t before = w.offset();
    if (data) data(w, i);
    else w.write(tensors[i].data, tensors[i].bytes);
    ZERO8_ASSERT(w.offset() - before == tensors[i].bytes);
  }
  w.finish();
  fi.bytes = w.offset();
  fi.xxh3 = w.digest();
  return fi;
}

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
    // Element and byte counts in int64_t: a shape whose product does not fit cannot match the file.
    int64_t n = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) CKPT_FAIL(r.path(), what + ": bad shape");
      e.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(n, e.shape.back(), &n))
        CKPT_FAIL(r.path(), what + ": bad shape (more than 2^63 elements)");
    }
    int64_t bytes = 0;
    if (__builtin_mul_overflow(n, int64_t(st_dtype_size(e.dtype)), &bytes))
      CKPT_FAIL(r.path(), what + ": bad shape " + shape_text(e.shape) + " (more than 2^63 bytes)");
    if (!t.contains("data_offsets") || !t["data_offsets"].is_array() || t["data_offsets"].size() != 2 ||
        !t["data_offsets"][0].is_number_integer() || !t["data_offsets"][1].is_number_integer())
      CKPT_FAIL(r.path(), what + ": missing data_offsets");
    e.begin = t["data_offsets"][0].get<int64_t>();
    e.end = t["data_offsets"][1].get<int64_t>();
    if (e.begin < 0 || e.end < e.begin || e.end > data)
      CKPT_FAIL(r.path(), what + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                            ") outside the " + std::to_string(data) + " data bytes");
    if (e.end - e.begin != bytes)
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

}  // namespace zero8::ckpt::detail
