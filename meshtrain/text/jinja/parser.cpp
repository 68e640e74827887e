// Jinja source -> statements: a lexer that applies the whitespace rules, and
// a recursive-descent parser with Jinja's operator precedence.
#include <algorithm>
#include <cctype>
#include <cstring>

#include "meshtrain/text/jinja/template.h"

namespace meshtrain::text::jinja {

namespace {

struct Token {
  enum class Kind { Text, BlockBegin, BlockEnd, VarBegin, VarEnd, Name, String, Int, Float, Op, End };
  Kind kind;
  std::string text;
  int line;
};

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

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body run() {
    Body body = statements({});
    if (peek().kind != Token::Kind::End) fail("unexpected {% " + peek_block_name() + " %}");
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(at_ + ahead, tokens_.size() - 1)]; }
  const Token& next() { return tokens_[std::min(at_++, tokens_.size() - 1)]; }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error("line " + std::to_string(peek().line) + ": " + what);
  }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Op && peek(ahead).text == op;
  }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Name && peek(ahead).text == name;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', found '" + peek().text + "'");
    ++at_;
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::Name) fail("expected a name, found '" + peek().text + "'");
    return next().text;
  }
  void expect_block_end() {
    if (peek().kind != Token::Kind::BlockEnd) fail("expected the end of the tag, found '" + peek().text + "'");
    ++at_;
  }
  std::string peek_block_name() const { return peek().kind == Token::Kind::BlockBegin ? peek(1).text : peek().text; }

  // Statements until a {% name %} in `stops` (not consumed) or the end.
  Body statements(const std::vector<std::string>& stops) {
    Body body;
    while (peek().kind != Token::Kind::End) {
      const Token& t = peek();
      if (t.kind == Token::Kind::Text) {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Text);
        s->text = next().text;
        body.push_back(std::move(s));
      } else if (t.kind == Token::Kind::VarBegin) {
        ++at_;
        auto s = std::make_unique<Stmt>(Stmt::Kind::Output);
        s->line = t.line;
        s->expr = expression();
        if (peek().kind != Token::Kind::VarEnd) fail("expected '}}', found '" + peek().text + "'");
        ++at_;
        body.push_back(std::move(s));
      } else if (t.kind == Token::Kind::BlockBegin) {
        const std::string name = peek(1).text;
        if (std::find(stops.begin(), stops.end(), name) != stops.end()) return body;
        at_ += 2;
        body.push_back(block(name, t.line));
      } else {
        fail("unexpected '" + t.text + "'");
      }
    }
    if (!stops.empty()) fail("missing {% " + stops.back() + " %}");
    return body;
  }
  void end_tag(const char* name) {
    if (peek().kind != Token::Kind::BlockBegin || peek(1).text != name) fail(std::string("expected {% ") + name + " %}");
    at_ += 2;
    expect_block_end();
  }

  StmtPtr block(const std::string& name, int line) {
    if (name == "if") return if_block(line);
    if (name == "for") return for_block(line);
    if (name == "set") return set_block(line);
    if (name == "macro") return macro_block(line);
    if (name == "call") return call_block(line);
    if (name == "break" || name == "continue") {
      expect_block_end();
      return std::make_unique<Stmt>(name == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue, line);
    }
    if (name == "generation" || name == "raw") {
      expect_block_end();
      auto s = std::make_unique<Stmt>(Stmt::Kind::Scope, line);
      s->body = statements({"end" + name});
      end_tag(("end" + name).c_str());
      return s;
    }
    fail("unknown tag {% " + name + " %}");
  }

  StmtPtr if_block(int line) {
    auto s = std::make_unique<Stmt>(Stmt::Kind::If, line);
    ExprPtr cond = expression();
    expect_block_end();
    while (true) {
      Body body = statements({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      const std::string tag = peek(1).text;
      at_ += 2;
      if (tag == "endif") {
        expect_block_end();
        break;
      }
      if (tag == "else") {
        expect_block_end();
        s->branches.emplace_back(nullptr, statements({"endif"}));
        end_tag("endif");
        break;
      }
      cond = expression();
      expect_block_end();
    }
    return s;
  }

  StmtPtr for_block(int line) {
    auto s = std::make_unique<Stmt>(Stmt::Kind::For, line);
    s->targets.push_back(expect_name());
    while (is_op(",")) {
      ++at_;
      s->targets.push_back(expect_name());
    }
    if (!is_name("in")) fail("expected 'in' in a for loop");
    ++at_;
    s->expr = ternary(/*allow_condition=*/false);
    if (is_name("if")) {
      ++at_;
      s->cond = ternary(false);
    }
    if (is_name("recursive")) fail("recursive loops are not supported");
    expect_block_end();
    s->body = statements({"else", "endfor"});
    if (peek(1).text == "else") {
      at_ += 2;
      expect_block_end();
      s->else_body = statements({"endfor"});
    }
    end_tag("endfor");
    return s;
  }

  StmtPtr set_block(int line) {
    auto s = std::make_unique<Stmt>(Stmt::Kind::Set, line);
    s->targets.push_back(expect_name());
    if (is_op(".")) {
      ++at_;
      s->attr = expect_name();
    }
    while (is_op(",")) {
      ++at_;
      s->targets.push_back(expect_name());
    }
    if (peek().kind == Token::Kind::BlockEnd) {
      ++at_;
      s->kind = Stmt::Kind::SetBlock;
      s->body = statements({"endset"});
      end_tag("endset");
      return s;
    }
    expect_op("=");
    s->expr = expression();
    expect_block_end();
    return s;
  }

  StmtPtr macro_block(int line) {
    auto s = std::make_unique<Stmt>(Stmt::Kind::Macro, line);
    s->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      s->params.push_back(expect_name());
      if (is_op("=")) {
        ++at_;
        s->defaults.push_back(expression());
      } else {
        s->defaults.push_back(nullptr);
      }
      if (!is_op(",")) break;
      ++at_;
    }
    expect_op(")");
    expect_block_end();
    s->body = statements({"endmacro"});
    end_tag("endmacro");
    return s;
  }

  StmtPtr call_block(int line) {
    auto s = std::make_unique<Stmt>(Stmt::Kind::CallBlock, line);
    s->expr = expression();
    expect_block_end();
    s->body = statements({"endcall"});
    end_tag("endcall");
    return s;
  }

  // ---- expressions, loosest first ----
  ExprPtr expression() { return ternary(true); }

  ExprPtr make(Expr::Kind kind, std::string name = "") {
    auto e = std::make_unique<Expr>(kind);
    e->line = peek().line;
    e->name = std::move(name);
    return e;
  }
  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right) {
    ExprPtr e = make(Expr::Kind::Binary, std::move(op));
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr ternary(bool allow_condition) {
    ExprPtr value = or_expr();
    if (!allow_condition || !is_name("if")) return value;
    ++at_;
    ExprPtr e = make(Expr::Kind::Ternary);
    e->args.push_back(std::move(value));
    e->args.push_back(or_expr());
    if (is_name("else")) {
      ++at_;
      e->args.push_back(ternary(true));
    }
    return e;
  }
  ExprPtr or_expr() {
    ExprPtr left = and_expr();
    while (is_name("or")) {
      ++at_;
      left = binary("or", std::move(left), and_expr());
    }
    return left;
  }
  ExprPtr and_expr() {
    ExprPtr left = not_expr();
    while (is_name("and")) {
      ++at_;
      left = binary("and", std::move(left), not_expr());
    }
    return left;
  }
  ExprPtr not_expr() {
    if (!is_name("not")) return compare();
    ++at_;
    ExprPtr e = make(Expr::Kind::Unary, "not");
    e->args.push_back(not_expr());
    return e;
  }
  ExprPtr compare() {
    ExprPtr left = math1();
    while (true) {
      std::string op;
      if (peek().kind == Token::Kind::Op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
           peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        ++at_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        at_ += 2;
        op = "not in";
      } else {
        return left;
      }
      left = binary(op, std::move(left), math1());
    }
  }
  ExprPtr math1() {
    ExprPtr left = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().text;
      left = binary(op, std::move(left), concat());
    }
    return left;
  }
  ExprPtr concat() {
    ExprPtr left = math2();
    while (is_op("~")) {
      ++at_;
      left = binary("~", std::move(left), math2());
    }
    return left;
  }
  ExprPtr math2() {
    ExprPtr left = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().text;
      left = binary(op, std::move(left), power());
    }
    return left;
  }
  ExprPtr power() {
    ExprPtr left = unary(true);
    while (is_op("**")) {
      ++at_;
      left = binary("**", std::move(left), unary(true));
    }
    return left;
  }
  ExprPtr unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make(Expr::Kind::Unary, next().text);
      e->args.push_back(unary(false));
    } else {
      e = postfix(primary());
    }
    if (with_filter) return filters(std::move(e));
    return e;
  }
  ExprPtr primary();
  ExprPtr postfix(ExprPtr e);
  ExprPtr filters(ExprPtr e);
  void call_arguments(Expr& call);

  std::vector<Token> tokens_;
  size_t at_ = 0;
};

