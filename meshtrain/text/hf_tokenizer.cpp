// A Hugging Face tokenizer.json as a Tokenizer. See Note [tokenizer.json].
#include <algorithm>
#include <optional>

#include "meshtrain/text/hf_components.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text {

// Note [tokenizer.json]
// Encoding, as the tokenizers library does it:
//  1. added tokens not marked "normalized" are found in the raw text
//     (leftmost, then longest), each becoming its id; lstrip / rstrip take
//     the whitespace beside them, single_word refuses a match inside a word;
//  2. the stretches between are normalized, and "normalized" added tokens
//     found in them;
//  3. the pre-tokenizer splits what is left into pre-tokens;
//  4. the model (BPE or Unigram) turns each pre-token into ids.
// The post-processor's template (Llama 3's <|begin_of_text|>) is applied by
// with_special_tokens(), not by encode(): training data is encoded in
// pieces, prompts whole. Decoding maps ids to token strings (added tokens'
// content included) and runs the decoder. The specs: the tokenizers crate's
// added_vocabulary.rs, normalizer.rs and the component files.
namespace {

using hf::json;

struct AddedToken {
  std::string content;
  int64_t id;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Finds added tokens in text: leftmost match first, the longest there.
class AddedMatcher {
 public:
  // Add every token, then sort() once (longest first within a first byte).
  void add(const std::string& pattern, const AddedToken* token) {
    if (pattern.empty()) return;
    by_first_byte_[static_cast<unsigned char>(pattern[0])].emplace_back(pattern, token);
  }
  void sort() {
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    }
  }
  bool empty() const {
    return std::all_of(std::begin(by_first_byte_), std::end(by_first_byte_), [](const auto& l) { return l.empty(); });
  }
  // Splits the pieces that are not tokens yet around the tokens found in them.
  void split(std::vector<hf::Piece>& pieces) const {
    if (empty()) return;
    std::vector<hf::Piece> out;
    for (hf::Piece& piece : pieces) {
      if (piece.token >= 0) {
        out.push_back(std::move(piece));
        continue;
      }
      size_t done = 0;
      for (const auto& [start, stop, id] : matches(piece.text)) {
        if (start > done) out.push_back({piece.text.substr(done, start - done), piece.at_start && done == 0, -1});
        out.push_back({piece.text.substr(start, stop - start), piece.at_start && start == 0, id});
        done = stop;
      }
      if (done < piece.text.size()) out.push_back({piece.text.substr(done), piece.at_start && done == 0, -1});
    }
    pieces = std::move(out);
  }

 private:
  struct Match {
    size_t start, stop;
    int64_t id;
  };
  static uint32_t char_before(const std::string& s, size_t at) {
    size_t i = at - 1;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
    return unicode::code_point_at(s, i);
  }
  std::vector<Match> matches(const std::string& text) const {
    std::vector<Match> found;
    size_t done = 0;  // where the previous match ended
    for (size_t at = 0; at < text.size();) {
      const AddedToken* token = nullptr;
      size_t length = 0;
      for (const auto& [pattern, candidate] : by_first_byte_[static_cast<unsigned char>(text[at])]) {
        if (text.compare(at, pattern.size(), pattern) == 0) {
          token = candidate, length = pattern.size();
          break;
        }
      }
      if (!token) {
        ++at;
        continue;
      }
      size_t start = at, stop = at + length;
      at = stop;
      if (token->single_word && ((start > 0 && unicode::is_word_char(char_before(text, start))) ||
                                 (stop < text.size() && unicode::is_word_char(unicode::code_point_at(text, stop))))) {
        continue;
      }
      if (token->lstrip) {
        while (start > done && unicode::is_whitespace(char_before(text, start))) {
          start -= unicode::encode(char_before(text, start)).size();
        }
      }
      if (token->rstrip) {
        while (stop < text.size() && unicode::is_whitespace(unicode::code_point_at(text, stop))) {
          stop += unicode::char_length(static_cast<unsigned char>(text[stop]));
        }
        at = stop;
      }
      found.push_back({start, stop, token->id});
      done = stop;
    }
    return found;
  }

