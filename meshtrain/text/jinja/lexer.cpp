#include "meshtrain/text/jinja/lexer.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>

#include "meshtrain/text/jinja/value.h"

namespace meshtrain::text::jinja {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Note [Jinja whitespace]
// transformers renders chat templates with trim_blocks and lstrip_blocks:
// a block or comment tag's first newline after it goes, and so do the spaces
// and tabs before it on its own line (unless it opens with "{%+"). A "-"
// inside a tag's delimiter strips all whitespace on that side. Jinja drops
// one newline at the very end of the source.
class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(source) {
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    if (!src_.empty() && src_.back() == '\r') src_.pop_back();
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const size_t at = next_tag(pos_);
      std::string text = src_.substr(pos_, at - pos_);
      if (at == src_.size()) {
        emit_text(std::move(text));
        break;
      }
      const char type = src_[at + 1];  // '{', '%' or '#'
      const char modifier = at + 2 < src_.size() ? src_[at + 2] : '\0';
      if (modifier == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (type != '{' && modifier != '+') {
        lstrip_line(text);
      }
      emit_text(std::move(text));
      pos_ = at + 2 + (modifier == '-' || modifier == '+' ? 1 : 0);
      line_starting_ = false;
      if (type == '#') {
        comment();
      } else {
        tag(type == '%');
      }
    }
    tokens_.push_back({Token::Kind::End, "", line_});
    return std::move(tokens_);
  }

 private:
  size_t next_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }
  void lstrip_line(std::string& text) const {
    const size_t newline = text.rfind('\n');
    const size_t from = newline == std::string::npos ? 0 : newline + 1;
    if (newline == std::string::npos && !line_starting_) return;
    for (size_t i = from; i < text.size(); ++i) {
      if (text[i] != ' ' && text[i] != '\t') return;
    }
    text.erase(from);
  }
  void emit_text(std::string text) {
    for (char c : text) line_ += c == '\n';
    if (!text.empty()) tokens_.push_back({Token::Kind::Text, std::move(text), line_});
  }
  // After a tag: "-" strips the whitespace that follows, trim_blocks one newline.
  void after_tag(bool strip, bool block) {
    const size_t start = pos_;
    if (strip) {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
    } else if (block && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    } else if (block && pos_ + 1 < src_.size() && src_[pos_] == '\r' && src_[pos_ + 1] == '\n') {
      pos_ += 2;
    }
    for (size_t i = start; i < pos_; ++i) line_ += src_[i] == '\n';
    line_starting_ = pos_ > start && src_[pos_ - 1] == '\n';
  }
  void comment() {
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) throw Error("line " + std::to_string(line_) + ": a comment {# is never closed");
    for (size_t i = pos_; i < end; ++i) line_ += src_[i] == '\n';
    const bool strip = end > pos_ && src_[end - 1] == '-';
    pos_ = end + 2;
    after_tag(strip, true);
  }
  void tag(bool block) {
    const int opened = line_;
    tokens_.push_back({block ? Token::Kind::BlockBegin : Token::Kind::VarBegin, "", line_});
    const char* close = block ? "%}" : "}}";
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) line_ += src_[pos_++] == '\n';
      if (pos_ >= src_.size()) {
        throw Error("line " + std::to_string(opened) + ": this " + (block ? "{%" : "{{") + " is never closed");
      }
      if (depth == 0 && src_.compare(pos_, 3, std::string("-") + close) == 0) {
        pos_ += 3;
        tokens_.push_back({block ? Token::Kind::BlockEnd : Token::Kind::VarEnd, "", line_});
        return after_tag(true, block);
      }
      if (depth == 0 && src_.compare(pos_, 2, close) == 0) {
        pos_ += 2;
        tokens_.push_back({block ? Token::Kind::BlockEnd : Token::Kind::VarEnd, "", line_});
        return after_tag(false, block);
      }
      const char c = src_[pos_];
      if (c == '(' || c == '[' || c == '{') ++depth;
      if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
      expression_token();
    }
  }
  void expression_token() {
    const char c = src_[pos_];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      const size_t start = pos_;
      while (pos_ < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
      tokens_.push_back({Token::Kind::Name, src_.substr(start, pos_ - start), line_});
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      number();
    } else if (c == '\'' || c == '"') {
      string(c);
    } else {
      for (const char* op : {"**", "//", "==", "!=", "<=", ">="}) {
        if (src_.compare(pos_, 2, op) == 0) {
          tokens_.push_back({Token::Kind::Op, op, line_});
          pos_ += 2;
          return;
        }
      }
      if (!std::strchr("+-*/%~|.,:()[]{}<>=", c)) {
        throw Error("line " + std::to_string(line_) + ": unexpected character '" + std::string(1, c) + "'");
      }
      tokens_.push_back({Token::Kind::Op, std::string(1, c), line_});
      ++pos_;
    }
  }
  void number() {
    const size_t start = pos_;
    bool is_float = false;
    while (pos_ < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && std::isdigit(static_cast<unsigned char>(src_[pos_ + 1]))) {
      is_float = true;
      ++pos_;
      while (pos_ < src_.size() && std::isdigit(static_cast<unsigned char>(src_[pos_]))) ++pos_;
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      is_float = true;
      ++pos_;
      if (pos_ < src_.size() && (src_[pos_] == '+' || src_[pos_] == '-')) ++pos_;
      while (pos_ < src_.size() && std::isdigit(static_cast<unsigned char>(src_[pos_]))) ++pos_;
    }
    std::string text = src_.substr(start, pos_ - start);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    tokens_.push_back({is_float ? Token::Kind::Float : Token::Kind::Int, text, line_});
  }
  void string(char quote) {
    std::string out;
    ++pos_;
    while (pos_ < src_.size() && src_[pos_] != quote) {
      char c = src_[pos_++];
      if (c == '\n') ++line_;
      if (c != '\\' || pos_ >= src_.size()) {
        out += c;
        continue;
      }
      const char e = src_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '0': out += '\0'; break;
        case 'u':
        case 'x': {
          const size_t n = e == 'u' ? 4 : 2;
          const uint32_t cp = static_cast<uint32_t>(std::stoul(src_.substr(pos_, n), nullptr, 16));
          pos_ += n;
          out += encode_utf8(cp);
          break;
        }
        case '\\':
        case '\'':
        case '"': out += e; break;
        default: out += '\\', out += e;
      }
    }
    if (pos_ >= src_.size()) throw Error("line " + std::to_string(line_) + ": a string is never closed");
    ++pos_;
    tokens_.push_back({Token::Kind::String, out, line_});
  }
  static std::string encode_utf8(uint32_t cp) {
    std::string out;
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return out;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) { return Lexer(source).run(); }

}  // namespace meshtrain::text::jinja
