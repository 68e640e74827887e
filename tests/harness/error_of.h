// The message of the exception of type Error that `f` throws, or "no error".
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace meshtrain::testing {

template <typename Error = std::exception>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace meshtrain::testing