  std::vector<std::pair<std::string, const AddedToken*>> by_first_byte_[256];
};

class HfTokenizer : public Tokenizer {
 public:
  // `files`: what files() gives back (tokenizer.json, or the vocab.json +
  // merges.txt that `tokenizer_json` was made from).
  HfTokenizer(std::string kind, std::map<std::string, std::string> files, const std::string& tokenizer_json,
              const std::string& name);
  std::vector<int64_t> encode(const std::string& text) const override;
  std::vector<int64_t> with_special_tokens(std::vector<int64_t> ids) const override {
    return post_ ? post_->apply(std::move(ids)) : ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  bool can_decode(int64_t id) const override { return token(id) != nullptr; }
  bool is_special(int64_t id) const override {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() && it->second->special;
  }
  std::optional<std::string> token_string(int64_t id) const override {
    const std::string* t = token(id);
    return t ? std::optional<std::string>(*t) : std::nullopt;
  }
  int64_t token_id(const std::string& token) const override {
    for (const AddedToken& a : added_) {
      if (a.content == token) return a.id;
    }
    return model_->id(token);
  }
  int64_t end_of_text() const override { return end_of_text_; }
  std::string kind() const override { return kind_; }
  std::map<std::string, std::string> files() const override { return files_; }
  std::string describe() const override {
    return "tokenizer.json " + model_->type() + " (" + std::to_string(vocab_size_) + " tokens)";
  }

 private:
  const std::string* token(int64_t id) const {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() ? &it->second->content : model_->token(id);
  }
  void read_added_tokens(const json& list, const std::string& name);
  int64_t find_end_of_text() const;

  std::string kind_;
  std::map<std::string, std::string> files_;
  std::unique_ptr<hf::Normalizer> normalizer_;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer_;
  std::unique_ptr<hf::Model> model_;
  std::unique_ptr<hf::PostProcessor> post_;
  std::unique_ptr<hf::Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::map<int64_t, const AddedToken*> added_by_id_;
  AddedMatcher raw_matcher_, normalized_matcher_;
  int64_t vocab_size_ = 0;
  int64_t end_of_text_ = -1;
};

HfTokenizer::HfTokenizer(std::string kind, std::map<std::string, std::string> files, const std::string& tokenizer_json,
                         const std::string& name)
    : kind_(std::move(kind)), files_(std::move(files)) {
  json j;
  try {
    j = json::parse(tokenizer_json);
  } catch (const json::exception& e) {
    throw TokenizerError(name + ": not JSON (" + e.what() + ")");
  }
  try {
    if (!j.is_object()) throw TokenizerError("it is not a JSON object");
    model_ = hf::make_model(hf::field(j, "model", "the file"), "model");
    normalizer_ = hf::make_normalizer(j.value("normalizer", json()), "normalizer");
    pre_tokenizer_ = hf::make_pre_tokenizer(j.value("pre_tokenizer", json()), "pre_tokenizer");
    post_ = hf::make_post_processor(j.value("post_processor", json()), "post_processor");
    decoder_ = hf::make_decoder(j.value("decoder", json()), "decoder");
    read_added_tokens(j.value("added_tokens", json::array()), name);
  } catch (const hf::Unsupported& e) {
    throw hf::Unsupported(name + ": " + e.what());
  } catch (const json::exception& e) {
    throw TokenizerError(name + ": a field has the wrong type (" + e.what() + ")");
  } catch (const TokenizerError& e) {
    throw TokenizerError(name + ": " + e.what());
  }
  vocab_size_ = model_->size();
  for (const AddedToken& a : added_) vocab_size_ = std::max(vocab_size_, a.id + 1);
  end_of_text_ = find_end_of_text();
}

void HfTokenizer::read_added_tokens(const json& list, const std::string& name) {
  added_.reserve(list.size());  // the matchers point into added_
  for (const json& a : list) {
    added_.push_back({hf::field(a, "content", "added_tokens[]").get<std::string>(), hf::field(a, "id", "added_tokens[]").get<int64_t>(),
                      a.value("single_word", false), a.value("lstrip", false), a.value("rstrip", false),
                      a.value("normalized", false), a.value("special", false)});
    if (added_.back().id < 0) throw TokenizerError(name + ": added token " + added_.back().content + " has a negative id");
  }
  for (const AddedToken& a : added_) {
    added_by_id_[a.id] = &a;
    if (!a.normalized) {
      raw_matcher_.add(a.content, &a);
    } else {
      normalized_matcher_.add(normalizer_ ? normalizer_->apply(a.content) : a.content, &a);
    }
  }
  raw_matcher_.sort();
  normalized_matcher_.sort();
}

// tokenizer.json does not say which token ends a text (tokenizer_config.json
// does; see stop_ids()); these are the names the families use.
int64_t HfTokenizer::find_end_of_text() const {
  for (const char* name : {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"}) {
    const int64_t id = token_id(name);
    if (id >= 0) return id;
  }
  return -1;
}

std::vector<int64_t> HfTokenizer::encode(const std::string& text) const {
  const size_t bad = unicode::first_invalid_utf8(text);
  if (bad != text.size()) {
    throw TokenizerError("the text is not valid UTF-8 at byte " + std::to_string(bad) + "; the tokenizer reads UTF-8 text");
  }
  std::vector<hf::Piece> pieces{{text, true, -1}};
  raw_matcher_.split(pieces);
  if (normalizer_) {
    for (hf::Piece& piece : pieces) {
      if (piece.token < 0) piece.text = normalizer_->apply(std::move(piece.text));
    }
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const hf::Piece& p) { return p.text.empty(); }),
                 pieces.end());
  }
  normalized_matcher_.split(pieces);
  if (pre_tokenizer_) pre_tokenizer_->apply(pieces);
  std::vector<int64_t> ids;
  for (const hf::Piece& piece : pieces) {
    if (piece.token >= 0) {
      ids.push_back(piece.token);
    } else {
      model_->encode(piece.text, ids);
    }
  }
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    const std::string* t = token(id);
    if (!t) throw TokenizerError("token id " + std::to_string(id) + " is not in the vocabulary");
    tokens.push_back(*t);
  }
  if (!decoder_) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  decoder_->apply(tokens);
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