ExprPtr Parser::primary() {
  const Token t = next();
  switch (t.kind) {
    case Token::Kind::String: {
      ExprPtr e = make(Expr::Kind::Literal);
      std::string s = t.text;
      while (peek().kind == Token::Kind::String) s += next().text;  // adjacent literals join
      e->value = Value(s);
      return e;
    }
    case Token::Kind::Int: {
      ExprPtr e = make(Expr::Kind::Literal);
      e->value = Value(static_cast<int64_t>(std::stoll(t.text)));
      return e;
    }
    case Token::Kind::Float: {
      ExprPtr e = make(Expr::Kind::Literal);
      e->value = Value(std::stod(t.text));
      return e;
    }
    case Token::Kind::Name: {
      ExprPtr e = make(Expr::Kind::Literal);
      if (t.text == "true" || t.text == "True") {
        e->value = Value(true);
      } else if (t.text == "false" || t.text == "False") {
        e->value = Value(false);
      } else if (t.text == "none" || t.text == "None") {
        e->value = Value::none();
      } else {
        e->kind = Expr::Kind::Name;
        e->name = t.text;
      }
      return e;
    }
    case Token::Kind::Op:
      if (t.text == "(") {
        ExprPtr inner = expression();
        if (is_op(",")) {  // a tuple: a list to us
          ExprPtr list = make(Expr::Kind::ListLit);
          list->value = Value(true);
          list->args.push_back(std::move(inner));
          while (is_op(",")) {
            ++at_;
            if (is_op(")")) break;
            list->args.push_back(expression());
          }
          inner = std::move(list);
        }
        expect_op(")");
        return inner;
      }
      if (t.text == "[") {
        ExprPtr list = make(Expr::Kind::ListLit);
        while (!is_op("]")) {
          list->args.push_back(expression());
          if (!is_op(",")) break;
          ++at_;
        }
        expect_op("]");
        return list;
      }
      if (t.text == "{") {
        ExprPtr dict = make(Expr::Kind::DictLit);
        while (!is_op("}")) {
          dict->args.push_back(expression());
          expect_op(":");
          dict->args.push_back(expression());
          if (!is_op(",")) break;
          ++at_;
        }
        expect_op("}");
        return dict;
      }
      [[fallthrough]];
    default:
      --at_;
      fail("unexpected '" + t.text + "' in an expression");
  }
}

