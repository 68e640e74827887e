// tokenizer.json normalizers: Unicode forms, case, accents, strip, replace,
// prepend, byte-level, and sequences of them.
#include "meshtrain/text/hf_components.h"
#include "meshtrain/text/regex.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text::hf {

// Named as in tokenizers.normalizers.
namespace normalizers {

class Sequence : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  std::string apply(std::string text) const override {
    for (const auto& step : steps_) text = step->apply(std::move(text));
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class Form : public Normalizer {
 public:
  explicit Form(unicode::Form form) : form_(form) {}
  std::string apply(std::string text) const override { return unicode::normalize(text, form_); }

 private:
  unicode::Form form_;
};

class Lowercase : public Normalizer {
 public:
  std::string apply(std::string text) const override { return unicode::lowercase(text); }
};

class StripAccents : public Normalizer {
 public:
  std::string apply(std::string text) const override { return unicode::strip_marks(text); }
};

class Strip : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  std::string apply(std::string text) const override {
    const auto chars = unicode::code_points(text);
    size_t begin = 0, end = chars.size();
    while (left_ && begin < end && unicode::is_whitespace(chars[begin].second)) ++begin;
    while (right_ && end > begin && unicode::is_whitespace(chars[end - 1].second)) --end;
    const size_t from = begin < chars.size() ? chars[begin].first : text.size();
    const size_t to = end < chars.size() ? chars[end].first : text.size();
    return text.substr(from, to - from);
  }

 private:
  bool left_, right_;
};

class Replace : public Normalizer {
 public:
  Replace(const std::string& pattern, std::string content) : regex_(pattern), content_(std::move(content)) {}
  std::string apply(std::string text) const override {
    std::string out;
    size_t at = 0;
    for (const auto& [start, end] : regex_.find_all(text)) {
      out.append(text, at, start - at);
      out += content_;
      at = end;
    }
    out.append(text, at, std::string::npos);
    return out;
  }

 private:
  Regex regex_;
  std::string content_;
};

class Prepend : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string apply(std::string text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

class ByteLevel : public Normalizer {
 public:
  std::string apply(std::string text) const override {
    std::string out;
    for (unsigned char b : text) out += unicode::byte_char(b);
    return out;
  }
};

}  // namespace normalizers

std::string pattern_of(const json& j, const std::string& where) {
  if (j.contains("String")) return Regex::escape(j["String"].get<std::string>());
  if (j.contains("Regex")) return j["Regex"].get<std::string>();
  throw Unsupported(where + " is neither {\"String\": ...} nor {\"Regex\": ...}");
}

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& where) {
  using namespace normalizers;
  if (j.is_null()) return nullptr;
  const std::string type = field(j, "type", where);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    const json& list = field(j, "normalizers", where);
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto step = make_normalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]")) {
        steps.push_back(std::move(step));
      }
    }
    return std::make_unique<Sequence>(std::move(steps));
  }
  if (type == "NFC") return std::make_unique<Form>(unicode::Form::NFC);
  if (type == "NFD") return std::make_unique<Form>(unicode::Form::NFD);
  if (type == "NFKC") return std::make_unique<Form>(unicode::Form::NFKC);
  if (type == "NFKD") return std::make_unique<Form>(unicode::Form::NFKD);
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "StripAccents") return std::make_unique<StripAccents>();
  if (type == "Strip") return std::make_unique<Strip>(j.value("strip_left", true), j.value("strip_right", true));
  if (type == "Replace") {
    return std::make_unique<Replace>(pattern_of(field(j, "pattern", where), where + ".pattern"),
                                     field(j, "content", where).get<std::string>());
  }
  if (type == "Prepend") return std::make_unique<Prepend>(field(j, "prepend", where).get<std::string>());
  if (type == "ByteLevel") return std::make_unique<ByteLevel>();
  if (type == "Precompiled") {
    // SentencePiece's compiled character map; an empty one changes nothing.
    const json& map = j.value("precompiled_charsmap", json());
    if (map.is_null() || (map.is_string() && map.get<std::string>().empty())) return nullptr;
  }
  throw Unsupported(where + " is " + type + ", a normalizer meshtrain does not read");
}

}  // namespace meshtrain::text::hf
