// SentencePiece models (libsentencepiece): encoding, decoding and training.
#include "meshtrain/text/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace meshtrain::text {

namespace {

class SentencePiece : public Tokenizer {
 public:
  explicit SentencePiece(const std::string& model_proto) : proto_(model_proto) {
    const auto status = processor_.LoadFromSerializedProto(model_proto);
    if (!status.ok()) throw TokenizerError("not a SentencePiece model: " + std::string(status.message()));
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw TokenizerError("SentencePiece cannot encode the text: " + std::string(status.message()));
    return {ids.begin(), ids.end()};
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

 private:
  std::string proto_;
  sentencepiece::SentencePieceProcessor processor_;
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
