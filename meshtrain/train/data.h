// Training data: a byte-level tokenizer, memory-mapped token files with a small
// header, `prepare` (text files -> train/val token files), and the sampler that
// gives each data-parallel rank its disjoint share of every global batch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::train {

// Bad input data: the message names the file and what is wrong with it.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bytes are tokens: vocabulary 256, lossless for any text.
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  static std::vector<uint16_t> encode(const std::string& text);
  static std::string decode(const at::Tensor& tokens);  // any integer tensor
};

// Token file layout (little-endian): a 32-byte header — magic "MTTOKENS",
// uint32 version (1), uint32 bytes per token (1, 2 or 4), uint64 token count,
// uint64 vocabulary size — followed by the tokens.
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, int64_t vocab_size);

class TokenFile {
 public:
  // Maps the file read-only; throws DataError naming the file when it is
  // missing, empty, not a token file, of another version, or truncated.
  explicit TokenFile(std::string path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }  // tokens
  int64_t vocab_size() const { return vocab_size_; }
  // Tokens [offset, offset + length) as int64.
  at::Tensor slice(int64_t offset, int64_t length) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  int token_bytes_ = 0;
};

struct PrepareResult {
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0;
  std::vector<std::string> sources;  // the text files read, in order
};

// Tokenises the text files (directories: every regular file in them, sorted;
// the same file reached twice is read once) and writes train.bin and val.bin to
// `out_dir`; the last `val_fraction` of the tokens is validation data.
// `tokenizer`: text::load_tokenizer's spec ("bytes" by default).
PrepareResult prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                      const std::string& tokenizer = "bytes");

// Note [Sampler]
// A token file of N tokens holds W = (N - 1) / T windows of T + 1 tokens at
// stride T (input = first T, target = last T). The stream of windows is every
// window once per epoch, in an order shuffled from (seed, epoch); the global
// batch of step s is stream positions [s·B, (s+1)·B). Data-parallel rank r of d,
// at accumulation micro-step a with micro-batch m, takes positions
// s·B + (a·d + r)·m .. + m, so ranks read disjoint rows whose union is exactly
// what one process reads with the same global batch. The cursor (a stream
// position) is all that is needed to resume.
class Sampler {
 public:
  Sampler(const TokenFile& file, int64_t context, uint64_t seed, bool shuffle = true);
  int64_t windows() const { return windows_; }
  // Inputs and targets [rows, context] for stream positions [cursor, cursor + rows).
  std::pair<at::Tensor, at::Tensor> rows(int64_t cursor, int64_t rows);

 private:
  int64_t window_at(int64_t position);

  const TokenFile& file_;
  int64_t context_;
  uint64_t seed_;
  bool shuffle_;
  int64_t windows_;
  int64_t cached_epoch_ = -1;
  at::Tensor order_;  // permutation for cached_epoch_
};

}  // namespace meshtrain::train