// GPT-2's vocab.json + merges.txt as the tokenizer.json transformers makes of them.
std::string gpt2_tokenizer_json(const std::string& vocab_json, const std::string& merges_txt) {
  json vocab;
  try {
    vocab = json::parse(vocab_json);
  } catch (const json::exception& e) {
    throw TokenizerError(std::string("vocab.json is not JSON: ") + e.what());
  }
  if (!vocab.is_object()) throw TokenizerError("vocab.json must map token strings to ids");
  json merges = json::array();
  size_t line_start = 0;
  while (line_start < merges_txt.size()) {
    size_t end = merges_txt.find('\n', line_start);
    if (end == std::string::npos) end = merges_txt.size();
    std::string line = merges_txt.substr(line_start, end - line_start);
    line_start = end + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    merges.push_back(line);
  }
  json added = json::array();
  if (vocab.contains("<|endoftext|>")) {
    added.push_back({{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", true}});
  }
  return json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"added_tokens", added}}
      .dump();
}

}  // namespace

std::unique_ptr<Tokenizer> hf_tokenizer(const std::string& tokenizer_json, const std::string& name) {
  return std::make_unique<HfTokenizer>("hf", std::map<std::string, std::string>{{"tokenizer.json", tokenizer_json}},
                                       tokenizer_json, name);
}

std::unique_ptr<Tokenizer> gpt2_bpe_tokenizer(const std::string& vocab_json, const std::string& merges_txt) {
  return std::make_unique<HfTokenizer>("gpt2-bpe", std::map<std::string, std::string>{{"vocab.json", vocab_json}, {"merges.txt", merges_txt}},
                                       gpt2_tokenizer_json(vocab_json, merges_txt), "vocab.json + merges.txt");
}

}  // namespace meshtrain::text
