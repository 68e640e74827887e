// Tensor parallel (Megatron-LM) with optional sequence parallel, applied to an
// unchanged model by a plan of module names and styles. See Note [Tensor parallel].
#pragma once

#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/tensor_parallel_ops.h"
#include "meshtrain/parallel/tensor_parallelism.h"
#include "meshtrain/placement/placement.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// How one module (or call site, Note [Forward hooks]) takes part.
enum class TensorParallelStyle {
  // Linear with its output features split: weight rows (and bias) chunked,
  // `parts` equal sub-blocks chunked each (qkv holds q, k and v). Its input is
  // replicated; with sequence parallel it arrives sequence-sharded and is
  // gathered inside the matmul (sequence_gathered_linear).
  kColwise,
  // Linear with its input features split: weight columns chunked. Partial
  // outputs are summed over the group (g), or reduce-scattered along the
  // sequence with sequence parallel; the bias is added once, after.
  kRowwise,
  // Embedding with rows split by vocabulary: ids outside this rank's range
  // look up zeros, and the outputs are summed (or reduce-scattered).
  kVocabEmbedding,
  // LM head (its own weight, or the vocab-sharded tied embedding): input
  // replicated or gathered as for kColwise, logits stay split over the
  // vocabulary and the loss is vocab_parallel_cross_entropy.
  kVocabHead,
  // A module whose input becomes replicated: f (copy_to_tensor_parallel), so
  // its column-parallel linears share one backward all-reduce. Nothing with
  // sequence parallel (the linears gather).
  kPrepareInput,
  // Norms: with sequence parallel they run on this rank's sequence chunk and
  // their parameters' gradients are summed over the group.
  kSequenceParallel,
  // Position embedding: with sequence parallel, this rank's positions only.
  kSequencePositions,
  // Randomness (dropout) drawn from this rank's own stream: in regions where
  // ranks hold different data (split heads; sequence chunks with SP).
  kLocalRandom,
  // A mixture-of-experts layer (model::Moe): router and experts whole on
  // every rank, each rank computing a share of the assignments
  // (set_replica_share); input f (or gathered along the sequence), partial
  // outputs g (or reduce-scattered), parameter gradients summed over the group.
  kMixtureOfExperts,
};

struct TensorParallelRule {
  std::string pattern;  // dotted name; "*" matches one segment ("blocks.*.attn.qkv")
  TensorParallelStyle style;
  int parts = 1;        // kColwise: equal sub-blocks of the output features
  // kColwise: the model adds this linear's bias itself, fused with what follows
  // (model.fused: the MLP's bias + GELU), so the hook's own linear leaves it out.
  bool bias_in_model = false;
};

using TensorParallelPlan = std::vector<TensorParallelRule>;

// The plan for model::Gpt, as Megatron splits a transformer: attention by
// heads (qkv column, proj row), MLP column then row, vocab-parallel embedding
// and head; with sequence parallel, norms, dropout and residuals on sequence
// chunks.
TensorParallelPlan gpt_tensor_parallel_plan(const model::GptConfig& config, bool sequence_parallel);

// Throws mesh::LayoutError naming what `t` does not divide (the rules of
// mesh/parallel_dims.h): heads, MLP hidden size, vocabulary, and with
// sequence parallel the context.
void check_tensor_parallel(const model::GptConfig& config, int t, bool sequence_parallel);

struct TensorParallelOptions {
  bool sequence_parallel = false;
  uint64_t seed = 1337;  // of the per-rank random stream (RandomStreams::per_rank_seed)
};

// Note [Tensor parallel]
// Applying the plan shards the model's parameters in place (set_data: names,
// modules and optimisers see the local shards) from the full initial values,
// so a tensor-parallel model computes what the full one does, and installs
// forward hooks that put the collectives around the linears:
//   attention  x -f-> qkv (column) -> heads/t -> proj (row) -g-> + bias
//   MLP        x -f-> fc (column) -> gelu -> proj (row) -g-> + bias
//   MoE        x -f-> route all tokens, compute 1/t of the assignments -g->
// one all-reduce forward (g) and one backward (f) per attention and per MLP.
// Sequence parallel turns g into a reduce-scatter and f into an all-gather
// (done inside the column matmul, so the gathered input is never saved); the
// residual stream, norms and dropout then hold 1/t of the sequence, and the
// gradients of the parameters used there (norms, row biases, positions) are
// partial sums, all-reduced over the group by a hook as each is produced.
// Random numbers: replicated regions draw from the default generator, which
// is the same on every rank; regions holding different data on each rank
// (attention over split heads; dropout on sequence chunks) draw from a
// per-rank stream, swapped in and out of the default generator.
class TensorParallel : public TensorParallelism {
 public:
  // `comm` is the tp group. Every rank must hold the same full model.
  TensorParallel(model::Gpt model, CommPtr comm, const TensorParallelPlan& plan, TensorParallelOptions options);
  ~TensorParallel() override;
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;

  // Shard(dim, parts): each of `parts` equal blocks of `dim` split alike.
  bool is_split(const std::string& name) const override;
  placement::Placement placement_of(const std::string& name) const override;
  // The full value of parameter `name` from the local shards of every rank. Collective.
  at::Tensor gather(const std::string& name, const at::Tensor& local) const;
  // `full` cut to this rank's shard of parameter `name` (copied).
  at::Tensor shard(const std::string& name, const at::Tensor& full) const;
  std::map<std::string, at::Tensor> gather_all(const std::map<std::string, at::Tensor>& local) const override;

  // Runs `fn` with this rank's random stream as the default generator.
  void with_local_random(const std::function<void()>& fn);
  // That stream between uses (what a recomputed forward must start from).
  at::Tensor local_random_state() const { return local_random_state_.clone(); }
  void set_local_random_state(const at::Tensor& state) { local_random_state_ = state.clone(); }

  // The per-rank stream, as "tensor_parallel" at this rank's tp rank.
  std::vector<RandomStreams::PerRank> random_streams() override;
  std::string describe() const override;

  bool sequence_parallel() const { return options_.sequence_parallel; }
  const CommPtr& comm() const override { return comm_; }

 private:
  struct Hooks;
  struct Split {
    int64_t dim;
    int64_t parts;
  };
  std::vector<int64_t> blocks(const std::string& name, at::IntArrayRef shape, int64_t per_part) const;

  model::Gpt model_;
  CommPtr comm_;
  TensorParallelOptions options_;
  std::map<std::string, Split> split_;  // parameters split over the group
  std::shared_ptr<Hooks> hooks_;
  at::Tensor local_random_state_;
};

}  // namespace meshtrain::parallel
