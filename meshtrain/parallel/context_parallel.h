// ContextParallel: every sequence split over the cp ranks of a group, the
// model's attention computed across them (Note [Context parallel]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/ring_attention.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// Note [Context parallel]
// The cp ranks of a group read the same micro-batches; each keeps its rows of
// every sequence under the zigzag split (rank i: chunks i and 2·cp − 1 − i
// of 2·cp, Note [Ring attention]), so a step reads what one process reads.
// Everything but attention is per row and runs on those rows as it would on
// the whole sequence. Three things see the split:
// - positions: each micro-batch runs in a DocumentScope of its rows' global
//   positions (packed rows: their positions inside their documents), so RoPE
//   rotates and the learned position embedding reads as over the whole
//   sequence (and activation checkpointing recomputes in it);
// - attention: a hook replaces every block's attention core (attn.core) with
//   ring, all-to-all or hybrid attention over the cp group, on the queries,
//   keys and values the block itself makes (qk_norm and RoPE included) and
//   under its rule (scale, sliding window, soft-cap); packed rows pass each
//   row's document start (global position − position in its document), so
//   a query sees only its own document's keys;
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
// A block's attention core call ("blocks.N.attn.core", whose input is the
// qkv projection's output): its block, its queries, keys and values (QK-norm
// and RoPE at the DocumentScope's positions) and its rule. nullopt for any
// other module. What the context-parallel hooks replace, in training and
// generation.
struct CoreCall {
  int64_t block;
  model::QkvHeads heads;
  AttentionRule rule;
};
std::optional<CoreCall> attention_core(model::GptImpl& model, const std::string& module, const at::Tensor& input);

class ContextParallel {
 public:
  // Installs the attention hook on `model` (it must outlive this object);
  // `cp` is the group, `impl` how attention runs across it, `a2a` the
  // all-to-all group's size under hybrid (ParallelDims::a2a_group). Collective over `cp`.
  ContextParallel(model::Gpt model, std::shared_ptr<comm::Communicator> cp, mesh::ContextParallelImpl impl, int64_t a2a);
  ~ContextParallel();
  ContextParallel(const ContextParallel&) = delete;
  ContextParallel& operator=(const ContextParallel&) = delete;

  const std::shared_ptr<comm::Communicator>& comm() const { return cp_; }
  int64_t size() const { return cp_->size(); }

  // The global positions of this rank's rows in a sequence of `length`.
  at::Tensor positions(int64_t length) const;

  // A step's micro-batches cut to this rank's rows: tokens and targets [B, T]
  // -> [B, T / cp], each weight scaled by cp × this rank's share of the
  // counted targets, and the rows' positions [B, T / cp] for the
  // DocumentScope: global, or (packed rows, `documents` not empty) inside
  // each document. The forwards that follow pass document starts to
  // attention only for packed rows (the data's setting: every rank alike).
  struct Rows {
    std::vector<at::Tensor> inputs, targets, positions;
    std::vector<double> weights;
  };
  Rows rows(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
            const std::vector<double>& weights, const std::vector<at::Tensor>& documents);

  // "context parallel cp(4), ring attention, zigzag split"
  std::string describe() const;

 private:
  class Hooks;

  model::Gpt model_;
  std::shared_ptr<comm::Communicator> cp_;
  mesh::ContextParallelImpl impl_;
  int64_t a2a_;
  std::shared_ptr<comm::Communicator> a2a_comm_, ring_comm_;  // hybrid: the all-to-all group, the ring across groups
  std::shared_ptr<Hooks> hooks_;
  bool packed_ = false;  // the rows of the forwards now running hold packed documents
};

}  // namespace meshtrain::parallel
