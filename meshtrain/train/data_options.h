// The choices of [data] that shape what a model trains on: what records are,
// which tokens count toward the loss, and how windows are cut.
#pragma once

namespace meshtrain::train {

// What a record is: plain text (a field of JSONL/Parquet records, or a text
// file's lines) or a conversation (chat_data.h).
enum class DataFormat { kText, kChat };

// Which tokens of a conversation count toward the loss.
enum class LossOn { kAssistant, kAll };

// How windows of context + 1 tokens are cut (Note [Packing]).
enum class Packing { kConcat, kPadded, kPacked };

}  // namespace meshtrain::train
