#include "meshtrain/util/config_keys.h"

#include <sstream>

namespace meshtrain::config {

void refuse(const std::string& key, const std::string& value, const std::string& allowed) {
  throw ConfigError(key + " = " + value + ": " + allowed);
}

std::string allowed_names(const std::vector<std::string>& names) {
  std::string text = "use ";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) text += i + 1 == names.size() ? " or " : ", ";
    text += quoted(names[i]);
  }
  return text;
}

std::string quoted(const std::string& text) { return "\"" + text + "\""; }

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kInt: return "an integer";
    case Kind::kFloat: return "a number";
    case Kind::kBool: return "true or false";
    case Kind::kString: return "a string";
    case Kind::kStringList: return "a list of strings";
    case Kind::kNumberOrString: return "a number or a string";
  }
  return "?";
}

std::string FieldType<double>::show(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

std::string FieldType<std::vector<std::string>>::show(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quoted(v[i]);
  return s + "]";
}

}  // namespace meshtrain::config
