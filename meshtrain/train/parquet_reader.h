// Parquet files (the format Hugging Face datasets publish), read with Apache
// Arrow's C++ library from the pyarrow wheel. Arrow's headers need C++20, so
// parquet_reader.cpp is the one file that includes them and this interface
// speaks only the standard library and JSON.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::train {

// The row groups of a Parquet file (its natural units of parallel reading).
// Throws DataError naming the file when it is not Parquet.
int64_t parquet_row_groups(const std::string& path);

// Calls `each` with every row of row group `group` as a JSON object holding the
// `columns` the file has (strings, numbers, booleans, lists and structs as JSON;
// nulls as null). Throws DataError naming the file, group and column, and for
// a file with none of `columns`, the columns it has.
void read_parquet_rows(const std::string& path, int64_t group, const std::vector<std::string>& columns,
                       const std::function<void(nlohmann::ordered_json&&)>& each);

}  // namespace meshtrain::train
