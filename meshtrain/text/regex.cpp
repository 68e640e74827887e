#include "meshtrain/text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "meshtrain/text/tokenizer.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text {

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                        &offset, nullptr);
  if (!code_) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw TokenizerError("the pattern " + pattern + " does not compile at offset " + std::to_string(offset) + ": " +
                         reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() { pcre2_code_free(code_); }

namespace {

// Matching with backtracking inside a repetition ((?:a|b)* over a long
// text) needs more than the JIT's default 32 KiB of stack: each thread gets
// up to kJitStack, made once. A match that needs more runs again in PCRE2's
// interpreter, its frames on the heap up to kHeapLimit; one that needs more
// still is an error, never a silent end of the matches.
constexpr size_t kJitStack = size_t{8} << 20;
constexpr uint32_t kHeapLimitKib = 256 << 10;

struct MatchContext {
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, kJitStack, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchContext() {
    pcre2_jit_stack_assign(context, nullptr, stack);
    pcre2_set_heap_limit(context, kHeapLimitKib);
  }
  ~MatchContext() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
};

pcre2_match_context* match_context() {
  thread_local MatchContext mine;
  return mine.context;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  // PCRE2 checks the whole subject's UTF-8 on every call unless told not
  // to: once here, or matching every token of a long text is quadratic.
  if (!unicode::valid_utf8(s)) throw TokenizerError("the text is not valid UTF-8");
  std::vector<std::pair<size_t, size_t>> found;
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t start = 0;
  while (start <= s.size()) {
    int rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, match, match_context());
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, match, match_context());
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(match);
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw TokenizerError("the pattern " + pattern_ + " cannot be matched on a text of " + std::to_string(s.size()) +
                           " bytes at byte " + std::to_string(start) + ": " + reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
    found.emplace_back(span[0], span[1]);
    if (span[1] > span[0]) {
      start = span[1];
    } else {  // an empty match: search again one character on
      if (span[1] >= s.size()) break;
      start = span[1] + unicode::char_length(static_cast<unsigned char>(s[span[1]]));
    }
  }
  pcre2_match_data_free(match);
  return found;
}

std::string Regex::escape(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace meshtrain::text
