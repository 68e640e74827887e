#include "meshtrain/train/data.h"

#include "meshtrain/util/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace meshtrain::train {

namespace {

constexpr char kMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t count;
  uint64_t vocab_size;
};
static_assert(sizeof(Header) == kHeaderBytes, "token file header must be 32 bytes");

}  // namespace

std::vector<uint16_t> ByteTokenizer::encode(const std::string& text) {
  std::vector<uint16_t> tokens(text.size());
  std::transform(text.begin(), text.end(), tokens.begin(), [](char c) { return static_cast<unsigned char>(c); });
  return tokens;
}

std::string ByteTokenizer::decode(const at::Tensor& tokens) {
  const at::Tensor flat = tokens.to(at::kLong).contiguous().view({-1});
  std::string text(flat.numel(), '\0');
  const int64_t* data = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) text[i] = static_cast<char>(data[i] & 0xff);
  return text;
}

int token_bytes_for(int64_t vocab_size) {
  if (vocab_size <= (int64_t{1} << 8)) return 1;
  if (vocab_size <= (int64_t{1} << 16)) return 2;
  if (vocab_size <= (int64_t{1} << 32)) return 4;
  return 8;
}

std::string companion_path(const std::string& token_path, const std::string& suffix) {
  const size_t n = token_path.size();
  if (n > 4 && token_path.compare(n - 4, 4, ".bin") == 0) return token_path.substr(0, n - 3) + suffix;
  return token_path + "." + suffix;
}

TokenWriter::TokenWriter(std::string path, int64_t vocab_size)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), vocab_size_(vocab_size), bytes_(token_bytes_for(vocab_size)) {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (!file_) throw DataError("cannot write " + tmp_ + " (" + std::strerror(errno) + ")");
  const Header placeholder{};
  if (std::fwrite(&placeholder, sizeof placeholder, 1, file_) != 1) {
    std::fclose(file_);
    std::remove(tmp_.c_str());
    file_ = nullptr;
    throw DataError("writing " + tmp_ + " failed (" + std::strerror(errno) + ")");
  }
  buffer_.reserve(1 << 20);
}

TokenWriter::~TokenWriter() {
  if (!file_) return;
  std::fclose(file_);
  std::remove(tmp_.c_str());
}

void TokenWriter::append(const int64_t* ids, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size_) {
      throw DataError("writing " + path_ + ": value " + std::to_string(ids[i]) + " is outside [0, " +
                      std::to_string(vocab_size_) + ")");
    }
    const uint64_t v = static_cast<uint64_t>(ids[i]);
    for (int b = 0; b < bytes_; ++b) buffer_.push_back(static_cast<unsigned char>(v >> (8 * b)));  // little-endian
    if (buffer_.size() >= (1u << 20)) flush();
  }
  count_ += count;
}

void TokenWriter::flush() {
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size()) {
    throw DataError("writing " + tmp_ + " failed (" + std::strerror(errno) + "; disk full?)");
  }
  buffer_.clear();
}

void TokenWriter::finish() {
  flush();
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof kMagic);
  header.version = kVersion;
  header.token_bytes = static_cast<uint32_t>(bytes_);
  header.count = static_cast<uint64_t>(count_);
  header.vocab_size = static_cast<uint64_t>(vocab_size_);
  if (std::fseek(file_, 0, SEEK_SET) != 0 || std::fwrite(&header, sizeof header, 1, file_) != 1 ||
      std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) {
    throw DataError("writing " + tmp_ + " failed (" + std::strerror(errno) + "; disk full?)");
  }
  std::fclose(file_);
  file_ = nullptr;
  util::rename_path(tmp_, path_);
}

void write_token_file(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size) {
  TokenWriter writer(path, vocab_size);
  writer.append(tokens);
  writer.finish();
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, int64_t vocab_size) {
  write_token_file(path, std::vector<int64_t>(tokens.begin(), tokens.end()), vocab_size);
}

