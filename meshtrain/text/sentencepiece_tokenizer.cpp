// SentencePiece models (libsentencepiece): encoding, decoding and training.
#include "meshtrain/text/tokenizer.h"

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace meshtrain::text {

namespace {

// Note [SentencePiece special tokens]
// SentencePiece itself reads "<s>" in a text as three characters. As
// Hugging Face's tokenizers for these models do, the model's control pieces
// (<s>, </s>) and the special tokens tokenizer_config.json lists written in
// a text become their ids; the text between them is encoded by
// SentencePiece, each stretch on its own. with_special_tokens() adds the BOS and EOS tokenizer_config.json
// asks for (add_bos_token, add_eos_token; Llama 2 and Mistral ask for BOS);
// without that file (a model meshtrain trained) it adds none.
class SentencePiece : public Tokenizer {
 public:
  explicit SentencePiece(const std::string& model_proto) : proto_(model_proto) {
    const auto status = processor_.LoadFromSerializedProto(model_proto);
    if (!status.ok()) throw TokenizerError("not a SentencePiece model: " + std::string(status.message()));
    companions_changed();
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> out;
    // Each special piece's next place at or after `at`, searched again only
    // once `at` has passed it: every search moves forward, O(text x pieces).
    std::vector<size_t> next;
    for (const auto& special : specials_) next.push_back(text.find(special.first));
    size_t at = 0;
    while (true) {
      size_t found = std::string::npos, length = 0, k = 0;
      int64_t id = -1;
      for (const auto& [piece, piece_id] : specials_) {  // the earliest, then the longest
        size_t& where = next[k++];
        if (where != std::string::npos && where < at) where = text.find(piece, at);
        if (where < found || (where == found && where != std::string::npos && piece.size() > length)) {
          found = where, length = piece.size(), id = piece_id;
        }
      }
      encode_plain(text.substr(at, found == std::string::npos ? std::string::npos : found - at), out);
      if (found == std::string::npos) break;
      out.push_back(id);
      at = found + length;
    }
    return out;
  }
  std::vector<int64_t> with_special_tokens(std::vector<int64_t> ids) const override {
    if (add_bos_ && processor_.bos_id() >= 0) ids.insert(ids.begin(), processor_.bos_id());
    if (add_eos_ && processor_.eos_id() >= 0) ids.push_back(processor_.eos_id());
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> narrow;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size()) throw TokenizerError("token id " + std::to_string(id) + " is not in the vocabulary");
      narrow.push_back(static_cast<int>(id));
    }
    std::string text;
    const auto status = processor_.Decode(narrow, &text);
    if (!status.ok()) throw TokenizerError("SentencePiece cannot decode: " + std::string(status.message()));
    return text;
  }
  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  int64_t end_of_text() const override { return processor_.eos_id(); }
  bool is_special(int64_t id) const override {
    return id >= 0 && id < vocab_size() && (processor_.IsControl(static_cast<int>(id)) || processor_.IsUnknown(static_cast<int>(id)));
  }
  std::optional<std::string> token_string(int64_t id) const override {
    if (id < 0 || id >= vocab_size()) return std::nullopt;
    return processor_.IdToPiece(static_cast<int>(id));
  }
  int64_t token_id(const std::string& token) const override {
    const int id = processor_.PieceToId(token);
    return id == processor_.unk_id() && token != processor_.IdToPiece(id) ? -1 : id;
  }
  std::string kind() const override { return "sentencepiece"; }
  std::map<std::string, std::string> files() const override { return {{"tokenizer.model", proto_}}; }

 protected:
  void companions_changed() override {
    specials_.clear();
    for (int id = 0; id < processor_.GetPieceSize(); ++id) {
      if (processor_.IsControl(id)) specials_[processor_.IdToPiece(id)] = id;
    }
    add_bos_ = add_eos_ = false;
    auto file = companions().find("tokenizer_config.json");
    if (file == companions().end()) return;
    const nlohmann::json config = nlohmann::json::parse(file->second, nullptr, false);
    if (!config.is_object()) return;
    add_bos_ = config.value("add_bos_token", true);  // transformers' default for these models
    add_eos_ = config.value("add_eos_token", false);
    if (!config.contains("added_tokens_decoder") || !config["added_tokens_decoder"].is_object()) return;
    for (const auto& [key, token] : config["added_tokens_decoder"].items()) {
      if (!token.is_object() || !token.value("special", false) || !token.contains("content")) continue;
      const std::string content = token["content"].get<std::string>();
      if (!content.empty() && token_id(content) == std::stoll(key)) specials_[content] = std::stoll(key);
    }
  }

 private:
  void encode_plain(const std::string& text, std::vector<int64_t>& out) const {
    if (text.empty()) return;
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw TokenizerError("SentencePiece cannot encode the text: " + std::string(status.message()));
    out.insert(out.end(), ids.begin(), ids.end());
  }

  std::string proto_;
  sentencepiece::SentencePieceProcessor processor_;
  std::map<std::string, int64_t> specials_;  // see Note [SentencePiece special tokens]
  bool add_bos_ = false, add_eos_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& model_proto) {
  return std::make_unique<SentencePiece>(model_proto);
}

void train_sentencepiece(const std::vector<std::string>& inputs, int64_t vocab_size, const std::string& type,
                         const std::string& prefix) {
  if (inputs.empty()) throw TokenizerError("tokenizer train: name at least one text file");
  if (type != "unigram" && type != "bpe") throw TokenizerError("tokenizer train: --type must be unigram or bpe");
  std::string files;
  for (const std::string& f : inputs) files += (files.empty() ? "" : ",") + f;
  const std::string args = "--input=" + files + " --model_prefix=" + prefix + " --vocab_size=" +
                           std::to_string(vocab_size) + " --model_type=" + type +
                           " --character_coverage=1.0 --byte_fallback=true --minloglevel=2";
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok()) throw TokenizerError("tokenizer train: " + std::string(status.message()));
}

}  // namespace meshtrain::text
