// tokenizer.json decoders (token strings back to text) and post-processors
// (the special tokens a template puts around a sequence).
#include "meshtrain/text/hf_components.h"
#include "meshtrain/text/regex.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text::hf {

// Named as in tokenizers.decoders.
namespace decoders {

class Sequence : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->apply(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

// Byte-level characters back to their bytes; a token with any other
// character (an added token) stays as it is.
class ByteLevel : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string out;
    for (const std::string& token : tokens) {
      std::string bytes;
      bool mapped = true;
      for (const auto& [at, cp] : unicode::code_points(token)) {
        const int b = unicode::char_byte(cp);
        if (b < 0) {
          mapped = false;
          break;
        }
        bytes += static_cast<char>(b);
      }
      out += mapped ? bytes : token;
    }
    tokens.assign(1, std::move(out));
  }
};

// <0xXX> tokens back to their bytes. Unlike tokenizers, a run that is not
// valid UTF-8 keeps its bytes rather than becoming U+FFFD each: a stream
// decoding a prefix sees a character's first bytes before its last.
class ByteFallback : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string run;
    for (std::string& token : tokens) {
      const int byte = byte_of(token);
      if (byte >= 0) {
        run += static_cast<char>(byte);
        continue;
      }
      if (!run.empty()) out.push_back(std::move(run)), run.clear();
      out.push_back(std::move(token));
    }
    if (!run.empty()) out.push_back(std::move(run));
    tokens = std::move(out);
  }

 private:
  static int byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    const int hi = hex(t[3]), lo = hex(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }
};

class Fuse : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing `content` characters from each token.
class Strip : public Decoder {
 public:
  Strip(uint32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      const auto chars = unicode::code_points(token);
      size_t begin = 0, end = chars.size();
      while (begin < std::min(start_, chars.size()) && chars[begin].second == content_) ++begin;
      for (size_t i = 0; i < stop_ && end > begin && chars[end - 1].second == content_; ++i) --end;
      const size_t from = begin < chars.size() ? chars[begin].first : token.size();
      const size_t to = end < chars.size() ? chars[end].first : token.size();
      token = token.substr(from, to - from);
    }
  }

 private:
  uint32_t content_;
  size_t start_, stop_;
};

class Replace : public Decoder {
 public:
  Replace(const std::string& pattern, std::string content) : regex_(pattern), content_(std::move(content)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      if (!unicode::valid_utf8(token)) continue;  // raw bytes from a fallback: nothing to replace
      std::string out;
      size_t at = 0;
      for (const auto& [start, end] : regex_.find_all(token)) {
        out.append(token, at, start - at);
        out += content_;
        at = end;
      }
      out.append(token, at, std::string::npos);
      token = std::move(out);
    }
  }

 private:
  Regex regex_;
  std::string content_;
};

// ▁ back to spaces; the first token's ▁ was put there, so it goes.
class Metaspace : public Decoder {
 public:
  Metaspace(std::string replacement, bool drop_first) : replacement_(std::move(replacement)), drop_first_(drop_first) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t at = 0; at < t.size();) {
        if (t.compare(at, replacement_.size(), replacement_) == 0) {
          if (i > 0 || !drop_first_) out += ' ';
          at += replacement_.size();
        } else {
          out += t[at++];
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool drop_first_;
};

// A word-end suffix (BPE trained with end_of_word_suffix) back to a space.
class WordSuffix : public Decoder {
 public:
  explicit WordSuffix(std::string suffix) : suffix_(std::move(suffix)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      for (size_t at = t.find(suffix_); !suffix_.empty() && at != std::string::npos; at = t.find(suffix_, at)) {
        const std::string with = i + 1 < tokens.size() ? " " : "";
        t.replace(at, suffix_.size(), with);
        at += with.size();
      }
    }
  }

 private:
  std::string suffix_;
};

}  // namespace decoders

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& where) {
  using namespace decoders;
  if (j.is_null()) return nullptr;
  const std::string type = field(j, "type", where);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    const json& list = field(j, "decoders", where);
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto step = make_decoder(list[i], where + ".decoders[" + std::to_string(i) + "]")) steps.push_back(std::move(step));
    }
    return std::make_unique<Sequence>(std::move(steps));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevel>();
  if (type == "ByteFallback") return std::make_unique<ByteFallback>();
  if (type == "Fuse") return std::make_unique<Fuse>();
  if (type == "Strip") {
    const std::string content = field(j, "content", where);
    return std::make_unique<Strip>(unicode::code_point_at(content, 0), j.value("start", size_t{0}), j.value("stop", size_t{0}));
  }
  if (type == "Replace") {
    return std::make_unique<Replace>(pattern_of(field(j, "pattern", where), where + ".pattern"),
                                     field(j, "content", where).get<std::string>());
  }
  if (type == "Metaspace") {
    const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    return std::make_unique<Metaspace>(field(j, "replacement", where).get<std::string>(), scheme != "never");
  }
  if (type == "BPEDecoder") return std::make_unique<WordSuffix>(j.value("suffix", "</w>"));
  throw Unsupported(where + " is " + type + ", a decoder meshtrain does not read");
}

// Named as in tokenizers.processors.
namespace processors {

class Template : public PostProcessor {
 public:
  Template(std::vector<int64_t> before, std::vector<int64_t> after) : before_(std::move(before)), after_(std::move(after)) {}
  std::vector<int64_t> apply(std::vector<int64_t> ids) const override {
    ids.insert(ids.begin(), before_.begin(), before_.end());
    ids.insert(ids.end(), after_.begin(), after_.end());
    return ids;
  }

 private:
  std::vector<int64_t> before_, after_;
};

class Chain : public PostProcessor {
 public:
  explicit Chain(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  std::vector<int64_t> apply(std::vector<int64_t> ids) const override {
    for (const auto& step : steps_) ids = step->apply(std::move(ids));
    return ids;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// TemplateProcessing's "single": special tokens around the sequence $A.
std::unique_ptr<PostProcessor> make_template(const json& j, const std::string& where) {
  std::vector<int64_t> before, after;
  bool seen_sequence = false;
  const json& single = field(j, "single", where);
  const json& specials = j.value("special_tokens", json::object());
  for (size_t i = 0; i < single.size(); ++i) {
    const json& item = single[i];
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const std::string name = field(field(item, "SpecialToken", where + ".single"), "id", where + ".single");
    if (!specials.contains(name)) throw TokenizerError(where + ".special_tokens has no \"" + name + "\"");
    for (const json& id : field(specials[name], "ids", where + ".special_tokens")) {
      (seen_sequence ? after : before).push_back(id.get<int64_t>());
    }
  }
  return std::make_unique<Template>(std::move(before), std::move(after));
}

}  // namespace processors

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const std::string& where) {
  using namespace processors;
  if (j.is_null()) return nullptr;
  const std::string type = field(j, "type", where);
  if (type == "TemplateProcessing") return make_template(j, where);
  if (type == "ByteLevel") return nullptr;  // it only trims offsets
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json& cls = field(j, "cls", where);
    const json& sep = field(j, "sep", where);
    return std::make_unique<Template>(std::vector<int64_t>{cls.at(1).get<int64_t>()},
                                      std::vector<int64_t>{sep.at(1).get<int64_t>()});
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> steps;
    const json& list = field(j, "processors", where);
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto step = make_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]")) {
        steps.push_back(std::move(step));
      }
    }
    return std::make_unique<Chain>(std::move(steps));
  }
  throw Unsupported(where + " is " + type + ", a post-processor meshtrain does not read");
}

}  // namespace meshtrain::text::hf
