#include "meshtrain/model/text_stream.h"

#include <algorithm>

namespace meshtrain::model {

TextStream::TextStream(Decode decode, std::vector<std::string> stop, std::vector<int64_t> end_tokens)
    : decode_(std::move(decode)), end_tokens_(std::move(end_tokens)) {
  for (std::string& s : stop) {
    if (!s.empty()) stop_.push_back(std::move(s));
  }
}

size_t incomplete_utf8_tail(const std::string& text) {
  // Look back over at most 3 continuation bytes for the lead byte.
  const size_t n = text.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

std::string TextStream::push(int64_t token) {
  if (stopped_) return {};
  if (std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end()) {
    stopped_ = true;
    return text_.substr(emitted_);  // what was held back for a stop string that never came
  }
  tokens_.push_back(token);
  text_ = decode_(tokens_);
  // The earliest stop string that appears in the text not yet emitted (a stop
  // string may begin in the held-back text, never in emitted text).
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_) stop_at = std::min(stop_at, text_.find(s, emitted_));
  if (stop_at != std::string::npos) {
    stopped_ = true;
    std::string piece = text_.substr(emitted_, stop_at - emitted_);
    emitted_ = stop_at;
    return piece;
  }
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t hold = incomplete_utf8_tail(text_);
  for (const std::string& s : stop_) {
    for (size_t k = std::min(s.size() - 1, text_.size() - emitted_); k > hold; --k) {
      if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  const size_t end = std::max(emitted_, text_.size() - std::min(hold, text_.size()));
  std::string piece = text_.substr(emitted_, end - emitted_);
  emitted_ = end;
  return piece;
}

std::string TextStream::finish() {
  std::string rest = stopped_ ? std::string() : text_.substr(emitted_);
  emitted_ = text_.size();
  rest.resize(rest.size() - std::min(rest.size(), incomplete_utf8_tail(rest)));  // a character never completed
  return rest;
}

}  // namespace meshtrain::model
