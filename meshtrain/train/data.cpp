#include "meshtrain/train/data.h"

#include "meshtrain/text/tokenizer.h"

#include "meshtrain/util/files.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

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

[[noreturn]] void data_error(const std::string& path, const std::string& what) {
  throw DataError("data file " + path + ": " + what);
}

std::string read_text(const std::string& path) {
  try {
    return util::read_text_file(path);
  } catch (const std::runtime_error& e) {
    throw DataError(std::string("input ") + e.what());
  }
}

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

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, int64_t vocab_size) {
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof kMagic);
  header.version = kVersion;
  header.token_bytes = vocab_size <= 256 ? 1 : 2;
  header.count = tokens.size();
  header.vocab_size = static_cast<uint64_t>(vocab_size);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw DataError("cannot write " + tmp + " (" + std::strerror(errno) + ")");
    out.write(reinterpret_cast<const char*>(&header), sizeof header);
    if (header.token_bytes == 1) {
      std::vector<uint8_t> bytes(tokens.begin(), tokens.end());
      out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    } else {
      out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
    }
    if (!out) throw DataError("writing " + tmp + " failed (disk full?)");
  }
  util::rename_path(tmp, path);
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
  if (header.token_bytes != 1 && header.token_bytes != 2 && header.token_bytes != 4) {
    data_error(path_, "declares " + std::to_string(header.token_bytes) + " bytes per token (1, 2 or 4 allowed)");
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
}

TokenFile::~TokenFile() {
  if (map_) munmap(map_, map_bytes_);
}

at::Tensor TokenFile::slice(int64_t offset, int64_t length) const {
  TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= count_, "token slice out of range");
  const auto dtype = token_bytes_ == 1 ? at::kByte : token_bytes_ == 2 ? at::kShort : at::kInt;
  // Read-only view of the mapping, converted (copied) to int64.
  at::Tensor view = at::from_blob(const_cast<unsigned char*>(tokens_ + offset * token_bytes_), {length},
                                  at::TensorOptions().dtype(dtype));
  at::Tensor result = view.to(at::kLong);
  if (token_bytes_ == 2) result = result.bitwise_and(0xffff);  // stored unsigned
  return result;
}

PrepareResult prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                      const std::string& tokenizer_spec) {
  if (inputs.empty()) throw DataError("prepare: name at least one text file or directory");
  if (!(val_fraction > 0.0 && val_fraction < 1.0)) {
    throw DataError("prepare: the validation fraction must be in (0, 1), got " + std::to_string(val_fraction));
  }
  PrepareResult result;
  std::set<std::string> seen;
  auto add = [&](const std::string& file) {
    if (seen.insert(util::canonical_path(file)).second) result.sources.push_back(file);
  };
  for (const std::string& input : inputs) {
    if (!util::path_exists(input)) throw DataError("input " + input + ": does not exist");
    if (util::is_directory(input)) {
      std::vector<std::string> files;
      for (const std::string& name : util::list_directory(input)) {
        if (util::is_regular_file(util::join_path(input, name))) files.push_back(util::join_path(input, name));
      }
      if (files.empty()) throw DataError("input " + input + ": the directory holds no files");
      for (const auto& f : files) add(f);
    } else {
      add(input);
    }
  }
  std::string text;
  for (const std::string& source : result.sources) text += read_text(source);
  if (text.empty()) throw DataError("input " + inputs.front() + (inputs.size() > 1 ? " and the others" : "") + ": empty, no text to train on");
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::vector<int64_t> ids;
  try {
    tokenizer = text::load_tokenizer(tokenizer_spec);
    ids = tokenizer->encode(text);
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("tokenizer: ") + e.what());
  }
  if (tokenizer->vocab_size() > 65536) {
    throw DataError("tokenizer " + tokenizer->describe() + ": token files hold at most 65536 distinct tokens");
  }
  const std::vector<uint16_t> tokens(ids.begin(), ids.end());
  const int64_t vocab = tokenizer->vocab_size();
  const auto val_tokens = static_cast<int64_t>(std::ceil(tokens.size() * val_fraction));
  const int64_t train_tokens = static_cast<int64_t>(tokens.size()) - val_tokens;
  if (train_tokens < 2 || val_tokens < 2) {
    throw DataError("input: " + std::to_string(tokens.size()) + " tokens are too few to split into training and validation data");
  }
  util::make_directories(out_dir);
  result.train_path = util::join_path(out_dir, "train.bin");
  result.val_path = util::join_path(out_dir, "val.bin");
  write_token_file(result.train_path, std::vector<uint16_t>(tokens.begin(), tokens.begin() + train_tokens), vocab);
  write_token_file(result.val_path, std::vector<uint16_t>(tokens.begin() + train_tokens, tokens.end()), vocab);
  result.train_tokens = train_tokens;
  result.val_tokens = val_tokens;
  return result;
}

Sampler::Sampler(const TokenFile& file, int64_t context, uint64_t seed, bool shuffle)
    : file_(file), context_(context), seed_(seed), shuffle_(shuffle), windows_((file.size() - 1) / context) {
  if (file.size() < context + 1) {
    throw DataError("data file " + file.path() + ": has " + std::to_string(file.size()) +
                    " tokens, fewer than one sequence needs (model.context + 1 = " + std::to_string(context + 1) +
                    "); use more text or a shorter context");
  }
}

int64_t Sampler::window_at(int64_t position) {
  const int64_t epoch = position / windows_;
  const int64_t index = position % windows_;
  if (!shuffle_) return index;
  if (epoch != cached_epoch_) {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003ULL + epoch);
    order_ = at::randperm(windows_, generator, at::kLong);
    cached_epoch_ = epoch;
  }
  return order_.data_ptr<int64_t>()[index];
}

std::pair<at::Tensor, at::Tensor> Sampler::rows(int64_t cursor, int64_t rows) {
  std::vector<at::Tensor> windows;
  windows.reserve(rows);
  for (int64_t i = 0; i < rows; ++i) windows.push_back(file_.slice(window_at(cursor + i) * context_, context_ + 1));
  const at::Tensor batch = at::stack(windows);
  return {batch.narrow(1, 0, context_).contiguous(), batch.narrow(1, 1, context_).contiguous()};
}

}  // namespace meshtrain::train
