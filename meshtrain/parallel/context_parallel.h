// ContextParallel: every sequence split over the cp ranks of a group, the
// model's attention computed across them (Note [Context parallel]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/ring_attention.h"

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// Note [Context parallel]
// The cp ranks of a group read the same micro-batches; each keeps its columns
// of every sequence under the zigzag split (rank i: chunks i and 2·cp − 1 − i
// of 2·cp, Note [Ring attention]), so a step reads what one process reads.
// Everything but attention is per row and runs on those rows as it would on
// the whole sequence. Three things see the split:
// - positions: shard() cuts each Batch to the rank's columns (Batch::select,
//   Note [Batch]): tokens, targets, positions (global, or inside each packed
//   document) and document starts alike, and `columns` says which they are,
//   so RoPE rotates and the learned position embedding reads as over the
//   whole sequence (and activation checkpointing recomputes with them);
// - attention: every block's attention object (Note [Attention object]) is
//   replaced by ring, all-to-all or hybrid attention over the cp group, on
//   the queries, keys and values the block itself makes (qk_norm and RoPE
//   included) and under its spec (scale, sliding window, soft-cap); packed
//   rows pass their document starts, so a query sees only its own
//   document's keys;
// - the loss: each rank's loss is the mean over its counted targets, weighted
//   by cp × its share of the micro-batch's counted targets, and the cp ranks
//   average gradients and losses with the data ranks (the reduction runs
//   over dp × fsdp × ep × cp), so the result is the mean over the whole
//   sequence — exactly, with masked targets too.
// The key/value gradients of the ring come home inside the attention's
// backward, so each rank's parameter gradients are its rows' share and the
// average over cp is the whole sequence's gradient.
// Not split: attention dropout (refused by the config), and a mixture of
// experts' auxiliary losses, which each rank computes over its own rows.
class ContextParallel {
 public:
  // Installs its attention on every block of `model` (it must outlive this
  // object); `cp` is the group, `impl` how attention runs across it, `a2a`
  // the all-to-all group's size under hybrid (ParallelDims::a2a_group).
  // Collective over `cp`.
  ContextParallel(model::Gpt model, std::shared_ptr<comm::Communicator> cp, mesh::ContextParallelImpl impl, int64_t a2a);
  ~ContextParallel();
  ContextParallel(const ContextParallel&) = delete;
  ContextParallel& operator=(const ContextParallel&) = delete;

  const std::shared_ptr<comm::Communicator>& comm() const { return cp_; }
  int64_t size() const { return cp_->size(); }

  // The global positions of this rank's rows in a sequence of `length`.
  at::Tensor positions(int64_t length) const;

  // A micro-batch cut to this rank's columns ([B, T] -> [B, T / cp], with
  // `columns` set), its weight scaled by cp × this rank's share of the
  // counted targets.
  model::Batch shard(const model::Batch& batch) const;

  // "context parallel cp(4), ring attention, zigzag split"
  std::string describe() const;

 private:
  class SplitAttention;

  model::Gpt model_;
  std::shared_ptr<comm::Communicator> cp_;
  mesh::ContextParallelImpl impl_;
  int64_t a2a_;
  std::shared_ptr<comm::Communicator> a2a_comm_, ring_comm_;  // hybrid: the all-to-all group, the ring across groups
  std::unique_ptr<model::AttentionSwap> swap_;
};

}  // namespace meshtrain::parallel
