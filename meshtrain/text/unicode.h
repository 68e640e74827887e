// The Unicode a tokenizer needs: walking UTF-8, normalization forms, case,
// character classes, and GPT-2's byte <-> printable character table.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::text::unicode {

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or bytes past U+10FFFF).
bool valid_utf8(std::string_view s);
// The byte offset of the first malformed sequence, or s.size() when valid.
size_t first_invalid_utf8(std::string_view s);

// The length in bytes of the character starting with byte `lead`.
inline size_t char_length(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }
// The code point starting at s[at] (s valid UTF-8).
uint32_t code_point_at(std::string_view s, size_t at);
std::string encode(uint32_t cp);
// Each character of valid UTF-8 as (offset, code point).
std::vector<std::pair<size_t, uint32_t>> code_points(std::string_view s);

enum class Form { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, Form form);
// Full lowercase mapping, as Rust's str::to_lowercase.
std::string lowercase(std::string_view s);
uint32_t to_upper(uint32_t cp);  // simple uppercase mapping
// Drops combining marks (categories Mn, Mc, Me), as HF's StripAccents after NFD.
std::string strip_marks(std::string_view s);

bool is_whitespace(uint32_t cp);   // the White_Space property (Rust's char::is_whitespace)
bool is_punctuation(uint32_t cp);  // ASCII punctuation or a P* category
bool is_numeric(uint32_t cp);      // categories Nd, Nl, No (Rust's char::is_numeric)
bool is_alphanumeric(uint32_t cp);
// What Rust's \w matches: letters, marks, Nd and Nl numbers, connector punctuation, joiners.
bool is_word_char(uint32_t cp);

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
// others for U+0100 onwards, so that any byte string reads as printable text.
const std::string& byte_char(uint8_t byte);
// The byte a character stands for, or -1 for a character outside the table.
int char_byte(uint32_t cp);

}  // namespace meshtrain::text::unicode
