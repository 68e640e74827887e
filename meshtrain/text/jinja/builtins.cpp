#include "meshtrain/text/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <ctime>

#include "meshtrain/text/unicode.h"

namespace meshtrain::text::jinja {

namespace {

// The i-th positional argument, else the keyword `name`, else `fallback`.
Value arg(const Args& args, const Kwargs& kwargs, size_t i, const char* name, Value fallback = Value()) {
  if (i < args.size()) return args[i];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return v;
  }
  return fallback;
}

bool python_space(uint32_t cp) { return unicode::is_whitespace(cp) || (cp >= 0x1C && cp <= 0x1F); }

std::string upper(const std::string& s) {
  std::string out;
  for (const auto& [at, cp] : unicode::code_points(s)) {
    out += cp < 0x80 ? std::string(1, static_cast<char>(std::toupper(static_cast<int>(cp)))) : unicode::encode(unicode::to_upper(cp));
  }
  return out;
}

std::string lower(const std::string& s) { return unicode::lowercase(s); }

std::string capitalize(const std::string& s) {
  if (s.empty()) return s;
  const size_t first = unicode::char_length(static_cast<unsigned char>(s[0]));
  return upper(s.substr(0, first)) + lower(s.substr(first));
}

std::string title(const std::string& s) {
  std::string out;
  bool previous_cased = false;
  for (const auto& [at, cp] : unicode::code_points(s)) {
    const std::string c = s.substr(at, unicode::char_length(static_cast<unsigned char>(s[at])));
    const bool cased = unicode::is_alphanumeric(cp) && !unicode::is_numeric(cp);
    out += cased ? (previous_cased ? lower(c) : upper(c)) : c;
    previous_cased = cased;
  }
  return out;
}

std::string replace(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  size_t at = 0;
  for (int64_t n = 0; (count < 0 || n < count) && (at = s.find(from, at)) != std::string::npos; ++n) {
    s.replace(at, from.size(), to);
    at += to.size();
  }
  return s;
}

Value split(const std::string& s, const Value& sep, int64_t max_split) {
  List parts;
  if (sep.is_undefined() || sep.is_none()) {  // runs of whitespace; the ends ignored
    const auto cps = unicode::code_points(s);
    size_t i = 0;
    auto offset = [&](size_t k) { return k < cps.size() ? cps[k].first : s.size(); };
    while (true) {
      while (i < cps.size() && python_space(cps[i].second)) ++i;
      if (i == cps.size()) break;
      if (max_split >= 0 && static_cast<int64_t>(parts.size()) == max_split) {
        parts.emplace_back(s.substr(offset(i)));
        break;
      }
      const size_t start = i;
      while (i < cps.size() && !python_space(cps[i].second)) ++i;
      parts.emplace_back(s.substr(offset(start), offset(i) - offset(start)));
    }
    return Value::list(std::move(parts));
  }
  const std::string& d = sep.as_string();
  if (d.empty()) throw Error("empty separator");
  size_t start = 0, at = 0;
  while ((max_split < 0 || static_cast<int64_t>(parts.size()) < max_split) && (at = s.find(d, start)) != std::string::npos) {
    parts.emplace_back(s.substr(start, at - start));
    start = at + d.size();
  }
  parts.emplace_back(s.substr(start));
  return Value::list(std::move(parts));
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  throw Error("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

// An item's attribute for selectattr / map / sort / join: "a.b" walks dicts and lists.
Value attribute_of(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (v.is_list() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      const size_t i = std::stoul(part);
      v = i < v.as_list().size() ? v.as_list()[i] : Value();
    } else {
      v = v.get(part);
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

Value tojson(const Value& v, const Args& args, const Kwargs& kwargs) {
  const Value indent = arg(args, kwargs, 1, "indent");
  const Value separators = arg(args, kwargs, 2, "separators");
  const bool sort_keys = arg(args, kwargs, 3, "sort_keys", Value(false)).truthy();
  const int width = indent.is_number() ? static_cast<int>(indent.as_int()) : -1;
  std::string item_sep = width >= 0 ? "," : ", ", key_sep = ": ";
  if (separators.is_list() && separators.as_list().size() == 2) {
    item_sep = separators.as_list()[0].str(), key_sep = separators.as_list()[1].str();
  }
  return Value(to_json_text(v, width, item_sep, key_sep, sort_keys));
}

Value indent(const Value& v, const Args& args, const Kwargs& kwargs) {
  const Value width = arg(args, kwargs, 0, "width", Value(4));
  const std::string pad = width.is_string() ? width.as_string() : std::string(static_cast<size_t>(width.as_int()), ' ');
  const bool first = arg(args, kwargs, 1, "first", Value(false)).truthy();
  const bool blank = arg(args, kwargs, 2, "blank", Value(false)).truthy();
  const std::string s = v.str();
  std::string out;
  size_t start = 0;
  for (bool line_one = true; start <= s.size(); line_one = false) {
    const size_t end = s.find('\n', start);
    const std::string line = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if ((!line_one || first) && (blank || !line.empty())) out += pad;
    out += line;
    if (end == std::string::npos) break;
    out += '\n';
    start = end + 1;
  }
  return Value(out);
}

// select / reject / selectattr / rejectattr.
Value select(const Value& v, const Args& args, const Kwargs& kwargs, bool by_attribute, bool keep) {
  const size_t first_test_arg = by_attribute ? 1 : 0;
  const std::string attr = by_attribute ? arg(args, kwargs, 0, "attribute").str() : "";
  const Value test = arg(args, kwargs, first_test_arg, "test");
  const Args test_args(args.size() > first_test_arg + 1 ? args.begin() + static_cast<long>(first_test_arg) + 1 : args.end(), args.end());
  List out;
  for (const Value& item : v.iterate()) {
    const Value subject = by_attribute ? attribute_of(item, attr) : item;
    const bool pass = test.is_undefined() ? subject.truthy() : Builtins::test(test.str(), subject, test_args);
    if (pass == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value map(const Value& v, const Args& args, const Kwargs& kwargs) {
  List out;
  const Value attribute = arg({}, kwargs, 0, "attribute");
  for (const Value& item : v.iterate()) {
    if (!attribute.is_undefined()) {
      Value got = attribute_of(item, attribute.str());
      out.push_back(got.is_undefined() ? arg({}, kwargs, 0, "default") : got);
    } else {
      if (args.empty()) throw Error("map needs a filter name or attribute=");
      out.push_back(Builtins::filter(args[0].str(), item, Args(args.begin() + 1, args.end()), {}));
    }
  }
  return Value::list(std::move(out));
}

Value sort(const Value& v, const Args& args, const Kwargs& kwargs) {
  List items = v.iterate();
  const bool reverse = arg(args, kwargs, 0, "reverse", Value(false)).truthy();
  const Value attribute = arg(args, kwargs, 2, "attribute");
  auto key = [&](const Value& x) { return attribute.is_undefined() ? x : attribute_of(x, attribute.str()); };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) { return less(key(a), key(b)); });
  if (reverse) std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value number_filter(const std::string& name, const Value& v, const Args& args, const Kwargs& kwargs) {
  if (name == "abs") return v.kind() == Value::Kind::Float ? Value(std::fabs(v.as_double())) : Value(static_cast<int64_t>(std::llabs(v.as_int())));
  if (name == "round") {
    const double scale = std::pow(10.0, static_cast<double>(arg(args, kwargs, 0, "precision", Value(0)).as_int()));
    const std::string method = arg(args, kwargs, 1, "method", Value("common")).str();
    const double x = v.as_double() * scale;
    return Value((method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x)) / scale);
  }
  const bool to_int = name == "int";
  const Value fallback = arg(args, kwargs, 0, "default", to_int ? Value(0) : Value(0.0));
  if (v.is_number()) return to_int ? Value(v.as_int()) : Value(v.as_double());
  if (!v.is_string()) return fallback;
  try {
    size_t used = 0;
    const std::string s = python_strip(v.as_string(), Value(), true, true);
    const double d = std::stod(s, &used);
    if (used != s.size()) return fallback;
    return to_int ? Value(static_cast<int64_t>(d)) : Value(d);
  } catch (const std::exception&) {
    return fallback;
  }
}

Value sequence_filter(const std::string& name, const Value& v, const Args& args, const Kwargs& kwargs) {
  if (name == "first" || name == "last") {
    const List items = v.iterate();
    return items.empty() ? Value() : name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::string out;
      for (const Value& c : v.iterate()) out = c.as_string() + out;
      return Value(out);
    }
    List items = v.iterate();
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (name == "unique") {
    List out;
    for (const Value& item : v.iterate()) {
      if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  if (name == "sum") {
    Value total = arg(args, kwargs, 1, "start", Value(0));
    const Value attribute = arg(args, kwargs, 0, "attribute");
    for (const Value& item : v.iterate()) {
      const Value x = attribute.is_undefined() ? item : attribute_of(item, attribute.str());
      total = total.kind() == Value::Kind::Float || x.kind() == Value::Kind::Float ? Value(total.as_double() + x.as_double())
                                                                                  : Value(total.as_int() + x.as_int());
    }
    return total;
  }
  if (name == "min" || name == "max") {
    const List items = v.iterate();
    if (items.empty()) return Value();
    return *std::min_element(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      return name == "min" ? less(a, b) : less(b, a);
    });
  }
  if (name == "join") {
    const std::string sep = arg(args, kwargs, 0, "d", Value("")).str();
    const Value attribute = arg(args, kwargs, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& item : v.iterate()) {
      out += (first ? "" : sep) + (attribute.is_undefined() ? item : attribute_of(item, attribute.str())).str();
      first = false;
    }
    return Value(out);
  }
  if (name == "items") {
    List out;
    if (v.is_dict()) {
      for (const auto& [k, x] : v.as_dict()) out.push_back(Value::tuple({Value(k), x}));
    }
    return Value::list(std::move(out));
  }
  throw Error("no filter named '" + name + "'");
}

}  // namespace

std::string python_strip(const std::string& s, const Value& chars, bool left, bool right) {
  const auto cps = unicode::code_points(s);
  const List strip_set = chars.is_string() ? chars.iterate() : List();
  auto strips = [&](size_t i) {
    if (!chars.is_string()) return python_space(cps[i].second);
    const std::string c = s.substr(cps[i].first, unicode::char_length(static_cast<unsigned char>(s[cps[i].first])));
    return std::find(strip_set.begin(), strip_set.end(), Value(c)) != strip_set.end();
  };
  size_t begin = 0, end = cps.size();
  while (left && begin < end && strips(begin)) ++begin;
  while (right && end > begin && strips(end - 1)) --end;
  const size_t from = begin < cps.size() ? cps[begin].first : s.size();
  const size_t to = end < cps.size() ? cps[end].first : s.size();
  return s.substr(from, to - from);
}

Value Builtins::filter(const std::string& name, const Value& v, const Args& args, const Kwargs& kwargs) {
  if (name == "default" || name == "d") {
    const bool boolean = arg(args, kwargs, 1, "boolean", Value(false)).truthy();
    return v.is_undefined() || (boolean && !v.truthy()) ? arg(args, kwargs, 0, "default_value", Value("")) : v;
  }
  if (name == "length" || name == "count") return Value(static_cast<int64_t>(v.length()));
  if (name == "tojson") return tojson(v, args, kwargs);
  if (name == "trim") return Value(python_strip(v.str(), arg(args, kwargs, 0, "chars"), true, true));
  if (name == "upper") return Value(upper(v.str()));
  if (name == "lower") return Value(lower(v.str()));
  if (name == "title") return Value(title(v.str()));
  if (name == "capitalize") return Value(capitalize(v.str()));
  if (name == "replace") {
    return Value(replace(v.str(), arg(args, kwargs, 0, "old").str(), arg(args, kwargs, 1, "new").str(),
                         arg(args, kwargs, 2, "count", Value(-1)).as_int()));
  }
  if (name == "string") return Value(v.str());
  if (name == "list") return Value::list(v.iterate());
  if (name == "safe" || name == "forceescape" || name == "escape" || name == "e") {
    return name == "safe" ? v : Value(html_escape(v.str()));
  }
  if (name == "indent") return indent(v, args, kwargs);
  if (name == "attr") return v.get(arg(args, kwargs, 0, "name").str());
  if (name == "int" || name == "float" || name == "abs" || name == "round") return number_filter(name, v, args, kwargs);
  if (name == "select" || name == "reject") return select(v, args, kwargs, false, name == "select");
  if (name == "selectattr" || name == "rejectattr") return select(v, args, kwargs, true, name == "selectattr");
  if (name == "map") return map(v, args, kwargs);
  if (name == "sort") return sort(v, args, kwargs);
  if (name == "dictsort") {
    List pairs = filter("items", v, {}, {}).as_list();
    std::stable_sort(pairs.begin(), pairs.end(), [](const Value& a, const Value& b) { return less(a.as_list()[0], b.as_list()[0]); });
    return Value::list(std::move(pairs));
  }
  return sequence_filter(name, v, args, kwargs);
}

bool Builtins::test(const std::string& name, const Value& v, const Args& args) {
  const Value other = args.empty() ? Value() : args[0];
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.kind() == Value::Kind::Int || v.kind() == Value::Kind::Float;
  if (name == "integer") return v.kind() == Value::Kind::Int;
  if (name == "float") return v.kind() == Value::Kind::Float;
  if (name == "boolean") return v.kind() == Value::Kind::Bool;
  if (name == "true") return v.kind() == Value::Kind::Bool && v.as_bool();
  if (name == "false") return v.kind() == Value::Kind::Bool && !v.as_bool();
  if (name == "mapping") return v.is_dict();
  if (name == "sequence") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "callable") return v.is_function();
  if (name == "odd") return v.as_int() % 2 != 0;
  if (name == "even") return v.as_int() % 2 == 0;
  if (name == "divisibleby") return other.as_int() != 0 && v.as_int() % other.as_int() == 0;
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return v == other;
  if (name == "ne" || name == "!=") return v != other;
  if (name == "lt" || name == "<") return less(v, other);
  if (name == "gt" || name == ">") return less(other, v);
  if (name == "le" || name == "<=") return !less(other, v);
  if (name == "ge" || name == ">=") return !less(v, other);
  if (name == "in") {
    if (other.is_string()) return other.as_string().find(v.str()) != std::string::npos;
    const List items = other.iterate();
    return std::find(items.begin(), items.end(), v) != items.end();
  }
  if (name == "lower") return v.is_string() && lower(v.as_string()) == v.as_string();
  if (name == "upper") return v.is_string() && upper(v.as_string()) == v.as_string();
  if (name == "escaped") return false;
  throw Error("no test named '" + name + "'");
}

bool Builtins::has_method(const Value& obj, const std::string& name) {
  static const char* const kString[] = {"strip", "lstrip", "rstrip", "split", "startswith", "endswith", "upper",
                                        "lower", "title", "capitalize", "replace", "join", "find", "rfind", "count",
                                        "splitlines", "isdigit", "isalpha", "isspace", "islower", "isupper"};
  static const char* const kDict[] = {"get", "items", "keys", "values"};
  if (obj.is_string()) return std::find(std::begin(kString), std::end(kString), name) != std::end(kString);
  if (obj.is_dict() && !obj.is_namespace()) return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  if (obj.is_list()) return name == "index" || name == "count";
  return false;
}

namespace {

Value string_method(const std::string& s, const std::string& name, const Args& args, const Kwargs& kwargs) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    return Value(python_strip(s, arg(args, kwargs, 0, "chars"), name != "rstrip", name != "lstrip"));
  }
  if (name == "split") return split(s, arg(args, kwargs, 0, "sep"), arg(args, kwargs, 1, "maxsplit", Value(-1)).as_int());
  if (name == "startswith" || name == "endswith") {
    const Value what = arg(args, kwargs, 0, "prefix");
    const List options = what.is_list() ? what.as_list() : List{what};
    for (const Value& o : options) {
      const std::string& p = o.as_string();
      const bool hit = name == "startswith" ? s.compare(0, p.size(), p) == 0
                                            : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
      if (hit) return Value(true);
    }
    return Value(false);
  }
  if (name == "upper") return Value(upper(s));
  if (name == "lower") return Value(lower(s));
  if (name == "title") return Value(title(s));
  if (name == "capitalize") return Value(capitalize(s));
  if (name == "replace") {
    return Value(replace(s, arg(args, kwargs, 0, "old").str(), arg(args, kwargs, 1, "new").str(),
                         arg(args, kwargs, 2, "count", Value(-1)).as_int()));
  }
  if (name == "join") {
    std::string out;
    bool first = true;
    for (const Value& item : arg(args, kwargs, 0, "iterable").iterate()) out += (first ? "" : s) + item.str(), first = false;
    return Value(out);
  }
  if (name == "find" || name == "rfind") {
    const size_t at = name == "find" ? s.find(arg(args, kwargs, 0, "sub").str()) : s.rfind(arg(args, kwargs, 0, "sub").str());
    return Value(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(at));
  }
  if (name == "count") {
    const std::string sub = arg(args, kwargs, 0, "sub").str();
    int64_t n = 0;
    for (size_t at = s.find(sub); !sub.empty() && at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return Value(n);
  }
  if (name == "splitlines") {
    List lines = split(s, Value("\n"), -1).as_list();
    if (!lines.empty() && lines.back().as_string().empty()) lines.pop_back();
    return Value::list(std::move(lines));
  }
  const auto cps = unicode::code_points(s);
  auto all = [&](auto pred) { return !cps.empty() && std::all_of(cps.begin(), cps.end(), [&](const auto& c) { return pred(c.second); }); };
  if (name == "isdigit") return Value(all([](uint32_t c) { return unicode::is_numeric(c); }));
  if (name == "isalpha") return Value(all([](uint32_t c) { return unicode::is_alphanumeric(c) && !unicode::is_numeric(c); }));
  if (name == "isspace") return Value(all(python_space));
  if (name == "islower") return Value(lower(s) == s && upper(s) != s);
  return Value(upper(s) == s && lower(s) != s);  // isupper
}

}  // namespace

Value Builtins::method(const Value& obj, const std::string& name, const Args& args, const Kwargs& kwargs) {
  if (obj.is_string()) return string_method(obj.as_string(), name, args, kwargs);
  if (obj.is_list()) {
    const List& items = obj.as_list();
    const Value x = arg(args, kwargs, 0, "value");
    if (name == "count") return Value(static_cast<int64_t>(std::count(items.begin(), items.end(), x)));
    auto it = std::find(items.begin(), items.end(), x);
    if (it == items.end()) throw Error(x.repr() + " is not in list");
    return Value(static_cast<int64_t>(it - items.begin()));
  }
  if (name == "get") {
    const Value v = obj.get(arg(args, kwargs, 0, "key").str());
    return v.is_undefined() ? arg(args, kwargs, 1, "default", Value::none()) : v;
  }
  if (name == "items") return filter("items", obj, {}, {});
  List out;
  for (const auto& [k, v] : obj.as_dict()) out.push_back(name == "keys" ? Value(k) : v);
  return Value::list(std::move(out));
}

Dict Builtins::globals() {
  Dict g;
  g.emplace_back("range", Value::function("range", [](const Args& a, const Kwargs&) {
    if (a.empty()) throw Error("range expected at least 1 argument");
    const int64_t start = a.size() > 1 ? a[0].as_int() : 0, stop = a.size() > 1 ? a[1].as_int() : a[0].as_int();
    const int64_t step = a.size() > 2 ? a[2].as_int() : 1;
    if (step == 0) throw Error("range() arg 3 must not be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
    return Value::list(std::move(out));
  }));
  auto make_dict = [](bool ns) {
    return [ns](const Args& a, const Kwargs& kw) {
      Dict items = !a.empty() && a[0].is_dict() ? a[0].as_dict() : Dict();
      for (const auto& [k, v] : kw) items.emplace_back(k, v);
      return ns ? Value::name_space(std::move(items)) : Value::dict(std::move(items));
    };
  };
  g.emplace_back("namespace", Value::function("namespace", make_dict(true)));
  g.emplace_back("dict", Value::function("dict", make_dict(false)));
  g.emplace_back("raise_exception", Value::function("raise_exception", [](const Args& a, const Kwargs&) -> Value {
    throw Error(a.empty() ? "the template raised an exception" : a[0].str());
  }));
  g.emplace_back("strftime_now", Value::function("strftime_now", [](const Args& a, const Kwargs&) {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buffer[256];
    const size_t n = std::strftime(buffer, sizeof buffer, a.empty() ? "%Y-%m-%d" : a[0].str().c_str(), &local);
    return Value(std::string(buffer, n));
  }));
  return g;
}

}  // namespace meshtrain::text::jinja
