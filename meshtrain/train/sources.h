// Where training text comes from: text files, JSON Lines (plain, gzip or
// zstd) and Parquet, as files or folders of shards, cut into units that ranks
// read independently. See Note [Data units].
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::train {

enum class SourceFormat { kText, kJsonl, kParquet };
enum class Compression { kNone, kGzip, kZstd };

struct Shard {
  std::string path;
  SourceFormat format = SourceFormat::kText;
  Compression compression = Compression::kNone;
  int64_t bytes = 0;  // on disk
};

// A piece of one shard: bytes [begin, end) of an uncompressed file (rounded to
// line starts when read), a whole compressed file (begin 0, end its size), or
// Parquet row group `begin`.
struct Unit {
  int64_t shard = 0;
  int64_t begin = 0, end = 0;
};

// The shards `inputs` name, in order: files as given; a folder's files, sorted
// and recursively, skipping hidden names, and when the folder holds any JSONL
// or Parquet files, only those (a Hugging Face dataset folder's README is not
// data). The same file reached twice is read once. Throws DataError.
std::vector<Shard> find_shards(const std::vector<std::string>& inputs);

// Note [Data units]
// Units are planned from the shards alone, never from the number of ranks, so
// the documents (and hence the tokens) are the same whatever the ranks: an
// uncompressed file is cut every `split_bytes` and each unit reads the lines
// that start inside its range; a compressed file is one unit (its stream
// cannot be entered in the middle); a Parquet file has a unit per row group.
// A text unit is one document; an uncompressed text file is therefore one
// document per split_bytes, and a compressed one is cut into documents at the
// first line end after every split_bytes of text.
std::vector<Unit> plan_units(const std::vector<Shard>& shards, int64_t split_bytes);

// Calls `each` with every record of `unit`: {"text": ...} for text; each
// line's JSON object for JSONL (blank lines skipped); each row's `fields` for
// Parquet. `where` says where the record came from ("a.jsonl line 7").
// Throws DataError naming the file and line for malformed input.
using RecordSink = std::function<void(nlohmann::ordered_json&& record, const std::string& where)>;
void read_unit(const Shard& shard, const Unit& unit, int64_t split_bytes, const std::vector<std::string>& fields,
               const RecordSink& each);

}  // namespace meshtrain::train
