#include "meshtrain/text/jinja/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace meshtrain::text::jinja {

Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}
Value::Value(bool b) : kind_(Kind::Bool), b_(b) {}
Value::Value(int v) : kind_(Kind::Int), i_(v) {}
Value::Value(int64_t v) : kind_(Kind::Int), i_(v) {}
Value::Value(double v) : kind_(Kind::Float), d_(v) {}
Value::Value(std::string s) : kind_(Kind::String), s_(std::move(s)) {}
Value::Value(const char* s) : kind_(Kind::String), s_(s) {}

Value Value::list(List items) {
  Value v;
  v.kind_ = Kind::List;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}

Value Value::tuple(List items) {
  Value v = list(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::dict(Dict items) {
  Value v;
  v.kind_ = Kind::Dict;
  v.dict_ = std::make_shared<Dict>(std::move(items));
  return v;
}

Value Value::name_space(Dict items) {
  Value v = dict(std::move(items));
  v.namespace_ = true;
  return v;
}

Value Value::function(std::string name, Function f) {
  Value v;
  v.kind_ = Kind::Function;
  v.s_ = std::move(name);
  v.fn_ = std::make_shared<Function>(std::move(f));
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict items;
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(it.key(), from_json(it.value()));
      return dict(std::move(items));
    }
    default: return Value();
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return b_;
    case Kind::Int: return i_ != 0;
    case Kind::Float: return d_ != 0.0;
    case Kind::String: return !s_.empty();
    case Kind::List: return !list_->empty();
    case Kind::Dict: return namespace_ || !dict_->empty();
    case Kind::Function: return true;
  }
  return false;
}

int64_t Value::as_int() const {
  if (kind_ == Kind::Bool) return b_ ? 1 : 0;
  if (kind_ == Kind::Float) return static_cast<int64_t>(d_);
  return i_;
}

double Value::as_double() const {
  if (kind_ == Kind::Float) return d_;
  return static_cast<double>(as_int());
}

Value Value::get(const std::string& key) const {
  if (kind_ != Kind::Dict) return Value();
  for (const auto& [k, v] : *dict_) {
    if (k == key) return v;
  }
  return Value();
}

void Value::set(const std::string& key, Value v) {
  for (auto& [k, old] : *dict_) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  dict_->emplace_back(key, std::move(v));
}

List Value::iterate() const {
  switch (kind_) {
    case Kind::List: return *list_;
    case Kind::Dict: {
      List keys;
      for (const auto& [k, v] : *dict_) keys.emplace_back(k);
      return keys;
    }
    case Kind::String: {
      List chars;
      for (size_t i = 0; i < s_.size();) {
        const auto c = static_cast<unsigned char>(s_[i]);
        const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        chars.emplace_back(s_.substr(i, n));
        i += n;
      }
      return chars;
    }
    case Kind::Undefined: return {};
    default: throw Error("'" + type_name() + "' object is not iterable");
  }
}

size_t Value::length() const {
  switch (kind_) {
    case Kind::List: return list_->size();
    case Kind::Dict: return dict_->size();
    case Kind::String: return iterate().size();
    case Kind::Undefined: return 0;
    default: throw Error("object of type '" + type_name() + "' has no len()");
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return "list";
    case Kind::Dict: return namespace_ ? "Namespace" : "dict";
    case Kind::Function: return "function";
  }
  return "?";
}

std::string python_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buffer[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*e", precision - 1, v);
    if (std::strtod(buffer, nullptr) == v) break;
  }
  // buffer holds d.ddde±XX with the fewest digits; lay it out as Python's repr does.
  std::string mantissa(buffer, std::strchr(buffer, 'e'));
  const int exponent = std::atoi(std::strchr(buffer, 'e') + 1);
  const bool negative = mantissa[0] == '-';
  std::string digits;
  for (char c : mantissa) {
    if (c >= '0' && c <= '9') digits += c;
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + e;
  }
  if (exponent < 0) return out + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  const size_t point = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= point) return out + digits + std::string(point - digits.size(), '0') + ".0";
  return out + digits.substr(0, point) + "." + digits.substr(point);
}

