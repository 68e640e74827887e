// A GPT-family decoder as a torch::nn::Module. It knows nothing about
// parallelism: the parallel layer re-shards its modules by name
// (blocks.N.attn.qkv, blocks.N.attn.proj, blocks.N.mlp.fc/proj or gate/up/down,
// wte, wpe, head).
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <torch/torch.h>

namespace meshtrain::model {

// LayerNorm (weight, optional bias) or RMSNorm (weight), over the last dim.
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(const std::string& kind, int64_t width, bool bias);
  at::Tensor forward(const at::Tensor& x);

 private:
  bool rms_;
  at::Tensor weight_, bias_;
};
TORCH_MODULE(Norm);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);  // [B, T, width] -> [B, T, width]

  torch::nn::Linear qkv{nullptr}, proj{nullptr};

 private:
  int64_t heads_;
  double dropout_;
  bool rope_;
  at::Tensor cos_, sin_;  // rope tables [context, head_dim / 2]
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear fc{nullptr}, proj{nullptr};             // gelu
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};  // swiglu
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);

  Norm norm1{nullptr}, norm2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(Block);

// Called around the model's forward (module "") and each block's
// ("blocks.N"), in execution order; a hook may return a different tensor (one
// with a backward hook attached, say). The parallel layer uses them: fully
// sharded units gather their parameters before and free them after.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  virtual at::Tensor before(const std::string& module, const at::Tensor& input) = 0;
  virtual at::Tensor after(const std::string& module, const at::Tensor& output) = 0;
};

class GptImpl : public torch::nn::Module {
 public:
  // Builds the modules and initialises every parameter from `seed` alone
  // (GPT-2 style: N(0, 0.02), residual projections N(0, 0.02/sqrt(2·layers)),
  // biases 0, norm weights 1), so every rank building it gets the same model.
  GptImpl(const GptConfig& config, uint64_t seed);

  at::Tensor forward(const at::Tensor& tokens);  // [B, T] int64 -> logits [B, T, vocab]
  // Mean next-token cross-entropy of `targets` [B, T].
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);
  const GptConfig& config() const { return config_; }
  // Hooks around forward passes (nullptr: none).
  void set_forward_hooks(std::shared_ptr<ForwardHooks> hooks) { hooks_ = std::move(hooks); }

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Norm norm_f{nullptr};
  torch::nn::Linear head{nullptr};  // only when the head is untied

 private:
  void initialise(uint64_t seed);

  GptConfig config_;
  std::shared_ptr<ForwardHooks> hooks_;
};
TORCH_MODULE(Gpt);

}  // namespace meshtrain::model
