// The safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data. https://huggingface.co/docs/safetensors
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::interop {

class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SafetensorsFile {
 public:
  // Reads and checks the header (every range inside the file, no overlap);
  // throws FormatError naming the file and what is wrong.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  at::Tensor read(const std::string& name) const;  // in its stored dtype
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t begin, end;  // bytes after the header
  };
  std::string path_;
  int fd_ = -1;
  int64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (in their dtypes, made contiguous) with `metadata` to
// `path` atomically (a temporary file renamed). Throws FormatError on an
// unsupported dtype or a write failure.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// "F32", "BF16", ... <-> at::ScalarType.
std::string dtype_name(at::ScalarType type);
at::ScalarType dtype_of(const std::string& name);

}  // namespace meshtrain::interop
