// The stages of a Hugging Face tokenizer.json, each read from its JSON:
// normalizer -> pre-tokenizer -> model -> post-processor, and the decoder
// back. See Note [tokenizer.json] in hf_tokenizer.cpp for how they compose.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/text/tokenizer.h"

namespace meshtrain::text::hf {

using nlohmann::json;

// A component this reader does not implement, named by its place in the
// file ("normalizer.normalizers[0] is Precompiled").
class Unsupported : public TokenizerError {
 public:
  using TokenizerError::TokenizerError;
};

// A stretch of text between the stages.
struct Piece {
  std::string text;
  bool at_start = false;  // begins where the whole text begins
  int64_t token = -1;     // an added token found whole: its id; the stages leave it alone
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits or rewrites the pieces that are not tokens yet; drops empty ones.
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string type() const = 0;  // "BPE" | "Unigram"
  // Appends the ids of one pre-token.
  virtual void encode(const std::string& piece, std::vector<int64_t>& ids) const = 0;
  virtual int64_t size() const = 0;  // one past the largest id
  virtual const std::string* token(int64_t id) const = 0;  // nullptr for an id it lacks
  virtual int64_t id(const std::string& token) const = 0;  // -1 for a token it lacks
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the token strings; the text is their concatenation.
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // One sequence's ids with the special tokens the template adds.
  virtual std::vector<int64_t> apply(std::vector<int64_t> ids) const = 0;
};

// Each returns nullptr for JSON null (the stage is absent) and throws
// Unsupported naming `where` for a type it does not know.
std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& where);
std::unique_ptr<Model> make_model(const json& j, const std::string& where);
std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& where);
std::unique_ptr<PostProcessor> make_post_processor(const json& j, const std::string& where);

// How a split treats the stretches its pattern matches (HF's SplitDelimiterBehavior).
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
Behavior behavior_from(const json& j, const std::string& where);

struct Segment {
  size_t start, end;
  bool match;
};
// The [start, end) spans a split keeps, given segments that cover the text.
std::vector<std::pair<size_t, size_t>> split_spans(const std::vector<Segment>& segments, Behavior behavior);
// Segments from match spans: the stretches between matches fill the gaps.
std::vector<Segment> segments_from_matches(const std::vector<std::pair<size_t, size_t>>& matches, size_t length);
// Segments where each character `is_match` accepts is a match of its own.
std::vector<Segment> segments_of_chars(const std::string& text, const std::function<bool(uint32_t)>& is_match);

// Replaces every piece that is not a token by the pieces `split` makes of it,
// keeping at_start for the first and dropping empty ones.
void split_pieces(std::vector<Piece>& pieces,
                  const std::function<std::vector<std::pair<size_t, size_t>>(const std::string&)>& split);

// A Replace or Split pattern, {"String": literal} or {"Regex": pattern}, as a regex.
std::string pattern_of(const json& j, const std::string& where);

// A JSON field that must be there, with a message naming `where` when it is not.
const json& field(const json& j, const char* name, const std::string& where);

}  // namespace meshtrain::text::hf