namespace {

std::string python_quote(const std::string& s) {
  const bool double_quotes = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char quote = double_quotes ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\' || c == static_cast<unsigned char>(quote)) {
      out += '\\', out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "\\u%04x", c);
          out += hex;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

void dump_json(const Value& v, int indent, int depth, const std::string& item_sep, const std::string& key_sep,
               bool sort_keys, std::string& out) {
  const std::string newline = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * (depth + 1)), ' ') : "";
  const std::string closing = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * depth), ' ') : "";
  switch (v.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.as_int()); return;
    case Value::Kind::Float: {
      const double d = v.as_double();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : python_float(d);
      return;
    }
    case Value::Kind::String: out += json_quote(v.as_string()); return;
    case Value::Kind::List: {
      if (v.as_list().empty()) {
        out += "[]";
        return;
      }
      out += "[" + newline;
      for (size_t i = 0; i < v.as_list().size(); ++i) {
        if (i) out += item_sep + newline;
        dump_json(v.as_list()[i], indent, depth + 1, item_sep, key_sep, sort_keys, out);
      }
      out += closing + "]";
      return;
    }
    case Value::Kind::Dict: {
      Dict items = v.as_dict();
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      out += "{" + newline;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep + newline;
        out += json_quote(items[i].first) + key_sep;
        dump_json(items[i].second, indent, depth + 1, item_sep, key_sep, sort_keys, out);
      }
      out += closing + "}";
      return;
    }
    case Value::Kind::Function: throw Error("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string to_json_text(const Value& v, int indent, const std::string& item_separator,
                         const std::string& key_separator, bool sort_keys) {
  std::string out;
  dump_json(v, indent, 0, item_separator, key_separator, sort_keys, out);
  return out;
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::String: return s_;
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return b_ ? "True" : "False";
    case Kind::Int: return std::to_string(i_);
    case Kind::Float: return python_float(d_);
    case Kind::String: return python_quote(s_);
    case Kind::List: {
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].repr();
      return out + (!tuple_ ? "]" : list_->size() == 1 ? ",)" : ")");
    }
    case Kind::Dict: {
      std::string out = namespace_ ? "<Namespace {" : "{";
      for (size_t i = 0; i < dict_->size(); ++i) {
        out += (i ? ", " : "") + python_quote((*dict_)[i].first) + ": " + (*dict_)[i].second.repr();
      }
      return out + (namespace_ ? "}>" : "}");
    }
    case Kind::Function: return "<function " + s_ + ">";
  }
  return "";
}

nlohmann::ordered_json Value::to_json() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return nullptr;
    case Kind::Bool: return b_;
    case Kind::Int: return i_;
    case Kind::Float: return d_;
    case Kind::String: return s_;
    case Kind::List: {
      nlohmann::ordered_json j = nlohmann::ordered_json::array();
      for (const Value& v : *list_) j.push_back(v.to_json());
      return j;
    }
    case Kind::Dict: {
      nlohmann::ordered_json j = nlohmann::ordered_json::object();
      for (const auto& [k, v] : *dict_) j[k] = v.to_json();
      return j;
    }
    case Kind::Function: return s_;
  }
  return nullptr;
}

bool Value::operator==(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (kind_ == Kind::Float || o.kind_ == Kind::Float) return as_double() == o.as_double();
    return as_int() == o.as_int();
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return s_ == o.s_;
    case Kind::List: return *list_ == *o.list_;
    case Kind::Dict: {
      if (dict_->size() != o.dict_->size()) return false;
      for (const auto& [k, v] : *dict_) {
        if (o.get(k) != v || o.get(k).is_undefined()) return false;
      }
      return true;
    }
    case Kind::Function: return fn_ == o.fn_;
    default: return false;
  }
}

}  // namespace meshtrain::text::jinja
