#include "meshtrain/util/config_toml.h"

#include <sstream>

namespace meshtrain::config {

std::string node_text(const toml::node& node) {
  std::ostringstream out;
  node.visit([&](auto&& v) { out << v; });
  return out.str();
}

Value read_value(const std::string& name, Kind kind, const toml::node& node, const std::string& where) {
  Value value;
  auto wrong = [&]() -> ConfigError {
    return ConfigError(where + ": " + name + " = " + node_text(node) + " must be " + kind_name(kind));
  };
  switch (kind) {
    case Kind::kInt:
      if (!node.is_integer()) throw wrong();
      value.i = node.value<int64_t>().value();
      break;
    case Kind::kFloat:
      if (!node.is_number()) throw wrong();
      value.f = node.value<double>().value();
      break;
    case Kind::kBool:
      if (!node.is_boolean()) throw wrong();
      value.b = node.value<bool>().value();
      break;
    case Kind::kString:
      if (!node.is_string()) throw wrong();
      value.s = node.value<std::string>().value();
      break;
    case Kind::kNumberOrString:
      if (node.is_number()) value.f = node.value<double>().value();
      else if (node.is_string()) value.s = node.value<std::string>().value();
      else throw wrong();
      break;
    case Kind::kStringList:
      if (node.is_string()) {
        value.list = {node.value<std::string>().value()};
        break;
      }
      if (!node.is_array()) throw wrong();
      for (const auto& item : *node.as_array()) {
        if (!item.is_string()) throw wrong();
        value.list.push_back(item.value<std::string>().value());
      }
      break;
  }
  return value;
}

toml::table override_value(const std::string& name, Kind kind, const std::string& raw, const std::string& where) {
  toml::table parsed;
  if (kind == Kind::kString) {
    parsed.insert("v", raw);  // strings need no quotes on the command line
    return parsed;
  }
  try {
    parsed = toml::parse("v = " + raw);
  } catch (const toml::parse_error&) {
    if (kind != Kind::kStringList && kind != Kind::kNumberOrString) {
      throw ConfigError(where + ": " + name + " = " + raw + " must be " + kind_name(kind));
    }
    parsed = toml::table{};
    parsed.insert("v", raw);
  }
  return parsed;
}

std::string describe_line(const std::string& name, const std::string& shown, const std::string& help) {
  std::string line = "  " + name + " = " + shown;
  if (line.size() < 36) line.resize(36, ' ');
  return line + "  " + help + "\n";
}

}  // namespace meshtrain::config
