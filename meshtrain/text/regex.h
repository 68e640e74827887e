// A compiled Unicode regular expression (PCRE2, UTF + UCP), the dialect of
// the patterns tokenizer files carry (\p{L}, (?i:...), lookahead).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace meshtrain::text {

class Regex {
 public:
  // Throws TokenizerError naming the pattern and where it fails to compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Every non-overlapping match, left to right, as [start, end) byte offsets.
  // Thread-safe; `s` must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  bool search(std::string_view s) const { return !find_all(s).empty(); }

  // A pattern that matches `literal` exactly.
  static std::string escape(std::string_view literal);

 private:
  std::string pattern_;
  pcre2_real_code_8* code_ = nullptr;
};

}  // namespace meshtrain::text
