// tokenizer.json pre-tokenizers: byte-level (GPT-2), Split by a pattern,
// Metaspace (SentencePiece's ▁), digits, punctuation, whitespace, and
// sequences of them; with the split behaviours they share.
#include "meshtrain/text/hf_components.h"

#include <algorithm>

#include "meshtrain/text/regex.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text::hf {

const json& field(const json& j, const char* name, const std::string& where) {
  if (!j.is_object() || !j.contains(name)) throw TokenizerError(where + " has no \"" + name + "\"");
  return j[name];
}

Behavior behavior_from(const json& j, const std::string& where) {
  const std::string name = j.is_string() ? j.get<std::string>() : "";
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  throw Unsupported(where + " is \"" + name + "\", not a split behaviour");
}

std::vector<Segment> segments_from_matches(const std::vector<std::pair<size_t, size_t>>& matches, size_t length) {
  std::vector<Segment> segments;
  size_t at = 0;
  for (const auto& [start, end] : matches) {
    if (start > at) segments.push_back({at, start, false});
    segments.push_back({start, end, true});
    at = end;
  }
  if (at < length) segments.push_back({at, length, false});
  return segments;
}

std::vector<Segment> segments_of_chars(const std::string& text, const std::function<bool(uint32_t)>& is_match) {
  std::vector<std::pair<size_t, size_t>> matches;
  for (const auto& [at, cp] : unicode::code_points(text)) {
    if (is_match(cp)) matches.emplace_back(at, at + unicode::char_length(static_cast<unsigned char>(text[at])));
  }
  return segments_from_matches(matches, text.size());
}

// Note [Split behaviours]
// A split sees its text as alternating stretches, matched or not. Removed
// keeps the unmatched; Isolated keeps each; MergedWithPrevious glues a match
// onto the stretch before it, MergedWithNext onto the one after (a run of
// matches: only the last, resp. first, is glued); Contiguous glues runs of
// the same kind. As tokenizers' NormalizedString::split.
std::vector<std::pair<size_t, size_t>> split_spans(const std::vector<Segment>& segments, Behavior behavior) {
  std::vector<std::pair<size_t, size_t>> spans;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::Removed:
      for (const Segment& s : segments) {
        if (!s.match) spans.emplace_back(s.start, s.end);
      }
      break;
    case Behavior::Isolated:
      for (const Segment& s : segments) spans.emplace_back(s.start, s.end);
      break;
    case Behavior::Contiguous:
    case Behavior::MergedWithPrevious:
      for (const Segment& s : segments) {
        const bool glue = behavior == Behavior::Contiguous ? s.match == previous_match : s.match && !previous_match;
        if (glue && !spans.empty()) {
          spans.back().second = s.end;
        } else {
          spans.emplace_back(s.start, s.end);
        }
        previous_match = s.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->match && !previous_match && !spans.empty()) {
          spans.back().first = it->start;
        } else {
          spans.emplace_back(it->start, it->end);
        }
        previous_match = it->match;
      }
      std::reverse(spans.begin(), spans.end());
      break;
  }
  return spans;
}

void split_pieces(std::vector<Piece>& pieces,
                  const std::function<std::vector<std::pair<size_t, size_t>>(const std::string&)>& split) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.token >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    for (const auto& [start, end] : split(piece.text)) {
      if (end > start) out.push_back({piece.text.substr(start, end - start), piece.at_start && start == 0, -1});
    }
  }
  pieces = std::move(out);
}

// Named as in tokenizers.pre_tokenizers.
namespace pre_tokenizers {

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class Sequence : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->apply(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

class Split : public PreTokenizer {
 public:
  Split(const std::string& pattern, Behavior behavior, bool invert)
      : regex_(pattern), behavior_(behavior), invert_(invert) {}
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) {
      std::vector<Segment> segments = segments_from_matches(regex_.find_all(text), text.size());
      if (invert_) {
        for (Segment& s : segments) s.match = !s.match;
      }
      return split_spans(segments, behavior_);
    });
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

// Splits on characters a predicate picks (digits, punctuation, whitespace).
class CharSplit : public PreTokenizer {
 public:
  CharSplit(std::function<bool(uint32_t)> is_match, Behavior behavior)
      : is_match_(std::move(is_match)), behavior_(behavior) {}
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) { return split_spans(segments_of_chars(text, is_match_), behavior_); });
  }

 private:
  std::function<bool(uint32_t)> is_match_;
  Behavior behavior_;
};

// Runs of word characters and runs of other non-space characters (the
// pattern \w+|[^\w\s]+ with Rust's classes); whitespace goes.
class Whitespace : public PreTokenizer {
 public:
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [](const std::string& text) {
      std::vector<std::pair<size_t, size_t>> runs;
      int previous = 0;  // 0 space, 1 word, 2 other
      for (const auto& [at, cp] : unicode::code_points(text)) {
        const int kind = unicode::is_whitespace(cp) ? 0 : unicode::is_word_char(cp) ? 1 : 2;
        const size_t end = at + unicode::char_length(static_cast<unsigned char>(text[at]));
        if (kind != 0 && kind == previous) {
          runs.back().second = end;
        } else if (kind != 0) {
          runs.emplace_back(at, end);
        }
        previous = kind;
      }
      return runs;
    });
  }
};

