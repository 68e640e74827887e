// Reading typed config keys (util/config_keys.h) from TOML: a value of a file,
// or of a `--section.key=value` override, checked against the key's kind.
// Shared by the training config and the federated config.
#pragma once

#include "meshtrain/util/config_keys.h"

#include <toml++/toml.h>

#include <string>

namespace meshtrain::config {

// The node as TOML writes it ("3", "\"x\"", "[1, 2]").
std::string node_text(const toml::node& node);

// `node` read as `kind`; throws ConfigError("WHERE: NAME = NODE must be KIND").
Value read_value(const std::string& name, Kind kind, const toml::node& node, const std::string& where);

// The value of a command-line override, RAW as typed, as a TOML node in the
// returned table under "v": a string key takes RAW as it is (no quotes
// needed); a list takes TOML or one bare string; the rest must parse as TOML.
// Throws ConfigError("WHERE: NAME = RAW must be KIND").
toml::table override_value(const std::string& name, Kind kind, const std::string& raw, const std::string& where);

// "  key = default                     help" lines under "[section]" headers, in
// the keys' order: the one format every command lists its keys in.
std::string describe_line(const std::string& name, const std::string& shown, const std::string& help);
template <typename Owner>
std::string describe(const std::vector<Key<Owner>>& keys, const Owner& defaults) {
  std::string out, section;
  for (const Key<Owner>& k : keys) {
    if (k.section != section) {
      section = k.section;
      out += "\n[" + section + "]\n";
    }
    out += describe_line(k.name, k.show(defaults), k.help);
  }
  return out;
}

}  // namespace meshtrain::config
