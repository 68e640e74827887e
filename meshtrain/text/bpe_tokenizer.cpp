// GPT-2's byte-level BPE (vocab.json + merges.txt), as tiktoken and Hugging
// Face's GPT2Tokenizer compute it. See Note [Byte-level BPE].
#include "meshtrain/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <climits>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace meshtrain::text {

// Note [Byte-level BPE]
// Text is first cut by GPT-2's pattern (contractions, letters, digits, other
// symbols, each with an optional leading space; runs of whitespace) using
// Unicode properties (PCRE2 with UCP). Each piece's bytes are spelled as
// printable characters (GPT-2's bytes_to_unicode: printable Latin-1 bytes as
// themselves, the rest from U+0100 up), then adjacent symbols are merged, the
// pair ranked first in merges.txt each time, until no listed pair remains;
// each final symbol's id is its entry in vocab.json.
namespace {

std::string utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// Splits a UTF-8 string into its characters (each a string).
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

class Gpt2Bpe : public Tokenizer {
 public:
  Gpt2Bpe(const std::string& vocab_json, const std::string& merges_txt) : vocab_json_(vocab_json), merges_txt_(merges_txt) {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_symbol_[b] = utf8(printable ? b : 256 + n++);
      symbol_byte_[byte_symbol_[b]] = static_cast<uint8_t>(b);
    }
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(vocab_json);
    } catch (const nlohmann::json::exception& e) {
      throw TokenizerError(std::string("vocab.json is not JSON: ") + e.what());
    }
    if (!vocab.is_object()) throw TokenizerError("vocab.json must map token strings to ids");
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const int64_t id = it->get<int64_t>();
      if (id < 0) throw TokenizerError("vocab.json: negative id for \"" + it.key() + "\"");
      encoder_[it.key()] = id;
      if (static_cast<int64_t>(decoder_.size()) <= id) decoder_.resize(id + 1);
      decoder_[id] = it.key();
    }
    std::istringstream lines(merges_txt);
    std::string line;
    int rank = 0;
    while (std::getline(lines, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || line.rfind("#version", 0) == 0) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos) throw TokenizerError("merges.txt: line \"" + line + "\" is not two symbols");
      ranks_[line.substr(0, space) + '\x01' + line.substr(space + 1)] = rank++;
    }
    int error = 0;
    PCRE2_SIZE offset = 0;
    const char* pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    regex_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &error,
                           &offset, nullptr);
    if (!regex_) throw TokenizerError("cannot compile GPT-2's pattern (PCRE2 error " + std::to_string(error) + ")");
    pcre2_jit_compile(regex_, PCRE2_JIT_COMPLETE);
  }
  ~Gpt2Bpe() override { pcre2_code_free(regex_); }

  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(regex_, nullptr);
    PCRE2_SIZE start = 0;
    while (start < text.size()) {
      const int rc = pcre2_match(regex_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, 0, match, nullptr);
      if (rc < 0) {
        pcre2_match_data_free(match);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        throw TokenizerError("the text is not valid UTF-8 near byte " + std::to_string(start) +
                             "; the BPE tokenizer reads UTF-8 text");
      }
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
      for (const std::string& symbol : merge(text.substr(span[0], span[1] - span[0]))) {
        auto it = encoder_.find(symbol);
        if (it == encoder_.end()) {
          pcre2_match_data_free(match);
          throw TokenizerError("the BPE vocabulary has no entry for \"" + symbol + "\" (vocab.json and merges.txt differ?)");
        }
        ids.push_back(it->second);
      }
      start = span[1] > span[0] ? span[1] : span[1] + 1;
    }
    pcre2_match_data_free(match);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(decoder_.size()) || decoder_[id].empty()) {
        throw TokenizerError("token id " + std::to_string(id) + " is not in the BPE vocabulary");
      }
      for (const std::string& c : characters(decoder_[id])) {
        auto it = symbol_byte_.find(c);
        out += it != symbol_byte_.end() ? std::string(1, static_cast<char>(it->second)) : c;
      }
    }
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(decoder_.size()); }
  bool can_decode(int64_t id) const override {
    return id >= 0 && id < static_cast<int64_t>(decoder_.size()) && !decoder_[id].empty();
  }
  int64_t end_of_text() const override {
    auto it = encoder_.find("<|endoftext|>");
    return it == encoder_.end() ? -1 : it->second;
  }
  std::string kind() const override { return "gpt2-bpe"; }
  std::map<std::string, std::string> files() const override {
    return {{"vocab.json", vocab_json_}, {"merges.txt", merges_txt_}};
  }

 private:
  // A pre-token's bytes as BPE symbols, merged.
  std::vector<std::string> merge(const std::string& piece) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(piece);
      if (it != cache_.end()) return it->second;
    }
    std::vector<std::string> symbols;
    for (unsigned char b : piece) symbols.push_back(byte_symbol_[b]);
    while (symbols.size() > 1) {
      int best = INT_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        auto it = ranks_.find(symbols[i] + '\x01' + symbols[i + 1]);
        if (it != ranks_.end() && it->second < best) best = it->second, at = i;
      }
      if (best == INT_MAX) break;
      const std::string first = symbols[at], second = symbols[at + 1];
      std::vector<std::string> merged;
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && symbols[i] == first && symbols[i + 1] == second) {
          merged.push_back(first + second);
          ++i;
        } else {
          merged.push_back(symbols[i]);
        }
      }
      symbols = std::move(merged);
    }
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < 200000) cache_[piece] = symbols;
    return symbols;
  }

  std::string vocab_json_, merges_txt_;
  std::string byte_symbol_[256];
  std::unordered_map<std::string, uint8_t> symbol_byte_;
  std::unordered_map<std::string, int64_t> encoder_;
  std::vector<std::string> decoder_;
  std::unordered_map<std::string, int> ranks_;
  pcre2_code* regex_ = nullptr;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<std::string>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> gpt2_bpe_tokenizer(const std::string& vocab_json, const std::string& merges_txt) {
  return std::make_unique<Gpt2Bpe>(vocab_json, merges_txt);
}

}  // namespace meshtrain::text
