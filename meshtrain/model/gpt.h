// A GPT-family decoder as a torch::nn::Module. It knows nothing about
// parallelism: the parallel layer re-shards its modules by name
// (blocks.N.attn.qkv, blocks.N.attn.proj, blocks.N.mlp.fc/proj or gate/up/down,
// wte, wpe, head).
#pragma once

#include "meshtrain/model/attention.h"
#include "meshtrain/model/batch.h"
#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/gpt_config.h"
#include "meshtrain/model/moe.h"
#include "meshtrain/model/rope.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::model {

// Note [Forward hooks]
// The model calls each of its modules through the hooks installed on it, by
// dotted name, in execution order:
//   ""                    the whole model: tokens [B, T] -> logits [B, T, V]
//                         (in loss(), the loss itself where it is chunked)
//   wte, wpe, drop        token embedding, position embedding (input: the
//                         Batch's positions), embedding dropout
//   blocks.N              a transformer block, and inside it
//     .norm1 .attn .norm2 .mlp (.post1 .post2: norm_placement "sandwich")
//     .attn.qkv .attn.core .attn.proj .attn.drop
//                         core is attention proper: qkv's output [B, T, 3w]
//                         -> [B, T, w] before proj (w: the width qkv produced),
//                         computed by the block's Attention object (Note
//                         [Attention object])
//     .mlp.fc .mlp.proj (gelu) | .mlp.gate .mlp.up .mlp.down (swiglu,
//                         geglu), .mlp.drop
//     .moe                in a mixture-of-experts block, instead of .mlp
//   norm_f, head          final norm; the LM head (tied to wte or not)
// A hook may change a call's input, its output, or compute it another way.
// With model.fused, .norm2 is called on the attention's output and adds the
// residual itself (one pass: h = x + attn, norm(h)), and .mlp.fc's own call
// leaves out its bias, which is added with the GELU (Note [Fused operators]).
// The model itself knows nothing of parallelism: the parallel layer uses the
// hooks (fully sharded units gather their parameters around "" and blocks.N;
// tensor parallel puts its collectives around the linears and embeddings).
// Attention takes its head count from the width qkv produces, so heads split
// across ranks need no change here.
// `forward` owns what it calls, the micro-batch's Batch included: a hook may
// keep it and run it again later (activation checkpointing recomputes a
// block in backward this way, with the Batch of its forward).
class ForwardHooks {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  virtual ~ForwardHooks() = default;
  // Returns the output of `module` on `input`; `forward` is its own computation.
  virtual at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) = 0;
  // Whether these hooks change norm_f, head or the loss (tensor parallel's
  // vocabulary-split head does): then the loss goes through them, on whole
  // logits unless chunks_head() says they take it in chunks too; hooks that
  // answer false let the model compute it in chunks (Note [Chunked loss]).
  // Unknown hooks are taken to.
  virtual bool wraps_head() const { return true; }
  virtual bool chunks_head() const { return false; }
  // The chunked loss (Note [Chunked loss]) of the final norm's output y
  // [..., d] with the head's `weight` against targets, soft-capped by
  // `softcap`, with the z-loss of weight `z_loss` (0 outside grad mode),
  // its gradients made `when` asked (kIntoWeightGrad for a loss the caller
  // multiplies by `loss_weight`), for hooks whose chunks_head() holds; an
  // undefined tensor leaves it to the model (tensor parallel: a head it does
  // not split).
  virtual at::Tensor head_loss(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& targets,
                               double softcap, LossGradients when, double loss_weight, double z_loss) {
    (void)y, (void)weight, (void)targets, (void)softcap, (void)when, (void)loss_weight, (void)z_loss;
    return {};
  }
  // The mean cross-entropy of logits [N, V'] (in the dtype the head computed
  // them, bf16 under autocast; fp32 is the hook's to choose) against targets
  // [N], plus the z-loss of weight `z_loss` (0 outside grad mode), or an
  // undefined tensor to leave it to the model (tensor parallel computes it
  // from logits sharded over the vocabulary).
  virtual at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, double z_loss) {
    (void)logits, (void)targets, (void)z_loss;
    return {};
  }
};

// Rotary position embedding: pairs (x[i], x[i + r/2]) of the first r dims of
// the last dim of x [..., t, d] rotated by the angles of positions offset ..
// offset + t - 1 (tables cos / sin [context, r/2]; r = d unless the model
// rotates a fraction of each head).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset = 0);
// The same rotation of x [B, H, t, d] at each row's own positions [B, t]
// (Note [Batch]; a KV cache's decode positions).
at::Tensor apply_rope_at(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);