ExprPtr Parser::postfix(ExprPtr e) {
  while (true) {
    if (is_op(".")) {
      ++at_;
      ExprPtr attr = make(Expr::Kind::Attr);
      if (peek().kind == Token::Kind::Int) {  // x.0 is x[0]
        attr->kind = Expr::Kind::Item;
        attr->args.push_back(std::move(e));
        ExprPtr index = make(Expr::Kind::Literal);
        index->value = Value(static_cast<int64_t>(std::stoll(next().text)));
        attr->args.push_back(std::move(index));
      } else {
        attr->name = expect_name();
        attr->args.push_back(std::move(e));
      }
      e = std::move(attr);
    } else if (is_op("[")) {
      ++at_;
      ExprPtr parts[3];
      bool slice = false;
      for (int i = 0; i < 3; ++i) {
        if (!is_op(":") && !is_op("]")) parts[i] = expression();
        if (!is_op(":")) break;
        ++at_;
        slice = true;
      }
      expect_op("]");
      ExprPtr item = make(slice ? Expr::Kind::Slice : Expr::Kind::Item);
      item->args.push_back(std::move(e));
      for (int i = 0; i < (slice ? 3 : 1); ++i) item->args.push_back(std::move(parts[i]));
      e = std::move(item);
    } else if (is_op("(")) {
      ExprPtr call = make(Expr::Kind::Call);
      call->args.push_back(std::move(e));
      call_arguments(*call);
      e = std::move(call);
    } else {
      return e;
    }
  }
}

void Parser::call_arguments(Expr& call) {
  expect_op("(");
  while (!is_op(")")) {
    if (peek().kind == Token::Kind::Name && is_op("=", 1)) {
      std::string key = next().text;
      ++at_;
      call.kwargs.emplace_back(std::move(key), expression());
    } else {
      call.args.push_back(expression());
    }
    if (!is_op(",")) break;
    ++at_;
  }
  expect_op(")");
}

ExprPtr Parser::filters(ExprPtr e) {
  while (true) {
    if (is_op("|")) {
      ++at_;
      ExprPtr f = make(Expr::Kind::Filter, expect_name());
      f->args.push_back(std::move(e));
      if (is_op("(")) call_arguments(*f);
      e = std::move(f);
    } else if (is_name("is")) {
      ++at_;
      ExprPtr t = make(Expr::Kind::Test);
      if (is_name("not")) {
        ++at_;
        t->negated = true;
      }
      t->name = expect_name();
      t->args.push_back(std::move(e));
      if (is_op("(")) {
        call_arguments(*t);
      } else if (peek().kind == Token::Kind::String || peek().kind == Token::Kind::Int ||
                 peek().kind == Token::Kind::Float ||
                 (peek().kind == Token::Kind::Name && !is_name("and") && !is_name("or") && !is_name("else") &&
                  !is_name("if") && !is_name("in") && !is_name("not") && !is_name("is"))) {
        t->args.push_back(postfix(primary()));  // `x is divisibleby 3`, `x is sameas y`
      }
      e = std::move(t);
    } else {
      return e;
    }
  }
}

}  // namespace

Body parse(const std::string& source) { return Parser(Lexer(source).run()).run(); }

}  // namespace meshtrain::text::jinja
