#include "meshtrain/interop/safetensors.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace meshtrain::interop {

namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtypes() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
      {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool}};
  return table;
}

void read_exactly(int fd, void* out, int64_t bytes, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = pread(fd, p, static_cast<size_t>(bytes), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw FormatError(path + ": cannot read " + std::to_string(bytes) + " bytes at " + std::to_string(offset));
    p += n, bytes -= n, offset += n;
  }
}

}  // namespace

std::string dtype_name(at::ScalarType type) {
  for (const auto& [name, t] : dtypes()) {
    if (t == type) return name;
  }
  throw FormatError(std::string("safetensors has no dtype for ") + c10::toString(type));
}

at::ScalarType dtype_of(const std::string& name) {
  for (const auto& [n, t] : dtypes()) {
    if (n == name) return t;
  }
  throw FormatError("unsupported safetensors dtype \"" + name + "\"");
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw FormatError(path_ + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  fstat(fd_, &st);
  const int64_t size = st.st_size;
  try {
    if (size < 8) throw FormatError(path_ + ": " + std::to_string(size) + " bytes is too short for a safetensors file");
    uint64_t header_bytes = 0;
    read_exactly(fd_, &header_bytes, 8, 0, path_);
    if (header_bytes > static_cast<uint64_t>(size - 8) || header_bytes > (uint64_t{100} << 20)) {
      throw FormatError(path_ + ": header length " + std::to_string(header_bytes) + " does not fit the file (" +
                        std::to_string(size) + " bytes); not a safetensors file?");
    }
    std::string header(header_bytes, '\0');
    read_exactly(fd_, header.data(), static_cast<int64_t>(header_bytes), 8, path_);
    data_start_ = 8 + static_cast<int64_t>(header_bytes);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(header);
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(path_ + ": the header is not JSON (" + e.what() + ")");
    }
    if (!j.is_object()) throw FormatError(path_ + ": the header is not a JSON object");
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
        }
        continue;
      }
      try {
        Entry e;
        e.dtype = dtype_of(it->at("dtype").get<std::string>());
        e.shape = it->at("shape").get<std::vector<int64_t>>();
        const auto offsets = it->at("data_offsets").get<std::vector<int64_t>>();
        if (offsets.size() != 2) throw FormatError("data_offsets must be [begin, end]");
        e.begin = offsets[0], e.end = offsets[1];
        int64_t numel = 1;
        for (int64_t d : e.shape) {
          if (d < 0) throw FormatError("a negative dimension");
          numel *= d;
        }
        if (e.begin < 0 || e.end < e.begin || data_start_ + e.end > size) throw FormatError("its bytes lie outside the file");
        if (e.end - e.begin != numel * static_cast<int64_t>(c10::elementSize(e.dtype))) {
          throw FormatError(std::to_string(e.end - e.begin) + " bytes for " + std::to_string(numel) + " elements");
        }
        ranges.emplace_back(e.begin, e.end);
        entries_[it.key()] = e;
      } catch (const nlohmann::json::exception& e) {
        throw FormatError(path_ + ": tensor \"" + it.key() + "\": " + e.what());
      } catch (const FormatError& e) {
        throw FormatError(path_ + ": tensor \"" + it.key() + "\": " + e.what());
      }
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) {
      if (ranges[i].first < ranges[i - 1].second) throw FormatError(path_ + ": two tensors' bytes overlap");
    }
  } catch (...) {
    close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) close(fd_);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw FormatError(path_ + ": no tensor \"" + name + "\"");
  const Entry& e = it->second;
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read_exactly(fd_, out.data_ptr(), e.end - e.begin, data_start_ + e.begin, path_);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor.contiguous().cpu();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header[name] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::string temporary = path + ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const at::Tensor& t : data) {
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
    }
    out.flush();
    if (!out) throw FormatError(path + ": cannot write (disk full or no permission?)");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    throw FormatError(path + ": cannot rename the written file into place (" + std::strerror(errno) + ")");
  }
}

}  // namespace meshtrain::interop
