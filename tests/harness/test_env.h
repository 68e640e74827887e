// Paths CTest gives a test through its environment (tests/CMakeLists.txt), so
// that no compiled test holds a path of the folder it was built in.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace meshtrain::testing {

// The value of `name`; throws naming the variable when the test was started
// without it (run it through ctest, or set it as tests/CMakeLists.txt does).
inline std::string environment_path(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    throw std::runtime_error(std::string(name) + " is not set: run this test through ctest, which sets it "
                             "(tests/CMakeLists.txt)");
  }
  return value;
}

}  // namespace meshtrain::testing
