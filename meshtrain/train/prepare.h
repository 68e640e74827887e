// `prepare`: sources (text, JSONL, Parquet; see sources.h) tokenized by every
// rank in parallel into token files with a document index, and for chat data
// a loss mask. Note [Prepared data].
#pragma once

#include "meshtrain/train/chat_data.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::comm {
class Communicator;
}

namespace meshtrain::train {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or folders (find_shards)
  std::string out_dir;
  double val_fraction = 0.1;
  std::string tokenizer = "bytes";  // text::load_tokenizer's spec
  DataFormat format = DataFormat::kText;
  std::string field = "text";  // the text of a JSONL / Parquet record
  LossOn loss_on = LossOn::kAssistant;
  int64_t split_mb = 64;  // Note [Data units]
};

struct PrepareResult {
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t train_documents = 0, val_documents = 0;
  int64_t train_counted = 0;   // training targets that count toward the loss (all, without a mask)
  std::vector<std::string> sources;  // the files read, in order
  int64_t units = 0, resumed_units = 0;  // units, and those an interrupted run had finished
  bool reused = false;  // out_dir already held this very preparation
  int token_bytes = 0;
  double seconds = 0, tokenize_seconds = 0;  // all, and the slowest rank's tokenizing
  double peak_rss_mb = 0;  // the largest of the ranks
};

// Prepares on every rank of `world` (null: this process alone). Collective;
// an error on any rank ends every rank with it. Throws DataError (with a
// communicator, comm::AgreedError with the same message on every rank).
PrepareResult prepare(const PrepareOptions& options, comm::Communicator* world = nullptr);

// Text files or folders with defaults otherwise.
PrepareResult prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                      const std::string& tokenizer = "bytes");

}  // namespace meshtrain::train