class ByteLevel : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_ = std::make_unique<Regex>(kGpt2Pattern);
  }
  void apply(std::vector<Piece>& pieces) const override {
    for (Piece& piece : pieces) {
      if (piece.token < 0 && add_prefix_space_ && piece.text.rfind(' ', 0) != 0) piece.text.insert(0, " ");
    }
    if (regex_) {
      split_pieces(pieces, [&](const std::string& text) {
        return split_spans(segments_from_matches(regex_->find_all(text), text.size()), Behavior::Isolated);
      });
    }
    for (Piece& piece : pieces) {
      if (piece.token >= 0) continue;
      std::string mapped;
      for (unsigned char b : piece.text) mapped += unicode::byte_char(b);
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

// SentencePiece's convention: spaces become ▁ (or another replacement), one
// may be put in front, and each word starts at a ▁.
class Metaspace : public PreTokenizer {
 public:
  enum class Prepend { Always, First, Never };
  Metaspace(std::string replacement, Prepend prepend, bool split)
      : replacement_(std::move(replacement)), prepend_(prepend), split_(split) {}
  void apply(std::vector<Piece>& pieces) const override {
    for (Piece& piece : pieces) {
      if (piece.token >= 0) continue;
      std::string replaced;
      for (char c : piece.text) c == ' ' ? replaced += replacement_ : replaced += c;
      const bool has = replaced.rfind(replacement_, 0) == 0;
      if (!has && (prepend_ == Prepend::Always || (prepend_ == Prepend::First && piece.at_start))) {
        replaced.insert(0, replacement_);
      }
      piece.text = std::move(replaced);
    }
    if (!split_) return;
    const uint32_t mark = unicode::code_point_at(replacement_, 0);
    split_pieces(pieces, [&](const std::string& text) {
      return split_spans(segments_of_chars(text, [&](uint32_t cp) { return cp == mark; }), Behavior::MergedWithNext);
    });
  }

 private:
  std::string replacement_;
  Prepend prepend_;
  bool split_;
};

std::unique_ptr<PreTokenizer> make_metaspace(const json& j, const std::string& where) {
  Metaspace::Prepend prepend = Metaspace::Prepend::Always;
  if (j.contains("prepend_scheme")) {
    const std::string scheme = j["prepend_scheme"];
    if (scheme == "first") {
      prepend = Metaspace::Prepend::First;
    } else if (scheme == "never") {
      prepend = Metaspace::Prepend::Never;
    } else if (scheme != "always") {
      throw Unsupported(where + ".prepend_scheme is \"" + scheme + "\", not always, first or never");
    }
  } else if (!j.value("add_prefix_space", true)) {
    prepend = Metaspace::Prepend::Never;
  }
  const std::string replacement = field(j, "replacement", where);
  if (replacement.empty() || unicode::code_points(replacement).size() != 1) {
    throw TokenizerError(where + ".replacement must be one character");
  }
  return std::make_unique<Metaspace>(replacement, prepend, j.value("split", true));
}

}  // namespace pre_tokenizers

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& where) {
  using namespace pre_tokenizers;
  if (j.is_null()) return nullptr;
  const std::string type = field(j, "type", where);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    const json& list = field(j, "pretokenizers", where);
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto step = make_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]")) {
        steps.push_back(std::move(step));
      }
    }
    return std::make_unique<Sequence>(std::move(steps));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevel>(j.value("add_prefix_space", true), j.value("use_regex", true));
  if (type == "Split") {
    return std::make_unique<Split>(pattern_of(field(j, "pattern", where), where + ".pattern"),
                                   behavior_from(field(j, "behavior", where), where + ".behavior"),
                                   j.value("invert", false));
  }
  if (type == "Metaspace") return make_metaspace(j, where);
  if (type == "Digits") {
    const bool individual = j.value("individual_digits", false);
    return std::make_unique<CharSplit>(unicode::is_numeric, individual ? Behavior::Isolated : Behavior::Contiguous);
  }
  if (type == "Punctuation") {
    const Behavior behavior = j.contains("behavior") ? behavior_from(j["behavior"], where + ".behavior") : Behavior::Isolated;
    return std::make_unique<CharSplit>(unicode::is_punctuation, behavior);
  }
  if (type == "WhitespaceSplit") return std::make_unique<CharSplit>(unicode::is_whitespace, Behavior::Removed);
  if (type == "Whitespace") return std::make_unique<Whitespace>();
  if (type == "CharDelimiterSplit") {
    const uint32_t delimiter = unicode::code_point_at(field(j, "delimiter", where).get<std::string>(), 0);
    return std::make_unique<CharSplit>([delimiter](uint32_t cp) { return cp == delimiter; }, Behavior::Removed);
  }
  throw Unsupported(where + " is " + type + ", a pre-tokenizer meshtrain does not read");
}

}  // namespace meshtrain::text::hf
