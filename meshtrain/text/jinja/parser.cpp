// Tokens -> statements: a recursive-descent parser with Jinja's operator
// precedence.
#include <algorithm>

#include "meshtrain/text/jinja/lexer.h"
#include "meshtrain/text/jinja/template.h"

namespace meshtrain::text::jinja {

namespace {

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

Body parse(const std::string& source) { return Parser(lex(source)).run(); }

}  // namespace meshtrain::text::jinja
