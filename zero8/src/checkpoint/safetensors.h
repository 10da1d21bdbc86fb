// safetensors files (https://github.com/huggingface/safetensors: u64 LE header length, a JSON header
// padded with spaces to 8 bytes, the tensors' bytes without gaps), as a checkpoint's model files and the
// fp32 export use them: the writer, and a parser that checks every header entry against the file.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/io.h"
#include "zero8/checkpoint.h"

namespace zero8::ckpt::detail {

// The safetensors dtype of a working dtype: F32, BF16, F16.
const char* safetensors_dtype(DType t);
// Bytes per element of a safetensors dtype this format stores (the module's other state_dict entries
// may be of any of these: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL); 0 for any other.
int st_dtype_size(const std::string& d);
std::string shape_text(const std::vector<int64_t>& s);  // "[3, 11]"

// One tensor of a safetensors file being written: its header entry and its bytes (data may be null
// for safetensors_header_write, which writes the header only).
struct SafetensorsTensor {
  const std::string& name;
  const std::string& dtype;
  const std::vector<int64_t>& shape;
  const void* data;
  int64_t bytes;
};
using SafetensorsMetadata = std::vector<std::pair<std::string, std::string>>;

// The head of a safetensors file: header length, then the JSON header (the metadata, then each tensor's
// dtype, shape and data offsets, the tensors in the given order). The tensors' bytes follow it.
void safetensors_header_write(FileWriter& w, const SafetensorsMetadata& metadata,
                              const std::vector<SafetensorsTensor>& tensors);
// Appends the bytes of tensor `index` (its SafetensorsTensor::bytes of them) to the file being written.
using SafetensorsData = std::function<void(FileWriter& w, size_t index)>;
// The file <tmp>/<name> of a tag (metadata: format pt, zero8_tag, zero8_step), written and synced; each
// tensor's bytes come from its data pointer, or from `data` when given (then the pointers are not read).
FileInfo safetensors_write(const std::string& tmp, const char* name, const char* role, const std::string& tag,
                           int64_t step, const std::vector<SafetensorsTensor>& tensors,
                           const SafetensorsData& data = {});

struct SafetensorsEntry {
  std::string dtype;  // safetensors name (F32, BF16, I64, ...)
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // relative to the data start
};

struct Safetensors {
  int64_t data_start = 0;
  std::map<std::string, SafetensorsEntry> tensors;
};

// The header of the file r reads, checked: valid JSON, known dtypes, sizes that match the shapes, and
// data offsets that tile the data exactly. Throws Error(io) naming the file.
Safetensors safetensors_parse(const FileReader& r);

}  // namespace zero8::ckpt::detail
