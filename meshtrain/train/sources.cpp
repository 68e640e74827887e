#include "meshtrain/train/sources.h"

#include "meshtrain/train/data_error.h"
#include "meshtrain/train/parquet_reader.h"
#include "meshtrain/util/files.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

namespace meshtrain::train {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Shard classify(const std::string& path) {
  Shard shard;
  shard.path = path;
  shard.bytes = util::file_size(path);
  std::string name = util::base_name(path);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const auto& [suffix, compression] : {std::pair<const char*, Compression>{".gz", Compression::kGzip},
                                            {".zst", Compression::kZstd}, {".zstd", Compression::kZstd}}) {
    if (ends_with(name, suffix)) {
      shard.compression = compression;
      name.resize(name.size() - std::strlen(suffix));
    }
  }
  if (ends_with(name, ".jsonl") || ends_with(name, ".ndjson") || ends_with(name, ".json")) {
    shard.format = SourceFormat::kJsonl;
  } else if (ends_with(name, ".parquet")) {
    if (shard.compression != Compression::kNone) data_error(path, "a compressed Parquet file; Parquet compresses its own pages");
    shard.format = SourceFormat::kParquet;
  }
  return shard;
}

void list_files(const std::string& dir, std::vector<std::string>& out) {
  for (const std::string& name : util::list_directory(dir)) {
    if (name.empty() || name[0] == '.') continue;
    const std::string path = util::join_path(dir, name);
    if (util::is_directory(path)) list_files(path, out);
    else if (util::is_regular_file(path)) out.push_back(path);
  }
}

// A byte stream: part of a plain file, or a whole gzip or zstd file.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t read(char* buffer, size_t bytes) = 0;  // 0 at the end
};

class PlainStream : public Stream {
 public:
  PlainStream(const std::string& path, int64_t offset) : path_(path), offset_(offset) {
    fd_ = open(path.c_str(), O_RDONLY);
    if (fd_ < 0) data_error(path, std::string("cannot be opened (") + std::strerror(errno) + ")");
  }
  ~PlainStream() override { close(fd_); }
  size_t read(char* buffer, size_t bytes) override {
    const ssize_t got = pread(fd_, buffer, bytes, offset_);
    if (got < 0) data_error(path_, std::string("read failed (") + std::strerror(errno) + ")");
    offset_ += got;
    return static_cast<size_t>(got);
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t offset_;
};

class GzipStream : public Stream {
 public:
  explicit GzipStream(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    if (!file_) data_error(path, "cannot be opened");
    gzbuffer(file_, 1 << 20);
  }
  ~GzipStream() override { gzclose(file_); }
  size_t read(char* buffer, size_t bytes) override {
    const int got = gzread(file_, buffer, static_cast<unsigned>(bytes));
    if (got > 0 && gzdirect(file_)) data_error(path_, "is not valid gzip (no gzip header; zlib would read it as it is)");
    if (got < 0) {
      int code = 0;
      data_error(path_, std::string("is not valid gzip (") + gzerror(file_, &code) + ")");
    }
    return static_cast<size_t>(got);
  }

 private:
  std::string path_;
  gzFile file_;
};

class ZstdStream : public Stream {
 public:
  explicit ZstdStream(const std::string& path) : path_(path), raw_(path, 0), context_(ZSTD_createDCtx()) {
    input_.resize(ZSTD_DStreamInSize());
  }
  ~ZstdStream() override { ZSTD_freeDCtx(context_); }
  // A frame decoded but not yet all written out asks for more calls with no
  // input. At the end of the file the stream is whole when the last call that
  // made progress finished its frame (returned 0).
  size_t read(char* buffer, size_t bytes) override {
    for (;;) {
      if (in_.pos == in_.size && !end_) {
        in_ = {input_.data(), raw_.read(input_.data(), input_.size()), 0};
        end_ = in_.size == 0;
      }
      ZSTD_outBuffer out{buffer, bytes, 0};
      const size_t consumed = in_.pos;
      const size_t left = ZSTD_decompressStream(context_, &out, &in_);
      if (ZSTD_isError(left)) data_error(path_, std::string("is not valid zstd (") + ZSTD_getErrorName(left) + ")");
      if (out.pos > 0 || in_.pos > consumed) frame_left_ = left;
      if (out.pos > 0) return out.pos;
      if (end_ && in_.pos == in_.size) {
        if (frame_left_ != 0) data_error(path_, "is a truncated zstd stream");
        return 0;
      }
    }
  }

