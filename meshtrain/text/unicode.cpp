#include "meshtrain/text/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

namespace meshtrain::text::unicode {

size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  size_t at = 0;
  while (at < s.size()) {
    if (static_cast<unsigned char>(s[at]) < 0x80) {
      ++at;
      continue;
    }
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(p + at, static_cast<utf8proc_ssize_t>(s.size() - at), &cp);
    if (n <= 0 || cp < 0) return at;
    at += static_cast<size_t>(n);
  }
  return s.size();
}

bool valid_utf8(std::string_view s) { return first_invalid_utf8(s) == s.size(); }

uint32_t code_point_at(std::string_view s, size_t at) {
  const auto c = static_cast<unsigned char>(s[at]);
  if (c < 0x80) return c;
  const size_t n = char_length(c);
  uint32_t cp = c & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t i = 1; i < n && at + i < s.size(); ++i) cp = (cp << 6) | (static_cast<unsigned char>(s[at + i]) & 0x3F);
  return cp;
}

std::string encode(uint32_t cp) {
  utf8proc_uint8_t buffer[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buffer);
  return std::string(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

std::vector<std::pair<size_t, uint32_t>> code_points(std::string_view s) {
  std::vector<std::pair<size_t, uint32_t>> out;
  out.reserve(s.size());
  for (size_t at = 0; at < s.size(); at += char_length(static_cast<unsigned char>(s[at]))) {
    out.emplace_back(at, code_point_at(s, at));
  }
  return out;
}

std::string normalize(std::string_view s, Form form) {
  const utf8proc_option_t options = static_cast<utf8proc_option_t>(
      UTF8PROC_STABLE | (form == Form::NFC || form == Form::NFKC ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
      (form == Form::NFKC || form == Form::NFKD ? UTF8PROC_COMPAT : 0));
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &out,
                   options);
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  if (n < 0) return std::string(s);  // only malformed UTF-8 fails, and callers check that first
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const auto& [at, cp] : code_points(s)) {
    if (cp < 0x80) {
      out += static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
    } else if (cp == 0x130) {
      out += "i\xCC\x87";  // İ lowercases to two characters
    } else {
      out += encode(static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
    }
  }
  return out;
}

uint32_t to_upper(uint32_t cp) { return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))); }

std::string strip_marks(std::string_view s) {
  std::string out;
  for (const auto& [at, cp] : code_points(s)) {
    const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    if (c < UTF8PROC_CATEGORY_MN || c > UTF8PROC_CATEGORY_ME) {
      out.append(s.substr(at, char_length(static_cast<unsigned char>(s[at]))));
    }
  }
  return out;
}

bool is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool is_punctuation(uint32_t cp) {
  if (cp < 0x80) return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) || (cp >= 123 && cp <= 126);
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

bool is_numeric(uint32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_alphanumeric(uint32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || is_numeric(cp);
}

bool is_word_char(uint32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_ND) || c == UTF8PROC_CATEGORY_NL ||
         c == UTF8PROC_CATEGORY_PC || cp == 0x200C || cp == 0x200D;
}

namespace {

struct ByteTable {
  std::string chars[256];
  int bytes[324];  // U+0000..U+0143 cover the table
  ByteTable() {
    for (int& b : bytes) b = -1;
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256u + static_cast<uint32_t>(next++);
      chars[b] = encode(cp);
      bytes[cp] = b;
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

}  // namespace

const std::string& byte_char(uint8_t byte) { return byte_table().chars[byte]; }

int char_byte(uint32_t cp) { return cp < 324 ? byte_table().bytes[cp] : -1; }

}  // namespace meshtrain::text::unicode
