// A Jinja template, as Hugging Face chat templates use the language:
// statements if / for (loop variables, else, break, continue) / set (and
// namespaces) / macro / call / filter-free blocks, expressions with Python's
// operators and semantics, the usual filters and tests, string and dict
// methods. Whitespace as transformers configures Jinja: trim_blocks and
// lstrip_blocks on, "-" markers honoured, a final newline dropped.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/text/jinja/ast.h"
#include "meshtrain/text/jinja/value.h"

namespace meshtrain::text::jinja {

class Template {
 public:
  // Throws Error naming the line of a syntax error.
  explicit Template(const std::string& source);
  // Renders with `globals` (plus the built-in functions range, namespace,
  // dict, raise_exception, strftime_now). Throws Error.
  std::string render(const Dict& globals) const;

 private:
  Body body_;
};

// Parses a template's source (parser.cpp).
Body parse(const std::string& source);

}  // namespace meshtrain::text::jinja