 private:
  std::string path_;
  PlainStream raw_;
  ZSTD_DCtx* context_;
  std::vector<char> input_;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  bool end_ = false;  // the file is read to its end
  size_t frame_left_ = 0;  // what the last call that made progress returned
};

// Lines of a stream, each with its '\n' when it has one, and where it
// starts. A line longer than `longest` bytes is refused (a file without line
// ends, a decompression bomb); skip() passes over one without keeping it.
class LineReader {
 public:
  LineReader(std::unique_ptr<Stream> stream, int64_t offset, const std::string& path, int64_t longest)
      : stream_(std::move(stream)), offset_(offset), path_(path), longest_(longest) {}
  bool next(std::string& line, int64_t& start, bool keep = true) {
    line.clear();
    start = offset_;
    for (;;) {
      if (pos_ == buffer_.size()) {
        buffer_.resize(1 << 20);
        buffer_.resize(stream_->read(buffer_.data(), buffer_.size()));
        pos_ = 0;
        if (buffer_.empty()) return !line.empty();
      }
      const char* begin = buffer_.data() + pos_;
      const void* newline = std::memchr(begin, '\n', buffer_.size() - pos_);
      const size_t take = newline ? static_cast<const char*>(newline) - begin + 1 : buffer_.size() - pos_;
      if (keep) line.append(begin, take);
      pos_ += take;
      offset_ += static_cast<int64_t>(take);
      if (newline) return true;
      if (offset_ - start > longest_) {
        data_error(path_, "the line at byte " + std::to_string(start) + " is longer than " + std::to_string(longest_ >> 20) +
                        " MiB; records and lines must be shorter (raise data.split_mb, which sets this at 4x)");
      }
    }
  }

 private:
  std::unique_ptr<Stream> stream_;
  std::vector<char> buffer_;
  size_t pos_ = 0;
  int64_t offset_;
  std::string path_;
  int64_t longest_;
};

std::unique_ptr<Stream> open_stream(const Shard& shard, int64_t offset) {
  switch (shard.compression) {
    case Compression::kGzip: return std::make_unique<GzipStream>(shard.path);
    case Compression::kZstd: return std::make_unique<ZstdStream>(shard.path);
    case Compression::kNone: break;
  }
  return std::make_unique<PlainStream>(shard.path, offset);
}

// The lines starting inside the unit, with where each starts and its number
// (counted from the unit's first line; the file's when the unit starts it).
void each_line(const Shard& shard, const Unit& unit, int64_t split_bytes,
               const std::function<void(const std::string&, int64_t start, int64_t number)>& each) {
  const bool ranged = shard.compression == Compression::kNone;
  const int64_t from = ranged && unit.begin > 0 ? unit.begin - 1 : 0;
  LineReader reader(open_stream(shard, from), from, shard.path, std::max<int64_t>(4 * split_bytes, 64 << 20));
  std::string line;
  int64_t start = 0, number = 0;
  if (from > 0) reader.next(line, start, /*keep=*/false);  // the line that started before the unit
  while (reader.next(line, start)) {
    if (ranged && start >= unit.end) break;
    each(line, start, ++number);
  }
}

std::string line_place(const Shard& shard, const Unit& unit, int64_t start, int64_t number) {
  if (unit.begin == 0) return shard.path + " line " + std::to_string(number);
  return shard.path + " (the line at byte " + std::to_string(start) + ")";
}

void read_jsonl(const Shard& shard, const Unit& unit, int64_t split_bytes, const RecordSink& sink) {
  each_line(shard, unit, split_bytes, [&](const std::string& line, int64_t start, int64_t number) {
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) return;
    const std::string where = line_place(shard, unit, start, number);
    nlohmann::ordered_json record = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) data_error(where, "not a JSON value");
    if (!record.is_object()) data_error(where, "a JSON Lines record must be an object");
    sink(std::move(record), where);
  });
}

