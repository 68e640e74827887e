// Bad input data: the message names the file and what is wrong with it.
#pragma once

#include <stdexcept>
#include <string>

namespace meshtrain::train {

class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws DataError("data file WHERE: WHAT"); `where` is a path, with a line or a row group when known.
[[noreturn]] inline void data_error(const std::string& where, const std::string& what) {
  throw DataError("data file " + where + ": " + what);
}

}  // namespace meshtrain::train
