// Generated tokens turned into text as they come: stop strings, and text held
// back until it is final.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::model {

// Note [Text stream]
// A stream of generated tokens becomes text in pieces that never have to be
// taken back: a piece ends before any suffix that could still grow into a stop
// string, and before an incomplete UTF-8 character (a byte-level tokenizer
// emits a character's bytes one token at a time). When a stop string appears
// the text ends just before it, the stop string itself is not emitted (as
// OpenAI's API does), and stopped() turns true; so does the end-of-text token. Concatenating every push()
// and finish() gives the final text, less the first bytes of a character that
// generation ended inside (they would print as U+FFFD).
class TextStream {
 public:
  using Decode = std::function<std::string(const std::vector<int64_t>&)>;
  // `end_tokens`: the tokenizer's stop ids (each stops the stream and emits nothing).
  TextStream(Decode decode, std::vector<std::string> stop, std::vector<int64_t> end_tokens = {});

  // Adds a token and returns the text that became final (often empty).
  std::string push(int64_t token);
  // The text still held back (call once, when generation ended).
  std::string finish();
  bool stopped() const { return stopped_; }
  const std::vector<int64_t>& tokens() const { return tokens_; }

 private:
  Decode decode_;
  std::vector<std::string> stop_;
  std::vector<int64_t> end_tokens_;
  std::vector<int64_t> tokens_;
  std::string text_;      // all tokens decoded
  size_t emitted_ = 0;    // bytes of text_ already returned
  bool stopped_ = false;
};

// The number of bytes at the end of `text` that begin a UTF-8 character
// whose remaining bytes have not arrived (0 when the text ends whole).
size_t incomplete_utf8_tail(const std::string& text);

}  // namespace meshtrain::model
