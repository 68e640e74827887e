// A mixture-of-experts feed-forward (Switch top-1, GShard top-2, Mixtral and
// Qwen-MoE top-k, dropless or not): a router,
// capacity-limited dispatch, experts of the model's MLP style and a gated
// combine. No parallelism here: expert parallel replaces the ExpertExchange.
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::model {

// Whether parameter `name` is an expert tensor of a MoE layer (blocks.N.moe.<fc|proj|
// gate|up|down>_<weight|bias>, experts stacked along dim 0), not its router.
bool is_expert_tensor(const std::string& name);

// Computes experts [first, first + counts.size()) on `tokens`, grouped by expert
// (counts[i] rows for expert first + i, in order); returns their outputs likewise.
using ExpertCompute = std::function<at::Tensor(const at::Tensor& tokens, const std::vector<int64_t>& counts, int64_t first)>;

// Where the dispatched tokens are computed. The default runs every expert here;
// expert parallel (parallel/expert_parallel.h) sends them to their experts' ranks.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // `tokens` [M, width] grouped by expert, counts[e] rows for expert e (all
  // experts of the layer); returns the experts' outputs in the same order.
  virtual at::Tensor run(const at::Tensor& tokens, const std::vector<int64_t>& counts, const ExpertCompute& compute);
};

// What one MoE layer saw, summed over the forwards since the last reset
// (micro-batches; not the recompute of activation checkpointing).
struct MoeStats {
  int64_t forwards = 0;
  double aux_loss = 0;         // α·E·Σ fᵢ·Pᵢ (already scaled by α)
  double z_loss = 0;           // β·mean(logsumexp²)
  double dropped = 0;          // share of (token, expert) assignments over capacity
  double load_max_over_mean = 0;  // assignments of the busiest expert / the mean
  double routed = 0;           // tokens x top_k that this rank's forwards routed
  double computed = 0;         // assignments this rank's experts computed (expert parallel: from every rank)
  // For the first kForwardsKept forwards, per expert (whichever rank holds
  // it), the assignments capacity kept of this rank's tokens (under tensor
  // parallel, of its share of them, as `routed`); and each one's tokens x top_k.
  static constexpr size_t kForwardsKept = 8;
  std::vector<std::vector<double>> kept;
  std::vector<double> routed_by_forward;
};

// One MoE layer's averages over a step (ParallelModel::moe_metrics).
struct MoeLayerMetrics {
  int64_t block = 0;
  double aux_loss = 0, z_loss = 0, dropped = 0, load_max_over_mean = 0;
  // Assignments the busiest rank computed / tokens x top_k per rank: what its
  // expert activations and time are against a balanced router's (1).
  double rank_load = 0;
  double this_rank_load = 0;  // the same for this rank (0 where its pipeline stage does not hold the layer)
  int64_t ep = 1;              // the expert parallel degree it was measured at
  // rank_load at each expert parallel degree that divides the experts, from
  // every rank's kept assignments per expert in each forward, ep token
  // sources to a group (parallel::grouped_rank_load).
  std::vector<std::pair<int64_t, double>> rank_load_by_ep;
};

// Note [Mixture of experts]
// For tokens x [N, width]: router logits = x·Wrᵀ in fp32 (autocast off),
// probabilities p = softmax. Top-1 (Switch): each token goes to its argmax
// expert with gate p. Top-k, k >= 2 (GShard's 2, Mixtral's 2, Qwen3-MoE's
// 8): the k best, gates renormalised to sum 1 with moe_norm_topk (else the
// probabilities themselves, Qwen2-MoE); with k = 2 and moe_second_expert =
// "random" the second is kept with probability min(1, 2·g₂) (a token whose
// second gate is small rarely pays for it). A shared expert
// (moe_shared_hidden, Qwen2-MoE) adds sigmoid(x·w)·SwiGLU(x) for every token.
// Capacity C = ceil(N·k·cf / E) per expert (cf = 0: none, dropless): first
// choices of all tokens take places before second choices, tokens in order;
// assignments beyond C are dropped, and a token with none left outputs 0, so
// the block's residual passes it through unchanged. The combine adds each
// expert output times its gate, so the router learns from the main loss.
// Auxiliary losses, added to the training loss through the backward of the
// layer's output (scaled like the main loss, set_aux_loss_scale): Switch
// load balancing α·E·Σᵢ fᵢ·Pᵢ (fᵢ: share of tokens whose first choice is i,
// Pᵢ: mean probability of i) and the router z-loss β·mean(logsumexp(logits)²).
// Everything is per forward call (one micro-batch), so a step over
// micro-batches equals the same micro-batches on any number of data ranks.
// Under tensor parallel each rank of the group routes the whole micro-batch
// (the same decisions everywhere) and computes a share of the assignments
// (set_replica_share), so no token is sent to its expert twice.
class MoeImpl : public torch::nn::Module {
 public:
  explicit MoeImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);  // [B, T, width] -> [B, T, width]

  // Experts held here: [first_expert(), first_expert() + local_experts()).
  int64_t local_experts() const { return expert_weights().front().size(0); }
  int64_t first_expert() const { return first_expert_; }
  // Expert parallel keeps only experts [first, first + count) (slices every expert tensor).
  void keep_experts(int64_t first, int64_t count);
  void set_exchange(std::shared_ptr<ExpertExchange> exchange) { exchange_ = std::move(exchange); }
  const std::shared_ptr<ExpertExchange>& exchange() const { return exchange_; }
  void set_aux_loss_scale(double scale) { aux_loss_scale_ = scale; }
  // Tensor parallel: every one of `replicas` ranks routes the same tokens, and
  // this one (`replica`) computes only the assignments of tokens i with i %
  // replicas == replica; its output is a partial sum (the caller adds them
  // up) and the auxiliary losses enter its backward divided by `replicas`.
  void set_replica_share(int64_t replica, int64_t replicas) { replica_ = replica, replicas_ = replicas; }
  // Read from the device once, when asked (the forward never waits for it).
  MoeStats stats() const;
  void reset_stats();
  // Expert tensors, [experts, ...] each: fc_weight, fc_bias, proj_weight,
  // proj_bias (gelu) or gate_weight, up_weight, down_weight (+ biases).
  std::vector<at::Tensor> expert_weights() const;

  at::Tensor router;  // [experts, width]
  at::Tensor fc_weight, fc_bias, proj_weight, proj_bias;                        // gelu
  at::Tensor gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias;  // swiglu, geglu
  // model.moe_shared_hidden: the shared expert (gate, up, down [hidden, width]
  // ... [width, hidden]) and its gate [1, width]; replicated like the router.
  at::Tensor shared_gate, shared_up, shared_down, shared_expert_gate;

 private:
  at::Tensor experts(const at::Tensor& tokens, const std::vector<int64_t>& counts, int64_t first);
  at::Tensor shared_expert(const at::Tensor& flat);  // [n, width] -> [n, width], gated

  GptConfig config_;
  int64_t first_expert_ = 0;
  double aux_loss_scale_ = 1.0;
  int64_t replica_ = 0, replicas_ = 1;
  std::shared_ptr<ExpertExchange> exchange_ = std::make_shared<ExpertExchange>();
  int64_t forwards_ = 0;
  int64_t routed_ = 0, computed_ = 0;  // host counts (no device reads)
  at::Tensor sums_;  // [aux, z, dropped, load] summed over the forwards, double, on the layer's device
  // Per forward, per expert: the assignments this rank computes or sends; and each forward's routed count.
  std::vector<std::vector<double>> kept_;
  std::vector<double> routed_by_forward_;
};
TORCH_MODULE(Moe);

}  // namespace meshtrain::model
