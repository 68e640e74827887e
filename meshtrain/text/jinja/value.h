// The values a Jinja template computes with, with Python's semantics (what
// chat templates are written against): None, bools, ints, floats, strings,
// lists, insertion-ordered dicts, namespaces and callables; undefined for a
// name or key that is not there.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::text::jinja {

// A template that does not parse or fails as it renders (raise_exception,
// a type error, an undefined attribute); the message says where.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(const Args&, const Kwargs&)>;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Function };

  Value() = default;  // undefined
  static Value none();
  Value(bool b);  // NOLINT: values convert as Python's do
  Value(int v);   // NOLINT
  Value(int64_t v);  // NOLINT
  Value(double v);  // NOLINT
  Value(std::string s);  // NOLINT
  Value(const char* s);  // NOLINT
  static Value list(List items);
  static Value tuple(List items);  // a list that prints as Python's tuple
  static Value dict(Dict items);
  // A namespace(): a dict whose attributes `set ns.x = ...` may assign.
  static Value name_space(Dict items);
  static Value function(std::string name, Function f);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_namespace() const { return kind_ == Kind::Dict && namespace_; }
  bool is_function() const { return kind_ == Kind::Function; }

  bool truthy() const;
  bool as_bool() const { return b_; }
  int64_t as_int() const;     // ints and bools; floats truncated
  double as_double() const;   // any number
  const std::string& as_string() const { return s_; }
  const List& as_list() const { return *list_; }
  List& mutable_list() { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& mutable_dict() { return *dict_; }
  const std::string& function_name() const { return s_; }
  Value call(const Args& args, const Kwargs& kwargs) const { return (*fn_)(args, kwargs); }

  // The value under `key`, or undefined.
  Value get(const std::string& key) const;
  void set(const std::string& key, Value v);  // dicts and namespaces
  // What iterating gives: a list's items, a dict's keys, a string's characters.
  List iterate() const;
  size_t length() const;

  std::string str() const;   // Python's str()
  std::string repr() const;  // Python's repr()
  std::string type_name() const;  // Python's type name, for messages
  nlohmann::ordered_json to_json() const;

  bool operator==(const Value& o) const;
  bool operator!=(const Value& o) const { return !(*this == o); }

 private:
  Kind kind_ = Kind::Undefined;
  bool b_ = false;
  bool namespace_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
};

// Python's repr() of a float: the shortest text that reads back the same.
std::string python_float(double v);
// Python's json.dumps(v, ensure_ascii=False, indent, separators, sort_keys),
// as transformers' tojson filter calls it.
std::string to_json_text(const Value& v, int indent, const std::string& item_separator,
                         const std::string& key_separator, bool sort_keys);

}  // namespace meshtrain::text::jinja
