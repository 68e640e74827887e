// Names of the model's call sites, as its hook chain passes them to ForwardHooks::around.
#pragma once

#include <cstdint>
#include <string>

namespace meshtrain::model {

// N of a whole block's call site "blocks.N", or -1 for any other call site ("blocks.N.attn", "head", ...).
inline int64_t block_call_site(const std::string& module) {
  if (module.rfind("blocks.", 0) != 0 || module.size() == 7) return -1;
  if (module.find_first_not_of("0123456789", 7) != std::string::npos) return -1;
  return std::stoll(module.substr(7));
}

}  // namespace meshtrain::model
