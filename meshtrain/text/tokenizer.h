// Text <-> token ids: bytes (the default), a Hugging Face tokenizer.json (BPE
// or Unigram, as Llama 3, Mistral, Qwen2, Gemma and GPT-2 ship them), GPT-2's
// vocab.json + merges.txt, or a SentencePiece model. A tokenizer travels
// inside checkpoints (its files' bytes), so generate, serve and export use
// the one training used.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
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
  // Thread-safe. Throws TokenizerError for text it cannot take (invalid UTF-8).
  // Special tokens written in the text ("<|eot_id|>") become their ids; the
  // ones a template adds around a whole sequence do not (with_special_tokens).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // One sequence's ids with the tokens the tokenizer's template adds (Llama's
  // beginning-of-text); unchanged for tokenizers without one.
  virtual std::vector<int64_t> with_special_tokens(std::vector<int64_t> ids) const { return ids; }
  // Throws TokenizerError for an id outside the vocabulary.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // Whether decode() takes `id` (ids of a padded vocabulary past vocab_size() do not).
  virtual bool can_decode(int64_t id) const { return id >= 0 && id < vocab_size(); }
  // Whether `id` is a special token (control, not text: <|eot_id|>, </s>).
  virtual bool is_special(int64_t /*id*/) const { return false; }
  // The vocabulary's string for `id` (byte-level and ▁ spellings as they are), or none.
  virtual std::optional<std::string> token_string(int64_t /*id*/) const { return std::nullopt; }
  // The id of a vocabulary string, or -1.
  virtual int64_t token_id(const std::string& /*token*/) const { return -1; }
  // The token that ends a text (GPT-2's <|endoftext|>, SentencePiece's </s>), or -1.
  virtual int64_t end_of_text() const { return -1; }
  // Every token that ends a generation: end_of_text(), tokenizer_config.json's
  // eos_token and generation_config.json's eos_token_id (Llama 3 Instruct's
  // <|eot_id|> and <|eom_id|>).
  std::vector<int64_t> stop_ids() const;
  virtual std::string kind() const = 0;  // "bytes" | "hf" | "gpt2-bpe" | "sentencepiece"
  // The files that make it, by their usual names (tokenizer.json and
  // tokenizer_config.json; vocab.json and merges.txt; tokenizer.model); none for bytes.
  virtual std::map<std::string, std::string> files() const = 0;
  // The files that travel with a tokenizer in a model folder and say how to
  // use it: tokenizer_config.json (special tokens, chat_template),
  // chat_template.jinja, special_tokens_map.json, generation_config.json.
  const std::map<std::string, std::string>& companions() const { return companions_; }
  // Not thread-safe: set before the tokenizer is shared.
  void set_companions(std::map<std::string, std::string> companions) {
    companions_ = std::move(companions);
    companions_changed();
  }
  // files() and companions(), as a checkpoint or an export keeps them.
  std::map<std::string, std::string> all_files() const;
  virtual std::string describe() const { return kind() + " (" + std::to_string(vocab_size()) + " tokens)"; }

 protected:
  // After set_companions(): a tokenizer that takes settings from them (SentencePiece's BOS) reads them here.
  virtual void companions_changed() {}

 private:
  std::map<std::string, std::string> companions_;
};

// The companion file names a folder's tokenizer brings along.
const std::vector<std::string>& companion_names();

// "bytes" (or ""); a SentencePiece model file (*.model); a tokenizer.json;
// or a folder holding tokenizer.json, vocab.json + merges.txt or
// tokenizer.model, read in that order, with its companion files. A
// tokenizer.json with a component meshtrain does not read falls back to the
// folder's tokenizer.model, saying so, or is refused naming the component.
// Throws TokenizerError saying what was expected.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// A tokenizer as one JSON string (its kind and its files, base64), for a
// checkpoint's metadata, and back ("" gives bytes).
std::string tokenizer_to_json(const Tokenizer& tokenizer);
std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& json);

// Built from their files' contents.
std::unique_ptr<Tokenizer> bytes_tokenizer();
// `tokenizer_json`: a tokenizer.json's text; `name` starts error messages.
std::unique_ptr<Tokenizer> hf_tokenizer(const std::string& tokenizer_json, const std::string& name);
std::unique_ptr<Tokenizer> gpt2_bpe_tokenizer(const std::string& vocab_json, const std::string& merges_txt);
std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& model_proto);

// Trains a SentencePiece model ("unigram" or "bpe", byte fallback on, so any
// text encodes) on text files; writes PREFIX.model and PREFIX.vocab.
void train_sentencepiece(const std::vector<std::string>& inputs, int64_t vocab_size, const std::string& type,
                         const std::string& prefix);

}  // namespace meshtrain::text