TokenFile::TokenFile(std::string path) : path_(std::move(path)) {
  struct stat info {};
  if (stat(path_.c_str(), &info) != 0) {
    data_error(path_, "does not exist; create it with `meshtrain prepare TEXT_FILES... --out DIR`");
  }
  if (!S_ISREG(info.st_mode)) data_error(path_, "is not a regular file");
  if (info.st_size == 0) data_error(path_, "is empty; create it with `meshtrain prepare`");
  if (static_cast<size_t>(info.st_size) < kHeaderBytes) {
    data_error(path_, "is " + std::to_string(info.st_size) + " bytes, shorter than the 32-byte token file header");
  }
  const int fd = open(path_.c_str(), O_RDONLY);
  if (fd < 0) data_error(path_, std::string("cannot be opened (") + std::strerror(errno) + ")");
  map_bytes_ = static_cast<size_t>(info.st_size);
  map_ = mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    data_error(path_, std::string("cannot be mapped (") + std::strerror(errno) + ")");
  }
  try {  // a file refused is unmapped
    Header header;
    std::memcpy(&header, map_, sizeof header);
    if (std::memcmp(header.magic, kMagic, sizeof kMagic) != 0) {
      data_error(path_, "is not a meshtrain token file (no MTTOKENS header); turn text into one with "
                        "`meshtrain prepare " + path_ + " --out DIR`");
    }
    if (header.version != kVersion) {
      data_error(path_, "has token file version " + std::to_string(header.version) + "; this meshtrain reads version " +
                            std::to_string(kVersion));
    }
    if (header.token_bytes != 1 && header.token_bytes != 2 && header.token_bytes != 4 && header.token_bytes != 8) {
      data_error(path_, "declares " + std::to_string(header.token_bytes) + " bytes per token (1, 2, 4 or 8 allowed)");
    }
    const uint64_t expected = kHeaderBytes + header.count * header.token_bytes;
    if (expected != map_bytes_) {
      data_error(path_, "is truncated or padded: the header promises " + std::to_string(header.count) + " tokens (" +
                            std::to_string(expected) + " bytes) but the file has " + std::to_string(map_bytes_) +
                            " bytes; prepare it again");
    }
    count_ = static_cast<int64_t>(header.count);
    vocab_size_ = static_cast<int64_t>(header.vocab_size);
    token_bytes_ = static_cast<int>(header.token_bytes);
    tokens_ = static_cast<const unsigned char*>(map_) + kHeaderBytes;
    if (count_ == 0) data_error(path_, "holds no tokens");
  } catch (...) {
    munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

TokenFile::~TokenFile() {
  if (map_) munmap(map_, map_bytes_);
}

at::Tensor TokenFile::slice(int64_t offset, int64_t length) const {
  TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= count_, "token slice out of range");
  const auto dtype = token_bytes_ == 1 ? at::kByte : token_bytes_ == 2 ? at::kShort : token_bytes_ == 4 ? at::kInt : at::kLong;
  // Read-only view of the mapping, converted (copied) to int64.
  at::Tensor view = at::from_blob(const_cast<unsigned char*>(tokens_ + offset * token_bytes_), {length},
                                  at::TensorOptions().dtype(dtype));
  at::Tensor result = view.to(at::kLong);
  if (token_bytes_ == 2) result = result.bitwise_and(0xffff);  // stored unsigned
  if (token_bytes_ == 4) result = result.bitwise_and(0xffffffffLL);
  return result;
}

int64_t TokenFile::at(int64_t index) const {
  TORCH_CHECK_INDEX(index >= 0 && index < count_, "token index out of range");
  uint64_t v = 0;
  std::memcpy(&v, tokens_ + index * token_bytes_, token_bytes_);  // little-endian host
  return static_cast<int64_t>(v);
}

TokenDataset::TokenDataset(const std::string& token_path) : tokens_(token_path) {
  const std::string index = companion_path(token_path, "idx"), mask = companion_path(token_path, "mask");
  if (util::path_exists(index)) {
    index_ = std::make_unique<TokenFile>(index);
    if (index_->size() < 2 || index_->at(index_->size() - 1) != tokens_.size() || index_->at(0) != 0) {
      data_error(index, "is not the document index of " + token_path + " (prepare it again)");
    }
  }
  if (util::path_exists(mask)) {
    mask_ = std::make_unique<TokenFile>(mask);
    if (mask_->size() != tokens_.size()) {
      data_error(mask, "holds " + std::to_string(mask_->size()) + " flags for " + std::to_string(tokens_.size()) +
                           " tokens of " + token_path + " (prepare it again)");
    }
  }
}

int64_t TokenDataset::documents() const { return index_ ? index_->size() - 1 : 1; }

int64_t TokenDataset::document_of(int64_t token) const {
  if (!index_) return 0;
  int64_t lo = 0, hi = documents() - 1;  // the last document whose start is <= token
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (index_->at(mid) <= token) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

std::pair<int64_t, int64_t> TokenDataset::document(int64_t i) const {
  if (!index_) return {0, tokens_.size()};
  return {index_->at(i), index_->at(i + 1)};
}

}  // namespace meshtrain::train