void read_text(const Shard& shard, const Unit& unit, int64_t split_bytes, const RecordSink& sink) {
  std::string document;
  int64_t first = 1;
  auto flush = [&](int64_t last) {
    if (document.empty()) return;
    std::string where = shard.path + (unit.begin > 0 ? " from byte " + std::to_string(unit.begin)
                                                     : " lines " + std::to_string(first) + "-" + std::to_string(last));
    sink(nlohmann::ordered_json{{"text", std::move(document)}}, where);
    document.clear();
    first = last + 1;
  };
  int64_t last = 0;
  each_line(shard, unit, split_bytes, [&](const std::string& line, int64_t, int64_t number) {
    document += line;
    last = number;
    // A compressed file is one unit: cut it into documents of about split_bytes.
    if (shard.compression != Compression::kNone && static_cast<int64_t>(document.size()) >= split_bytes) flush(last);
  });
  flush(last);
}

}  // namespace

std::vector<Shard> find_shards(const std::vector<std::string>& inputs) {
  if (inputs.empty()) throw DataError("data: name at least one file or folder");
  std::vector<Shard> shards;
  std::set<std::string> seen;
  auto add = [&](const std::string& file) {
    if (seen.insert(util::canonical_path(file)).second) shards.push_back(classify(file));
  };
  for (const std::string& input : inputs) {
    if (!util::path_exists(input)) throw DataError("input " + input + ": does not exist");
    if (!util::is_directory(input)) {
      add(input);
      continue;
    }
    std::vector<std::string> files;
    list_files(input, files);
    if (files.empty()) throw DataError("input " + input + ": the folder holds no files");
    const bool structured = std::any_of(files.begin(), files.end(), [](const std::string& f) {
      return classify(f).format != SourceFormat::kText;
    });
    for (const std::string& f : files) {
      if (!structured || classify(f).format != SourceFormat::kText) add(f);
    }
  }
  return shards;
}

std::vector<Unit> plan_units(const std::vector<Shard>& shards, int64_t split_bytes) {
  std::vector<Unit> units;
  for (int64_t s = 0; s < static_cast<int64_t>(shards.size()); ++s) {
    const Shard& shard = shards[s];
    if (shard.format == SourceFormat::kParquet) {
      const int64_t groups = parquet_row_groups(shard.path);
      for (int64_t g = 0; g < groups; ++g) units.push_back({s, g, g + 1});
    } else if (shard.compression != Compression::kNone || shard.bytes == 0) {
      units.push_back({s, 0, shard.bytes});
    } else {
      for (int64_t b = 0; b < shard.bytes; b += split_bytes) units.push_back({s, b, std::min(shard.bytes, b + split_bytes)});
    }
  }
  return units;
}

void read_unit(const Shard& shard, const Unit& unit, int64_t split_bytes, const std::vector<std::string>& fields,
               const RecordSink& each) {
  switch (shard.format) {
    case SourceFormat::kText: return read_text(shard, unit, split_bytes, each);
    case SourceFormat::kJsonl: return read_jsonl(shard, unit, split_bytes, each);
    case SourceFormat::kParquet:
      return read_parquet_rows(shard.path, unit.begin, fields, [&](nlohmann::ordered_json&& row) {
        each(std::move(row), shard.path + " row group " + std::to_string(unit.begin));
      });
  }
}

}  // namespace meshtrain::train
