// Jinja source -> tokens: template text between tags, and each tag's
// expression tokens, with the whitespace rules applied (Note [Jinja whitespace]).
#pragma once

#include <string>
#include <vector>

namespace meshtrain::text::jinja {

struct Token {
  enum class Kind { Text, BlockBegin, BlockEnd, VarBegin, VarEnd, Name, String, Int, Float, Op, End };
  Kind kind;
  std::string text;
  int line;
};

// Throws Error naming the line of a tag or string that is never closed.
std::vector<Token> lex(const std::string& source);

}  // namespace meshtrain::text::jinja
