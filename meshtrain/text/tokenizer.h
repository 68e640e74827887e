// Text <-> token ids: bytes (the default), a GPT-2 style byte-level BPE, or a
// SentencePiece model. A tokenizer travels inside checkpoints (its files'
// bytes), so generate, serve and export use the one training used.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::text {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Thread-safe. Throws TokenizerError for text it cannot take (BPE: invalid UTF-8).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // Throws TokenizerError for an id outside the vocabulary.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // Whether decode() takes `id` (ids of a padded vocabulary past vocab_size() do not).
  virtual bool can_decode(int64_t id) const { return id >= 0 && id < vocab_size(); }
  // The token that ends a text (GPT-2's <|endoftext|>, SentencePiece's </s>), or -1.
  virtual int64_t end_of_text() const { return -1; }
  virtual std::string kind() const = 0;  // "bytes" | "gpt2-bpe" | "sentencepiece"
  // The files that make it, by their usual names (vocab.json and merges.txt;
  // tokenizer.model); none for bytes.
  virtual std::map<std::string, std::string> files() const = 0;
  std::string describe() const { return kind() + " (" + std::to_string(vocab_size()) + " tokens)"; }
};

// "bytes" (or ""); a SentencePiece model file (*.model); a tokenizer.json of
// a byte-level BPE; or a folder holding vocab.json + merges.txt,
// tokenizer.json or tokenizer.model. Throws TokenizerError saying what was
// expected.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// A tokenizer as one JSON string (its kind and its files, base64), for a
// checkpoint's metadata, and back ("" gives bytes).
std::string tokenizer_to_json(const Tokenizer& tokenizer);
std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json);

// Built from their files' contents.
std::unique_ptr<Tokenizer> bytes_tokenizer();
std::unique_ptr<Tokenizer> gpt2_bpe_tokenizer(const std::string& vocab_json, const std::string& merges_txt);
std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& model_proto);

// Trains a SentencePiece model ("unigram" or "bpe", byte fallback on, so any
// text encodes) on text files; writes PREFIX.model and PREFIX.vocab.
void train_sentencepiece(const std::vector<std::string>& inputs, int64_t vocab_size, const std::string& type,
                         const std::string& prefix);

}  // namespace meshtrain::text
