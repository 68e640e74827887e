// Jinja's filters, tests and globals, and the Python methods of strings,
// dicts and lists that chat templates call.
#pragma once

#include <functional>
#include <string>

#include "meshtrain/text/jinja/value.h"

namespace meshtrain::text::jinja {

// Filters that take a filter or test by name (map, select) reach the others through these.
struct Builtins {
  static Value filter(const std::string& name, const Value& v, const Args& args, const Kwargs& kwargs);
  static bool test(const std::string& name, const Value& v, const Args& args);
  // Whether `obj` has a method `name` (str.strip, dict.items, ...), and calling it.
  static bool has_method(const Value& obj, const std::string& name);
  static Value method(const Value& obj, const std::string& name, const Args& args, const Kwargs& kwargs);
  // range, namespace, dict, raise_exception, strftime_now.
  static Dict globals();
};

// Python's str.strip() family: `chars` none strips whitespace.
std::string python_strip(const std::string& s, const Value& chars, bool left, bool right);

}  // namespace meshtrain::text::jinja
