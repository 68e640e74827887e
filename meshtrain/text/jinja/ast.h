// A parsed Jinja template: statements, and the expressions in them.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/text/jinja/value.h"

namespace meshtrain::text::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,   // value
    Name,      // name
    ListLit,   // args (a tuple when value is true)
    DictLit,   // kwargs (keys as expressions in args, pairwise: key, value)
    Attr,      // args[0] . name
    Item,      // args[0] [ args[1] ]
    Slice,     // args[0] [ args[1] : args[2] : args[3] ] (null parts absent)
    Call,      // args[0] ( args[1..], kwargs )
    Filter,    // args[0] | name ( args[1..], kwargs )
    Test,      // args[0] is [not] name ( args[1..] )
    Unary,     // name ("-", "+", "not") args[0]
    Binary,    // args[0] name args[1]: + - * / // % ** ~ == != < <= > >= in "not in" and or
    Ternary,   // args[0] if args[1] else args[2] (args[2] may be absent)
  };
  explicit Expr(Kind k) : kind(k) {}
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  bool negated = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    Text,      // text
    Output,    // {{ expr }}
    If,        // branches (a null condition is else)
    For,       // for targets in expr [if cond]: body [else else_body]
    Set,       // set targets (or targets[0].attr) = expr
    SetBlock,  // set targets[0]: body
    Macro,     // macro name(params = defaults): body
    CallBlock, // call expr (a macro call) with body as caller()
    Break,
    Continue,
    Scope,     // a block with no meaning of its own ({% generation %}): body
  };
  explicit Stmt(Kind k, int at = 0) : kind(k), line(at) {}
  Kind kind;
  int line = 0;
  std::string text, name, attr;
  ExprPtr expr, cond;
  std::vector<std::string> targets;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param, null where there is none
};

}  // namespace meshtrain::text::jinja
