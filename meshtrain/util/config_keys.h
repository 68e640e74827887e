// Typed config keys: how one `[section] key = value` of a TOML file (or a
// --section.key=value override) is read into a field of a struct, checked
// for its type and, for enumerations, its allowed names, and shown in --help.
// A struct that owns keys lists them once, as a table of Key<Owner>; the
// TOML reader (train/config.cpp) walks the tables. See Note [Config keys].
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace meshtrain::config {

// A config error: names the key, the value and what is allowed,
// "parallel.tp = 3: tp(3) does not divide the vocabulary (256); ...".
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Throws ConfigError("KEY = VALUE: ALLOWED").
[[noreturn]] void refuse(const std::string& key, const std::string& value, const std::string& allowed);
// "use \"a\", \"b\" or \"c\"".
std::string allowed_names(const std::vector<std::string>& names);
std::string quoted(const std::string& text);  // "\"text\""

enum class Kind { kInt, kFloat, kBool, kString, kStringList, kNumberOrString };
const char* kind_name(Kind kind);  // "an integer", "a number", ...

// A value as read from TOML, in the member its kind names (kNumberOrString: f, or s when a string).
struct Value {
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<std::string> list;
};

// Note [Config keys]
// Each key of a config is one Key<Owner>: where it sits (section, name), the
// TOML kind it is read as, its help line, and how it is stored in and shown
// from an Owner. Enumerations are read by name from a Names<E> table and
// stored typed, so a wrong name is refused as it is read ("KEY = \"x\": use
// \"a\" or \"b\"") and nothing downstream compares strings. A struct nested in
// another (the ParallelSpec inside a TrainConfig) lends its table to the
// outer one with lift(). The rules between keys live with the struct that
// owns them (ParallelSpec::check, TrainConfig::validate), not here. Adding a
// knob is: the field, its line in the owner's table, and its rule.
template <typename Owner>
struct Key {
  std::string section, name;
  Kind kind;
  std::string help;
  std::function<void(Owner&, const Value&)> set;  // throws ConfigError for a value outside what is allowed
  std::function<std::string(const Owner&)> show;  // as TOML would write it
  std::string full_name() const { return section + "." + name; }
};

// How a C++ field type is read from a Value and shown.
template <typename T>
struct FieldType;
template <>
struct FieldType<int64_t> {
  static constexpr Kind kind = Kind::kInt;
  static int64_t read(const Value& v) { return v.i; }
  static std::string show(int64_t v) { return std::to_string(v); }
};
template <>
struct FieldType<int> {
  static constexpr Kind kind = Kind::kInt;
  static int read(const Value& v) { return static_cast<int>(v.i); }
  static std::string show(int v) { return std::to_string(v); }
};
template <>
struct FieldType<uint64_t> {
  static constexpr Kind kind = Kind::kInt;
  static uint64_t read(const Value& v) { return static_cast<uint64_t>(v.i); }
  static std::string show(uint64_t v) { return std::to_string(v); }
};
template <>
struct FieldType<double> {
  static constexpr Kind kind = Kind::kFloat;
  static double read(const Value& v) { return v.f; }
  static std::string show(double v);
};
template <>
struct FieldType<bool> {
  static constexpr Kind kind = Kind::kBool;
  static bool read(const Value& v) { return v.b; }
  static std::string show(bool v) { return v ? "true" : "false"; }
};
template <>
struct FieldType<std::string> {
  static constexpr Kind kind = Kind::kString;
  static std::string read(const Value& v) { return v.s; }
  static std::string show(const std::string& v) { return quoted(v); }
};
template <>
struct FieldType<std::vector<std::string>> {
  static constexpr Kind kind = Kind::kStringList;
  static std::vector<std::string> read(const Value& v) { return v.list; }
  static std::string show(const std::vector<std::string>& v);
};

// A key stored in the field `access(owner)` returns a reference to.
template <typename Owner, typename Access>
Key<Owner> key(std::string section, std::string name, std::string help, Access access) {
  using T = std::decay_t<decltype(access(std::declval<Owner&>()))>;
  return {std::move(section), std::move(name), FieldType<T>::kind, std::move(help),
          [access](Owner& o, const Value& v) { access(o) = FieldType<T>::read(v); },
          [access](const Owner& o) { return FieldType<T>::show(access(const_cast<Owner&>(o))); }};
}

// The names of an enumeration's values, in the order --help lists them.
template <typename E>
using Names = std::vector<std::pair<E, std::string>>;

template <typename E>
const std::string& name_of(const Names<E>& names, E value) {
  for (const auto& [v, name] : names) {
    if (v == value) return name;
  }
  throw std::logic_error("config: an enumeration value without a name");
}

// The value named `text`; throws ConfigError("KEY = \"text\": use ...").
template <typename E>
E parse_name(const Names<E>& names, const std::string& key, const std::string& text) {
  std::vector<std::string> allowed;
  for (const auto& [value, name] : names) {
    if (name == text) return value;
    allowed.push_back(name);
  }
  refuse(key, quoted(text), allowed_names(allowed));
}

// A key whose string value names one of `names`, stored as the enumeration.
template <typename Owner, typename E, typename Access>
Key<Owner> enum_key(std::string section, std::string name, std::string help, const Names<E>& names, Access access) {
  const std::string full = section + "." + name;
  return {std::move(section), std::move(name), Kind::kString, std::move(help),
          [access, names, full](Owner& o, const Value& v) { access(o) = parse_name(names, full, v.s); },
          [access, names](const Owner& o) { return quoted(name_of(names, access(const_cast<Owner&>(o)))); }};
}

// `inner_key` of a struct that lives at `access(outer)` inside an Outer.
template <typename Outer, typename Inner, typename Access>
Key<Outer> lift(const Key<Inner>& inner_key, Access access) {
  return {inner_key.section, inner_key.name, inner_key.kind, inner_key.help,
          [set = inner_key.set, access](Outer& o, const Value& v) { set(access(o), v); },
          [show = inner_key.show, access](const Outer& o) { return show(access(const_cast<Outer&>(o))); }};
}

}  // namespace meshtrain::config
