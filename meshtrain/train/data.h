// Training data: a byte-level tokenizer, memory-mapped token files with a small
// header (and their companions: a document index and a loss mask), and the
// sampler that gives each data-parallel rank its disjoint share of every global
// batch. `prepare` (sources -> token files) is prepare.h.
#pragma once

#include "meshtrain/model/batch.h"
#include "meshtrain/train/data_error.h"
#include "meshtrain/train/data_options.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::train {

// Bytes are tokens: vocabulary 256, lossless for any text.
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  static std::vector<uint16_t> encode(const std::string& text);
  static std::string decode(const at::Tensor& tokens);  // any integer tensor
};

// Token file layout (little-endian): a 32-byte header — magic "MTTOKENS",
// uint32 version (1), uint32 bytes per token (1, 2, 4 or 8), uint64 token
// count, uint64 vocabulary size — followed by the tokens, unsigned. Tokens take
// the fewest bytes their vocabulary allows (Llama 3's 128,256 ids take 4).
// The same layout holds a prepared dataset's companions (Note [Prepared data]):
// NAME.idx, the start of every document and then the token count (8 bytes
// each, "vocabulary" the token count + 1), and NAME.mask, one byte per token,
// 1 where predicting that token counts toward the loss ("vocabulary" 2).
int token_bytes_for(int64_t vocab_size);
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, int64_t vocab_size);
void write_token_file(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size);
// NAME.bin's companion NAME.SUFFIX ("idx", "mask"); other names get ".SUFFIX" appended.
std::string companion_path(const std::string& token_path, const std::string& suffix);

// Writes a token file as the tokens come: memory stays bounded however many.
// Nothing is visible at `path` until finish() renames the whole file there.
class TokenWriter {
 public:
  TokenWriter(std::string path, int64_t vocab_size);
  ~TokenWriter();  // an unfinished file is removed
  TokenWriter(const TokenWriter&) = delete;
  TokenWriter& operator=(const TokenWriter&) = delete;
  void append(const int64_t* ids, int64_t count);
  void append(const std::vector<int64_t>& ids) { append(ids.data(), static_cast<int64_t>(ids.size())); }
  int64_t count() const { return count_; }
  void finish();

 private:
  void flush();
  std::string path_, tmp_;
  int64_t vocab_size_;
  int bytes_;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
  int64_t count_ = 0;
};

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
  int64_t at(int64_t index) const;  // one token, unchecked beyond a debug assertion

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  int token_bytes_ = 0;
};

// A prepared dataset: its token file and, when prepare wrote them, the
// document index and the loss mask beside it. Throws DataError.
class TokenDataset {
 public:
  explicit TokenDataset(const std::string& token_path);
  const TokenFile& tokens() const { return tokens_; }
  const TokenFile* mask() const { return mask_.get(); }
  bool has_index() const { return index_ != nullptr; }
  int64_t documents() const;  // 1 without an index
  std::pair<int64_t, int64_t> document(int64_t i) const;  // tokens [begin, end)
  int64_t document_of(int64_t token) const;  // the document holding token `token`

 private:
  TokenFile tokens_;
  std::unique_ptr<TokenFile> index_, mask_;
};

struct SamplerSource {
  const TokenFile* tokens = nullptr;
  const TokenFile* mask = nullptr;  // none: every target counts
  const TokenDataset* dataset = nullptr;  // Packing::kPadded reads its documents
  double weight = 1;
};

using model::kIgnoredTarget;  // a target that counts toward no loss (model/batch.h)

// Note [Sampler]
// A token file of N tokens holds W = (N - 1) / T windows of T + 1 tokens at
// stride T (input = first T, target = last T). The stream of windows is every
// window once per epoch, in an order shuffled from (seed, epoch); the global
// batch of step s is stream positions [s·B, (s+1)·B). Data-parallel rank r of d,
// at accumulation micro-step a with micro-batch m, takes positions
// s·B + (a·d + r)·m .. + m, so ranks read disjoint rows whose union is exactly
// what one process reads with the same global batch. The cursor (a stream
// position) is all that is needed to resume.
//
// Several sources (a mixture) each have their own window stream; stream
// position p goes to the source whose share so far falls furthest below its
// weight (ties to the first), so every prefix of the stream holds each source
// within one window of its proportion, and the choice depends on p alone.
class Sampler {
 public:
  Sampler(const TokenFile& file, int64_t context, uint64_t seed, bool shuffle = true);
  Sampler(std::vector<SamplerSource> sources, int64_t context, uint64_t seed, bool shuffle, Packing packing,
          int64_t pad_id = 0);
  int64_t windows() const;  // of the first source
  // Inputs and targets [rows, context] for stream positions [cursor, cursor +
  // rows); a target that counts toward no loss (masked, padding) is kIgnoredTarget.
  std::pair<at::Tensor, at::Tensor> rows(int64_t cursor, int64_t rows);
  // Whether some targets may be ignored: then losses are weighted by counted_targets.
  bool ignores_targets() const;
  // The targets of those rows that count toward the loss.
  int64_t counted_targets(int64_t cursor, int64_t rows);
  // Packing::kPacked: each input token's position inside its document
  // [rows, context] (Note [Batch]); undefined otherwise.
  at::Tensor positions(int64_t cursor, int64_t rows);
  // The source of each of the stream positions [cursor, cursor + rows).
  std::vector<int> sources_of(int64_t cursor, int64_t rows);

 private:
  struct Stream {
    SamplerSource source;
    int64_t windows = 0;
    int64_t cached_epoch = -1;
    at::Tensor order;  // permutation for cached_epoch
  };
  std::pair<int, int64_t> locate(int64_t position);  // (source, its stream position)
  // f(row, its source's stream, its window) for stream positions [cursor, cursor + rows).
  void each_window(int64_t cursor, int64_t rows, const std::function<void(int64_t, const Stream&, int64_t)>& f);
  int64_t window_at(Stream& stream, int s, int64_t position);
  void window(const Stream& stream, int64_t w, int64_t* input, int64_t* target) const;
  // Which of window w's context + 1 tokens start a document (packed rows).
  std::vector<bool> document_starts(const Stream& stream, int64_t w) const;

  std::vector<Stream> streams_;
  int64_t context_;
  uint64_t seed_;
  bool shuffle_;
  Packing packing_;
  int64_t pad_id_;
  // The mixture's state after blended_ positions: how many each source had;
  // and the state at the first position of the last call, to go back to.
  int64_t blended_ = 0, anchor_ = 0;
  std::vector<int64_t> taken_, anchor_taken_;
  void set_anchor(int64_t position);
};

}  // namespace meshtrain::train
