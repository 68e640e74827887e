// Rendering: statements with Jinja's scoping (each loop iteration and macro
// call has its own variables; namespaces carry values out), expressions with
// Python's operators.
#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "meshtrain/text/jinja/builtins.h"
#include "meshtrain/text/jinja/template.h"

namespace meshtrain::text::jinja {

namespace {

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  explicit Renderer(const Dict& globals) {
    scopes_.emplace_back();
    for (auto& [k, v] : Builtins::globals()) scopes_[0][k] = v;
    for (const auto& [k, v] : globals) scopes_[0][k] = v;
    scopes_.emplace_back();  // the template's own variables
  }

  Flow exec(const Body& body, std::string& out) {
    for (const StmtPtr& s : body) {
      const Flow flow = exec(*s, out);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

 private:
  using Scope = std::unordered_map<std::string, Value>;

  [[noreturn]] static void fail(int line, const std::string& what) {
    throw Error("line " + std::to_string(line) + ": " + what);
  }
  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    return Value();
  }

  Flow exec(const Stmt& s, std::string& out);
  Flow exec_for(const Stmt& s, std::string& out);
  void exec_set(const Stmt& s, std::string& out);
  Value macro(const Stmt& s);
  Value eval(const Expr& e);
  Value eval_binary(const Expr& e);
  Value eval_call(const Expr& e);
  Value attribute(const Value& obj, const std::string& name, int line);
  Value item(const Value& obj, const Value& key, int line);
  Value slice(const Expr& e);

  std::vector<Scope> scopes_;
};

Flow Renderer::exec(const Stmt& s, std::string& out) {
  switch (s.kind) {
    case Stmt::Kind::Text: out += s.text; return Flow::Normal;
    case Stmt::Kind::Output: out += eval(*s.expr).str(); return Flow::Normal;
    case Stmt::Kind::If:
      for (const auto& [cond, body] : s.branches) {
        if (!cond || eval(*cond).truthy()) return exec(body, out);
      }
      return Flow::Normal;
    case Stmt::Kind::For: return exec_for(s, out);
    case Stmt::Kind::Set:
    case Stmt::Kind::SetBlock: exec_set(s, out); return Flow::Normal;
    case Stmt::Kind::Macro: scopes_.back()[s.name] = macro(s); return Flow::Normal;
    case Stmt::Kind::CallBlock: {
      // The macro called sees caller() render this block's body here.
      const Body* body = &s.body;
      Value caller = Value::function("caller", [this, body](const Args&, const Kwargs&) {
        std::string text;
        exec(*body, text);
        return Value(text);
      });
      scopes_.push_back({{"caller", caller}});
      out += eval(*s.expr).str();
      scopes_.pop_back();
      return Flow::Normal;
    }
    case Stmt::Kind::Break: return Flow::Break;
    case Stmt::Kind::Continue: return Flow::Continue;
    case Stmt::Kind::Scope: return exec(s.body, out);
  }
  return Flow::Normal;
}

Flow Renderer::exec_for(const Stmt& s, std::string& out) {
  const Value source = eval(*s.expr);
  if (!source.is_list() && !source.is_dict() && !source.is_string() && !source.is_undefined()) {
    fail(s.line, "'" + source.type_name() + "' object is not iterable");
  }
  auto bind = [&](Scope& scope, const Value& v) {
    if (s.targets.size() == 1) {
      scope[s.targets[0]] = v;
      return;
    }
    const List parts = v.iterate();
    if (parts.size() != s.targets.size()) {
      fail(s.line, "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(s.targets.size()));
    }
    for (size_t i = 0; i < parts.size(); ++i) scope[s.targets[i]] = parts[i];
  };
  List items = source.iterate();
  if (s.cond) {
    List kept;
    for (const Value& v : items) {
      scopes_.emplace_back();
      bind(scopes_.back(), v);
      if (eval(*s.cond).truthy()) kept.push_back(v);
      scopes_.pop_back();
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(s.else_body, out);
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    Dict loop = {{"index", Value(i + 1)}, {"index0", Value(i)}, {"revindex", Value(n - i)}, {"revindex0", Value(n - i - 1)},
                 {"first", Value(i == 0)}, {"last", Value(i == n - 1)}, {"length", Value(n)}, {"depth", Value(1)},
                 {"depth0", Value(0)}};
    loop.emplace_back("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value());
    loop.emplace_back("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value());
    loop.emplace_back("cycle", Value::function("cycle", [i](const Args& a, const Kwargs&) {
      return a.empty() ? Value() : a[static_cast<size_t>(i) % a.size()];
    }));
    scopes_.emplace_back();
    bind(scopes_.back(), items[static_cast<size_t>(i)]);
    scopes_.back()["loop"] = Value::dict(std::move(loop));
    const Flow flow = exec(s.body, out);
    scopes_.pop_back();
    if (flow == Flow::Break) break;
  }
  return Flow::Normal;
}

void Renderer::exec_set(const Stmt& s, std::string& out) {
  Value v;
  if (s.kind == Stmt::Kind::SetBlock) {
    std::string text;
    exec(s.body, text);
    v = Value(text);
  } else {
    v = eval(*s.expr);
  }
  if (!s.attr.empty()) {
    Value target = lookup(s.targets[0]);
    if (!target.is_namespace()) fail(s.line, "cannot assign attribute on non-namespace object " + s.targets[0]);
    target.set(s.attr, v);  // namespaces share their storage
    return;
  }
  if (s.targets.size() == 1) {
    scopes_.back()[s.targets[0]] = v;
    return;
  }
  const List parts = v.iterate();
  if (parts.size() != s.targets.size()) fail(s.line, "cannot unpack " + std::to_string(parts.size()) + " values");
  for (size_t i = 0; i < parts.size(); ++i) scopes_.back()[s.targets[i]] = parts[i];
  (void)out;
}

Value Renderer::macro(const Stmt& s) {
  const Stmt* def = &s;
  return Value::function(s.name, [this, def](const Args& args, const Kwargs& kwargs) {
    Scope frame;
    for (size_t i = 0; i < def->params.size(); ++i) {
      Value v = i < args.size() ? args[i] : Value();
      for (const auto& [k, x] : kwargs) {
        if (k == def->params[i]) v = x;
      }
      if (v.is_undefined() && def->defaults[i]) v = eval(*def->defaults[i]);
      frame[def->params[i]] = v;
    }
    const Value caller = lookup("caller");
    if (!caller.is_undefined()) frame["caller"] = caller;
    // A macro sees the globals and the template's variables, not its caller's.
    std::vector<Scope> saved = std::move(scopes_);
    scopes_ = {saved[0], saved[1], std::move(frame)};
    std::string text;
    try {
      exec(def->body, text);
    } catch (...) {
      scopes_ = std::move(saved);
      throw;
    }
    scopes_ = std::move(saved);
    return Value(text);
  });
}

Value Renderer::attribute(const Value& obj, const std::string& name, int line) {
  if (obj.is_undefined()) fail(line, "an undefined value has no attribute '" + name + "'");
  if (Builtins::has_method(obj, name)) {
    const Value self = obj;
    return Value::function(name, [self, name](const Args& a, const Kwargs& kw) { return Builtins::method(self, name, a, kw); });
  }
  return obj.is_dict() ? obj.get(name) : Value();
}

Value Renderer::item(const Value& obj, const Value& key, int line) {
  if (obj.is_undefined()) fail(line, "an undefined value has no item " + key.repr());
  if (obj.is_dict()) {
    const Value v = obj.get(key.str());
    return v.is_undefined() && key.is_string() ? attribute(obj, key.as_string(), line) : v;
  }
  if ((obj.is_list() || obj.is_string()) && key.kind() == Value::Kind::Int) {
    const List items = obj.is_list() ? obj.as_list() : obj.iterate();
    int64_t i = key.as_int();
    if (i < 0) i += static_cast<int64_t>(items.size());
    return i >= 0 && i < static_cast<int64_t>(items.size()) ? items[static_cast<size_t>(i)] : Value();
  }
  return Value();
}

Value Renderer::slice(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  const List items = obj.iterate();
  const int64_t n = static_cast<int64_t>(items.size());
  auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i]) : Value(); };
  const Value step_v = part(3);
  const int64_t step = step_v.is_number() ? step_v.as_int() : 1;
  if (step == 0) fail(e.line, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (!v.is_number()) return fallback;
    int64_t i = v.as_int();
    if (i < 0) i += n;
    return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = clamp(part(1), step > 0 ? 0 : n - 1), stop = clamp(part(2), step > 0 ? n : -1);
  List out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(items[static_cast<size_t>(i)]);
  if (!obj.is_string()) return Value::list(std::move(out));
  std::string text;
  for (const Value& c : out) text += c.as_string();
  return Value(text);
}

Value Renderer::eval(const Expr& e) {
  switch (e.kind) {
    case Expr::Kind::Literal: return e.value;
    case Expr::Kind::Name: return lookup(e.name);
    case Expr::Kind::ListLit: {
      List items;
      for (const ExprPtr& a : e.args) items.push_back(eval(*a));
      return e.value.truthy() ? Value::tuple(std::move(items)) : Value::list(std::move(items));
    }
    case Expr::Kind::DictLit: {
      Value d = Value::dict({});
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) d.set(eval(*e.args[i]).str(), eval(*e.args[i + 1]));
      return d;
    }
    case Expr::Kind::Attr: return attribute(eval(*e.args[0]), e.name, e.line);
    case Expr::Kind::Item: return item(eval(*e.args[0]), eval(*e.args[1]), e.line);
    case Expr::Kind::Slice: return slice(e);
    case Expr::Kind::Call: return eval_call(e);
    case Expr::Kind::Filter: {
      Args args;
      for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
      Kwargs kwargs;
      for (const auto& [k, v] : e.kwargs) kwargs.emplace_back(k, eval(*v));
      try {
        return Builtins::filter(e.name, eval(*e.args[0]), args, kwargs);
      } catch (const Error& err) {
        const std::string what = err.what();
        if (what.rfind("line ", 0) == 0) throw;
        fail(e.line, what);
      }
    }
    case Expr::Kind::Test: {
      Args args;
      for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
      // `x.y is defined` asks about y even where x is undefined.
      Value subject;
      try {
        subject = eval(*e.args[0]);
      } catch (const Error&) {
        if (e.name != "defined" && e.name != "undefined") throw;
      }
      return Value(Builtins::test(e.name, subject, args) != e.negated);
    }
    case Expr::Kind::Unary: {
      const Value v = eval(*e.args[0]);
      if (e.name == "not") return Value(!v.truthy());
      if (!v.is_number()) fail(e.line, "bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
      if (e.name == "+") return v;
      return v.kind() == Value::Kind::Float ? Value(-v.as_double()) : Value(-v.as_int());
    }
    case Expr::Kind::Binary: return eval_binary(e);
    case Expr::Kind::Ternary:
      if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
      return e.args.size() > 2 ? eval(*e.args[2]) : Value();
  }
  return Value();
}

Value Renderer::eval_call(const Expr& e) {
  Args args;
  for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
  Kwargs kwargs;
  for (const auto& [k, v] : e.kwargs) kwargs.emplace_back(k, eval(*v));
  const Value callee = eval(*e.args[0]);
  if (!callee.is_function()) {
    const std::string what = e.args[0]->kind == Expr::Kind::Name || e.args[0]->kind == Expr::Kind::Attr
                                 ? "'" + e.args[0]->name + "'"
                                 : "the value";
    fail(e.line, what + (callee.is_undefined() ? " is undefined" : " is not callable"));
  }
  try {
    return callee.call(args, kwargs);
  } catch (const Error& err) {
    const std::string what = err.what();
    if (what.rfind("line ", 0) == 0 || callee.function_name() == "raise_exception") throw;
    fail(e.line, what);
  }
}

double floor_mod(double a, double b) { return a - b * std::floor(a / b); }

Value arithmetic(const std::string& op, const Value& a, const Value& b, int line) {
  const bool floats = a.kind() == Value::Kind::Float || b.kind() == Value::Kind::Float;
  const double x = a.as_double(), y = b.as_double();
  const int64_t i = a.as_int(), j = b.as_int();
  if ((op == "/" || op == "//" || op == "%") && y == 0) throw Error("line " + std::to_string(line) + ": division by zero");
  if (op == "+") return floats ? Value(x + y) : Value(i + j);
  if (op == "-") return floats ? Value(x - y) : Value(i - j);
  if (op == "*") return floats ? Value(x * y) : Value(i * j);
  if (op == "/") return Value(x / y);
  if (op == "//") return floats ? Value(std::floor(x / y)) : Value(static_cast<int64_t>(std::floor(x / y)));
  if (op == "%") return floats ? Value(floor_mod(x, y)) : Value(static_cast<int64_t>(floor_mod(x, y)));
  return floats || j < 0 ? Value(std::pow(x, y)) : Value(static_cast<int64_t>(std::llround(std::pow(x, y))));  // **
}

bool ordered_less(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list()) {
    const List &l = a.as_list(), &r = b.as_list();
    for (size_t k = 0; k < std::min(l.size(), r.size()); ++k) {
      if (l[k] != r[k]) return ordered_less(l[k], r[k], line);
    }
    return l.size() < r.size();
  }
  throw Error("line " + std::to_string(line) + ": '<' not supported between '" + a.type_name() + "' and '" + b.type_name() + "'");
}

Value Renderer::eval_binary(const Expr& e) {
  const std::string& op = e.name;
  const Value a = eval(*e.args[0]);
  if (op == "and") return a.truthy() ? eval(*e.args[1]) : a;
  if (op == "or") return a.truthy() ? a : eval(*e.args[1]);
  const Value b = eval(*e.args[1]);
  if (op == "~") return Value(a.str() + b.str());
  if (op == "==") return Value(a == b);
  if (op == "!=") return Value(a != b);
  if (op == "<") return Value(ordered_less(a, b, e.line));
  if (op == ">") return Value(ordered_less(b, a, e.line));
  if (op == "<=") return Value(!ordered_less(b, a, e.line));
  if (op == ">=") return Value(!ordered_less(a, b, e.line));
  if (op == "in" || op == "not in") {
    bool found;
    if (b.is_string()) {
      if (!a.is_string()) fail(e.line, "'in <string>' requires string as left operand, not " + a.type_name());
      found = b.as_string().find(a.as_string()) != std::string::npos;
    } else if (b.is_dict()) {
      found = !b.get(a.str()).is_undefined() && a.is_string();
    } else {
      const List items = b.iterate();
      found = std::find(items.begin(), items.end(), a) != items.end();
    }
    return Value(found != (op == "not in"));
  }
  if (op == "+" && a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
  if (op == "+" && a.is_list() && b.is_list()) {
    List items = a.as_list();
    items.insert(items.end(), b.as_list().begin(), b.as_list().end());
    return Value::list(std::move(items));
  }
  if (op == "*" && (a.is_string() || a.is_list()) && b.kind() == Value::Kind::Int) {
    if (a.is_string()) {
      std::string out;
      for (int64_t k = 0; k < b.as_int(); ++k) out += a.as_string();
      return Value(out);
    }
    List items;
    for (int64_t k = 0; k < b.as_int(); ++k) items.insert(items.end(), a.as_list().begin(), a.as_list().end());
    return Value::list(std::move(items));
  }
  if (!a.is_number() || !b.is_number()) {
    fail(e.line, "unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
  }
  return arithmetic(op, a, b, e.line);
}

}  // namespace

Template::Template(const std::string& source) : body_(parse(source)) {}

std::string Template::render(const Dict& globals) const {
  Renderer renderer(globals);
  std::string out;
  renderer.exec(body_, out);
  return out;
}

}  // namespace meshtrain::text::jinja
