// Log-probabilities in the API's shapes: each token spelled as the text it
// adds, with the alternatives the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/serve/completion.h"
#include "meshtrain/serve/openai_api.h"
#include "meshtrain/text/tokenizer.h"

namespace meshtrain::serve {

// Note [Token text]
// A token's text is what decoding adds when it follows the tokens before it
// (the last few are enough context): decoding a token alone loses a
// SentencePiece word's leading space, and a byte-level token may be part of
// a character. Alternatives are spelled against the same context, so a
// client comparing tokens with top_logprobs' keys compares like with like.
class TokenSpeller {
 public:
  explicit TokenSpeller(const text::Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  // The text `id` adds after `before`.
  std::string spell(const std::vector<int64_t>& before, int64_t id) const;
  // The same for several ids after one `before` (a token and its alternatives).
  std::vector<std::string> spell(const std::vector<int64_t>& before, const std::vector<int64_t>& ids) const;

 private:
  const text::Tokenizer& tokenizer_;
};

// Completions' logprobs object {tokens, token_logprobs, top_logprobs,
// text_offset} for `tokens`, which follow `before`; text offsets (in
// characters of the returned text) start at `offset`. `top`: whether
// top_logprobs lists the alternatives (null entries otherwise).
ojson completion_logprobs(const TokenSpeller& speller, const std::vector<TokenLogprob>& tokens,
                          std::vector<int64_t> before, int64_t offset);
// Chat's {"content": [{token, logprob, bytes, top_logprobs}]}.
ojson chat_logprobs(const TokenSpeller& speller, const std::vector<TokenLogprob>& tokens, std::vector<int64_t> before);
// Characters (code points) in UTF-8 text.
int64_t characters(const std::string& text);

}  // namespace meshtrain::serve
