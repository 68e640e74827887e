// Bad input data: the message names the file and what is wrong with it.
#pragma once

#include <stdexcept>

namespace meshtrain::train {

class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace meshtrain::train
