#include "meshtrain/serve/logprobs.h"

#include <algorithm>
#include <cmath>

namespace meshtrain::serve {

namespace {

constexpr size_t kContext = 6;  // tokens of context a token is spelled after

ojson logprob_value(double v) { return std::isnan(v) ? ojson(nullptr) : ojson(std::isinf(v) ? -9999.0 : v); }

ojson utf8_bytes(const std::string& s) {
  ojson bytes = ojson::array();
  for (unsigned char c : s) bytes.push_back(static_cast<int>(c));
  return bytes;
}

// `text` without a character its end cuts short.
std::string complete(const std::string& text) {
  const size_t n = text.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? text.substr(0, n - back) : text;
  }
  return text;
}

}  // namespace

int64_t characters(const std::string& text) {
  int64_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

std::string TokenSpeller::spell(const std::vector<int64_t>& before, int64_t id) const { return spell(before, std::vector<int64_t>{id})[0]; }

std::vector<std::string> TokenSpeller::spell(const std::vector<int64_t>& before, const std::vector<int64_t>& ids) const {
  const size_t from = before.size() > kContext ? before.size() - kContext : 0;
  std::vector<int64_t> context(before.begin() + static_cast<long>(from), before.end());
  std::string head;
  try {
    head = complete(tokenizer_.decode(context));
  } catch (const text::TokenizerError&) {
    context.clear();
  }
  std::vector<std::string> out;
  for (int64_t id : ids) {
    try {
      context.push_back(id);
      const std::string whole = complete(tokenizer_.decode(context));
      context.pop_back();
      out.push_back(whole.compare(0, head.size(), head) == 0 ? whole.substr(head.size()) : complete(tokenizer_.decode({id})));
    } catch (const text::TokenizerError&) {
      context.pop_back();
      out.emplace_back();  // an id the tokenizer cannot decode (a padded vocabulary's)
    }
  }
  return out;
}

ojson completion_logprobs(const TokenSpeller& speller, const std::vector<TokenLogprob>& tokens,
                          std::vector<int64_t> before, int64_t offset) {
  ojson spelled = ojson::array(), values = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  for (const TokenLogprob& t : tokens) {
    std::vector<int64_t> ids{t.token};
    for (const auto& alternative : t.top) ids.push_back(alternative.first);
    const std::vector<std::string> texts = speller.spell(before, ids);
    const std::string& text = texts[0];
    spelled.push_back(text);
    values.push_back(logprob_value(t.logprob));
    offsets.push_back(offset);
    if (std::isnan(t.logprob)) {
      tops.push_back(nullptr);
    } else {
      ojson top = ojson::object();
      for (size_t k = 0; k < t.top.size(); ++k) {
        if (!top.contains(texts[k + 1])) top[texts[k + 1]] = logprob_value(t.top[k].second);
      }
      tops.push_back(top);
    }
    offset += characters(text);
    before.push_back(t.token);
  }
  return {{"tokens", spelled}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

ojson chat_logprobs(const TokenSpeller& speller, const std::vector<TokenLogprob>& tokens, std::vector<int64_t> before) {
  ojson content = ojson::array();
  for (const TokenLogprob& t : tokens) {
    std::vector<int64_t> ids{t.token};
    for (const auto& alternative : t.top) ids.push_back(alternative.first);
    const std::vector<std::string> texts = speller.spell(before, ids);
    const std::string& text = texts[0];
    ojson top = ojson::array();
    for (size_t k = 0; k < t.top.size(); ++k) {
      top.push_back({{"token", texts[k + 1]}, {"logprob", logprob_value(t.top[k].second)}, {"bytes", utf8_bytes(texts[k + 1])}});
    }
    content.push_back({{"token", text}, {"logprob", logprob_value(t.logprob)}, {"bytes", utf8_bytes(text)}, {"top_logprobs", top}});
    before.push_back(t.token);
  }
  return {{"content", content}, {"refusal", nullptr}};
}

}  // namespace meshtrain::serve
