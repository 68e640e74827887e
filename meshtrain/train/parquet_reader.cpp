#include "meshtrain/train/parquet_reader.h"

#include "meshtrain/train/data_error.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/exception.h>

namespace meshtrain::train {

namespace {

std::unique_ptr<parquet::arrow::FileReader> open(const std::string& path) {
  auto file = arrow::io::ReadableFile::Open(path);
  if (!file.ok()) data_error(path, "cannot be opened (" + file.status().message() + ")");
  try {
    auto reader = parquet::arrow::OpenFile(*file, arrow::default_memory_pool());
    if (!reader.ok()) data_error(path, "is not a Parquet file (" + reader.status().message() + ")");
    return std::move(*reader);
  } catch (const parquet::ParquetException& e) {
    data_error(path, std::string("is not a Parquet file (") + e.what() + ")");
  }
}

// One cell as JSON: the types datasets publish text and conversations in.
nlohmann::ordered_json cell(const arrow::Array& array, int64_t row) {
  using nlohmann::ordered_json;
  if (array.IsNull(row)) return nullptr;
  switch (array.type_id()) {
    case arrow::Type::STRING: return static_cast<const arrow::StringArray&>(array).GetString(row);
    case arrow::Type::LARGE_STRING: return static_cast<const arrow::LargeStringArray&>(array).GetString(row);
    case arrow::Type::STRING_VIEW: return std::string(static_cast<const arrow::StringViewArray&>(array).GetView(row));
    case arrow::Type::BOOL: return static_cast<const arrow::BooleanArray&>(array).Value(row);
    case arrow::Type::INT8: return static_cast<const arrow::Int8Array&>(array).Value(row);
    case arrow::Type::INT16: return static_cast<const arrow::Int16Array&>(array).Value(row);
    case arrow::Type::INT32: return static_cast<const arrow::Int32Array&>(array).Value(row);
    case arrow::Type::INT64: return static_cast<const arrow::Int64Array&>(array).Value(row);
    case arrow::Type::UINT32: return static_cast<const arrow::UInt32Array&>(array).Value(row);
    case arrow::Type::UINT64: return static_cast<const arrow::UInt64Array&>(array).Value(row);
    case arrow::Type::FLOAT: return static_cast<const arrow::FloatArray&>(array).Value(row);
    case arrow::Type::DOUBLE: return static_cast<const arrow::DoubleArray&>(array).Value(row);
    case arrow::Type::LIST:
    case arrow::Type::LARGE_LIST: {
      const auto& list = static_cast<const arrow::BaseListArray<arrow::ListType>&>(array);
      std::shared_ptr<arrow::Array> values;
      int64_t begin = 0, end = 0;
      if (array.type_id() == arrow::Type::LIST) {
        begin = list.value_offset(row), end = begin + list.value_length(row), values = list.values();
      } else {
        const auto& large = static_cast<const arrow::LargeListArray&>(array);
        begin = large.value_offset(row), end = begin + large.value_length(row), values = large.values();
      }
      ordered_json out = ordered_json::array();
      for (int64_t i = begin; i < end; ++i) out.push_back(cell(*values, i));
      return out;
    }
    case arrow::Type::STRUCT: {
      const auto& structure = static_cast<const arrow::StructArray&>(array);
      ordered_json out = ordered_json::object();
      for (int f = 0; f < structure.num_fields(); ++f) {
        out[structure.struct_type()->field(f)->name()] = cell(*structure.field(f), row);
      }
      return out;
    }
    default:
      throw std::invalid_argument(array.type()->ToString());
  }
}

// The leaf (Parquet) columns under a top-level field: what ReadRowGroup takes.
void leaves(const parquet::arrow::SchemaField& field, std::vector<int>& out) {
  if (field.is_leaf()) out.push_back(field.column_index);
  for (const auto& child : field.children) leaves(child, out);
}

}  // namespace

int64_t parquet_row_groups(const std::string& path) { return open(path)->num_row_groups(); }

void read_parquet_rows(const std::string& path, int64_t group, const std::vector<std::string>& columns,
                       const std::function<void(nlohmann::ordered_json&&)>& each) {
  const auto reader = open(path);
  std::shared_ptr<arrow::Schema> schema;
  if (!reader->GetSchema(&schema).ok()) data_error(path, "has no readable schema");
  std::vector<int> indices;
  std::vector<std::string> names;
  for (const std::string& name : columns) {
    const int field = schema->GetFieldIndex(name);
    if (field < 0) continue;
    leaves(reader->manifest().schema_fields[field], indices);
    names.push_back(name);
  }
  if (names.empty()) {
    std::string have;
    for (const auto& f : schema->fields()) have += (have.empty() ? "" : ", ") + f->name();
    std::string want;
    for (const auto& c : columns) want += (want.empty() ? "" : " or ") + c;
    data_error(path, "has no column " + want + " (its columns: " + have + "); name the text column with data.field or --field");
  }
  auto table = reader->ReadRowGroup(static_cast<int>(group), indices);
  if (!table.ok()) data_error(path, "row group " + std::to_string(group) + " cannot be read (" + table.status().message() + ")");
  auto combined = (*table)->CombineChunksToBatch();
  if (!combined.ok()) data_error(path, "row group " + std::to_string(group) + ": " + combined.status().message());
  const arrow::RecordBatch& batch = **combined;
  std::vector<std::shared_ptr<arrow::Array>> arrays;
  for (const std::string& name : names) arrays.push_back(batch.GetColumnByName(name));
  for (int64_t row = 0; row < batch.num_rows(); ++row) {
    nlohmann::ordered_json record = nlohmann::ordered_json::object();
    for (size_t c = 0; c < names.size(); ++c) {
      try {
        record[names[c]] = cell(*arrays[c], row);
      } catch (const std::invalid_argument& type) {
        data_error(path, "column " + names[c] + " has type " + type.what() + ", which meshtrain does not read");
      }
    }
    each(std::move(record));
  }
}

}  // namespace meshtrain::train