// q, k and v of the fused qkv projection's outputs [B, T, n] (Note [Grouped-query layout] in qkv_layout.h), as heads.
QkvHeads split_qkv(const at::Tensor& qkv_out, const GptConfig& config);

// The hooks of one model, shared by all its modules.
class HookChain {
 public:
  at::Tensor call(const std::string& module, const at::Tensor& input, ForwardHooks::Forward forward) const;
  // Installed later wraps earlier: the last one is outermost.
  std::vector<std::shared_ptr<ForwardHooks>> hooks;
};

// LayerNorm (weight, optional bias) or RMSNorm (weight), over the last dim.
class NormImpl : public torch::nn::Module {
 public:
  // `fused`: through model/fused/ops.h where the tensors allow; `plus_one`:
  // RMSNorm scales by (1 + weight), its weight starting at 0 (Gemma).
  NormImpl(NormStyle kind, int64_t width, bool bias, double eps = 1e-5, bool fused = false,
           bool plus_one = false);
  at::Tensor forward(const at::Tensor& x);
  // (h, norm(h)) for h = x + residual, in one pass when fused.
  std::pair<at::Tensor, at::Tensor> forward_add(const at::Tensor& x, const at::Tensor& residual);

 private:
  bool rms_, fused_, plus_one_;
  double eps_;
  at::Tensor weight_, bias_;
};
TORCH_MODULE(Norm);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  // `name` is the module's dotted name in the model, for the hooks; `block`
  // its block's index (sliding windows go by block).
  CausalSelfAttentionImpl(const GptConfig& config, std::shared_ptr<HookChain> chain, const std::string& name,
                          int64_t block = 0);
  at::Tensor forward(const at::Tensor& x, const Batch& batch);  // [B, T, width] -> [B, T, width]

  // The core's queries, keys and values for qkv's output [B, T, 3w]: split by
  // heads, through qk_norm, rotated at the batch's positions.
  QkvHeads heads(const at::Tensor& qkv_out, const Batch& batch) const;
  const AttentionSpec& spec() const { return spec_; }
  // The object that computes attention proper (Note [Attention object]);
  // set_attention installs another and returns the one it replaces.
  const std::shared_ptr<Attention>& attention() const { return attention_; }
  std::shared_ptr<Attention> set_attention(std::shared_ptr<Attention> attention);

  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  Norm q_norm{nullptr}, k_norm{nullptr};  // model.qk_norm

 private:
  at::Tensor attend(const at::Tensor& qkv_out, const Batch& batch);  // the "core" call
  // q, k [B, H, T, hd] through model.qk_norm (as they are without it).
  std::pair<at::Tensor, at::Tensor> normalize_qk(const at::Tensor& q, const at::Tensor& k) const;

  GptConfig config_;
  int64_t head_dim_;
  double dropout_;
  bool rope_, fused_;
  AttentionSpec spec_;
  std::shared_ptr<Attention> attention_;
  at::Tensor cos_, sin_;  // rope tables [context, rotary dims / 2]
  std::shared_ptr<HookChain> chain_;
  std::string qkv_name_, core_name_, proj_name_, drop_name_;
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const GptConfig& config, std::shared_ptr<HookChain> chain, const std::string& name);
  at::Tensor forward(const at::Tensor& x);  // ends with the residual dropout
  // Selective recompute: the down projection keeps the fused GLU's inputs and
  // makes its input again (Note [The GLU's output made again]).
  void make_glu_output_again(bool on) { glu_made_again_ = on; }

  torch::nn::Linear fc{nullptr}, proj{nullptr};             // gelu
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};  // swiglu

 private:
  at::Tensor activation(const at::Tensor& x);  // the hidden layer before proj / down

  double dropout_;
  bool fused_, gelu_gate_;  // gelu_gate_: geglu
  bool glu_made_again_ = false;
  std::shared_ptr<HookChain> chain_;
  std::string fc_name_, proj_name_, gate_name_, up_name_, down_name_, drop_name_;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  // `experts`: the feed-forward is a mixture of experts (moe) instead of the
  // MLP; `index`: the block's place in the model.
  BlockImpl(const GptConfig& config, std::shared_ptr<HookChain> chain, const std::string& name, bool experts = false,
            int64_t index = 0);
  at::Tensor forward(const at::Tensor& x, const Batch& batch);

  // norm_placement "pre": norm1 and norm2 before attention and the MLP;
  // "post": after them; "sandwich": before, and post1 / post2 after.
  Norm norm1{nullptr}, norm2{nullptr}, post1{nullptr}, post2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
  Moe moe{nullptr};

 private:
  at::Tensor feed_forward(const at::Tensor& m);

  at::Tensor attend(const at::Tensor& a, const Batch& batch);  // the attn call
  at::Tensor forward_post(const at::Tensor& x, const Batch& batch);  // norm_placement "post" and "sandwich"

  bool fused_;
  NormPlacement placement_;
  std::shared_ptr<HookChain> chain_;
  std::string norm1_name_, attn_name_, norm2_name_, mlp_name_, moe_name_, post1_name_, post2_name_;
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  // Builds the modules and initialises every parameter from `seed` alone
  // (GPT-2 style: N(0, 0.02), residual projections N(0, 0.02/sqrt(2·layers)),
  // biases 0, norm weights 1), so every rank building it gets the same model.
  GptImpl(const GptConfig& config, uint64_t seed);

  at::Tensor forward(const Batch& batch);  // tokens [B, T] int64 -> logits [B, T, vocab]
  // Mean next-token cross-entropy of the batch's targets [B, T] (not times
  // its weight); a chunked loss's gradients made `when` asked (a training
  // step: kIntoWeightGrad, the loss times batch.weight and its backward at once).
  at::Tensor loss(const Batch& batch, LossGradients when = LossGradients::kInForward);
  // Rows that are one sequence each from position 0: Batch(tokens, targets).
  at::Tensor forward(const at::Tensor& tokens) { return forward(Batch(tokens)); }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) { return loss(Batch(tokens, targets)); }
  // forward() is these pieces in order, each through its hooks (pipeline
  // stages run a range of them): tokens -> hidden [B, T, width] (wte, wpe,
  // drop); block i; hidden -> logits (norm_f, head). Not through "".
  at::Tensor embed(const Batch& batch);
  at::Tensor block(int64_t i, const at::Tensor& x, const Batch& batch);
  at::Tensor project(const at::Tensor& x);
  // Mean cross-entropy of logits [B, T, V'] against targets [B, T], in fp32.
  at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);
  // The loss of the last block's output x against targets: norm_f, head and
  // cross_entropy, or, where model.chunked_loss holds for these hooks and
  // tensors, the chunked loss (Note [Chunked loss]) without the logits, its
  // gradients made `when` asked (a pipeline stage holding several losses: in
  // the backward; a training step: kIntoWeightGrad), with
  // `loss_weight` the factor the caller multiplies the loss by (kIntoWeightGrad's).
  at::Tensor head_loss(const at::Tensor& x, const at::Tensor& targets, LossGradients when = LossGradients::kInForward,
                       double loss_weight = 1.0);
  const GptConfig& config() const { return config_; }
  // Hooks around every module call (Note [Forward hooks]); the last added is outermost.
  void add_forward_hooks(std::shared_ptr<ForwardHooks> hooks) { chain_->hooks.push_back(std::move(hooks)); }
  // Block `block`'s MLP, if it has one, makes its GLU's output again in the
  // backward instead of keeping it (selective recompute; Note [The GLU's
  // output made again]).
  void make_glu_output_again(int64_t block, bool on);
  void remove_forward_hooks(const ForwardHooks* hooks);
  // The mixture-of-experts layers, in block order (none in a dense model).
  std::vector<Moe> moe_layers() const;
  // Block i's attention (its spec, its Attention object: Note [Attention object]).
  CausalSelfAttentionImpl& attention(int64_t i);

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Norm norm_f{nullptr};
  torch::nn::Linear head{nullptr};  // only when the head is untied

 private:
  void initialise(uint64_t seed);
  // Whether head_loss may chunk for input `x` (plain tensors, no hook around the head).
  bool chunks_loss(const at::Tensor& x) const;

  GptConfig config_;
  std::shared_ptr<HookChain> chain_ = std::make_shared<HookChain>();
  std::vector<std::string> block_names_;
};
TORCH_MODULE(Gpt);

// Every block's Attention object replaced by make(block) while this object
// lives; the ones it replaced are put back when it goes (Note [Attention object]).
class AttentionSwap {
 public:
  AttentionSwap(GptImpl& model, const std::function<std::shared_ptr<Attention>(int64_t block)>& make);
  ~AttentionSwap();
  AttentionSwap(const AttentionSwap&) = delete;
  AttentionSwap& operator=(const AttentionSwap&) = delete;

 private:
  GptImpl* model_;
  std::vector<std::shared_ptr<Attention>> previous_;
};

}  // namespace meshtrain::model
