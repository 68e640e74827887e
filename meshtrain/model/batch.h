// Batch: one micro-batch as the model sees it, from the data loader to the
// loss — tokens, targets, the loss's weight and where each token sits
// (Note [Batch]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace meshtrain::model {

// A target that counts toward no loss (padding, a masked prompt, the token
// after a document's end): cross-entropy's ignore index.
constexpr int64_t kIgnoredTarget = -100;

// Note [Batch]
// A micro-batch travels as one value: the sampler's rows become a Batch in
// the trainer, the step engine runs it (through the pipeline's stages too),
// context parallel keeps its own columns of it (select), and the model reads
// it in Gpt::forward: the embeddings read `positions`, every block's
// attention object (Note [Attention object]) reads `positions`, `columns`
// and `documents`, and the loss reads `targets`. Activation checkpointing
// recomputes a block with the Batch its forward had, kept in the closure.
// Three fields say where tokens sit, each undefined in the common case:
// - positions [B, T]: the position RoPE and a learned embedding use. Packed
//   rows (data.packing = "packed") restart it at 0 where a document starts;
//   a KV cache's tokens continue after what it holds.
// - columns [T]: where each of the local rows sits in the whole sequence.
//   Context parallel keeps some columns of every row (the zigzag split), and
//   attention's causal mask and window compare columns, not local indices.
// - documents [B, T]: the column where each token's document starts; a query
//   sees only the keys with its own start. This is the document boundaries in
//   the form that survives the zigzag split (cumulative lengths, Megatron's
//   form, do not: a rank's columns are not contiguous), and packed rows carry
//   it (Batch::packed).
struct Batch {
  at::Tensor tokens;     // [B, T] int64
  at::Tensor targets;    // [B, T] int64, kIgnoredTarget where none counts; undefined without a loss
  double weight = 1.0;   // the loss's multiplier: this micro-batch's share of the step
  at::Tensor positions;  // [B, T] int64; undefined: 0 .. T − 1 in every row
  at::Tensor columns;    // [T] int64; undefined: 0 .. T − 1
  at::Tensor documents;  // [B, T] int64 document starts; undefined: one document per row

  Batch() = default;
  explicit Batch(at::Tensor tokens, at::Tensor targets = {}, double weight = 1.0)
      : tokens(std::move(tokens)), targets(std::move(targets)), weight(weight) {}

  // Rows of documents side by side: each token's position inside its
  // document, 0 where one starts (the sampler's Sampler::positions).
  static Batch packed(at::Tensor tokens, at::Tensor targets, at::Tensor positions, double weight = 1.0);

  int64_t rows() const { return tokens.size(0); }
  int64_t length() const { return tokens.size(1); }
  bool packed_documents() const { return documents.defined(); }
  // The positions, made explicit: 0 .. T − 1 per row where undefined (on the tokens' device).
  at::Tensor positions_or_default() const;
  // The columns, made explicit: 0 .. T − 1 where undefined.
  at::Tensor columns_or_default() const;

  // Every tensor on `device`.
  Batch to(at::Device device) const;
  // Columns `keep` [t] (int64, of 0 .. T − 1) of every row: each [B, T]
  // field and `columns` cut alike, positions made explicit first (they are
  // the kept columns' own). Context parallel's split.
  Batch select(const at::Tensor& keep) const;
};

}  // namespace meshtrain::model
