#include "meshtrain/model/gpt.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace meshtrain::model {

namespace {

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// Rotates pairs (x[i], x[i + d/2]) of the last dim by position-dependent angles.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const int64_t t = x.size(-2);
  // Tables in the activations' dtype (bfloat16 parameters give bfloat16 activations).
  const at::Tensor c = cos.narrow(0, 0, t).to(x.scalar_type()), s = sin.narrow(0, 0, t).to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
}

}  // namespace

NormImpl::NormImpl(const std::string& kind, int64_t width, bool bias) : rms_(kind == "rmsnorm") {
  weight_ = register_parameter("weight", torch::ones({width}));
  if (!rms_ && bias) bias_ = register_parameter("bias", torch::zeros({width}));
}

at::Tensor NormImpl::forward(const at::Tensor& x) {
  if (rms_) return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * weight_;
  return at::layer_norm(x, {x.size(-1)}, weight_, bias_, 1e-5);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& config)
    : heads_(config.heads), dropout_(config.dropout), rope_(config.position == "rope") {
  qkv = register_module("qkv", linear(config.width, 3 * config.width, config.bias));
  proj = register_module("proj", linear(config.width, config.width, config.bias));
  if (rope_) {
    const int64_t half = config.head_dim() / 2;
    const at::Tensor inv_freq = at::pow(10000.0, -at::arange(half, at::kDouble) / half);
    const at::Tensor angles = at::outer(at::arange(config.context, at::kDouble), inv_freq).to(at::kFloat);
    cos_ = register_buffer("rope_cos", angles.cos());
    sin_ = register_buffer("rope_sin", angles.sin());
  }
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  std::vector<at::Tensor> parts = qkv->forward(x).split(d, -1);
  auto heads = [&](const at::Tensor& y) { return y.view({b, t, heads_, d / heads_}).transpose(1, 2); };
  at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  if (rope_) {
    q = apply_rope(q, cos_, sin_);
    k = apply_rope(k, cos_, sin_);
  }
  const double p = is_training() ? dropout_ : 0.0;
  at::Tensor y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
  y = y.transpose(1, 2).reshape({b, t, d});
  return at::dropout(proj->forward(y), p, is_training());
}

MlpImpl::MlpImpl(const GptConfig& config) {
  const int64_t d = config.width, h = config.mlp_hidden();
  if (config.mlp == "gelu") {
    fc = register_module("fc", linear(d, h, config.bias));
    proj = register_module("proj", linear(h, d, config.bias));
  } else {
    gate = register_module("gate", linear(d, h, config.bias));
    up = register_module("up", linear(d, h, config.bias));
    down = register_module("down", linear(h, d, config.bias));
  }
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  if (fc) return proj->forward(at::gelu(fc->forward(x), "tanh"));
  return down->forward(at::silu(gate->forward(x)) * up->forward(x));
}

BlockImpl::BlockImpl(const GptConfig& config) : dropout_(config.dropout) {
  norm1 = register_module("norm1", Norm(config.norm, config.width, config.bias));
  attn = register_module("attn", CausalSelfAttention(config));
  norm2 = register_module("norm2", Norm(config.norm, config.width, config.bias));
  mlp = register_module("mlp", Mlp(config));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn->forward(norm1->forward(x));
  return h + at::dropout(mlp->forward(norm2->forward(h)), dropout_, is_training());
}

GptImpl::GptImpl(const GptConfig& config, uint64_t seed) : config_(config) {
  config_.validate();
  wte = register_module("wte", torch::nn::Embedding(config_.vocab_size, config_.width));
  if (config_.position == "learned") wpe = register_module("wpe", torch::nn::Embedding(config_.context, config_.width));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.layers; ++i) blocks->push_back(Block(config_));
  norm_f = register_module("norm_f", Norm(config_.norm, config_.width, config_.bias));
  if (!config_.tie_embeddings) head = register_module("head", linear(config_.width, config_.vocab_size, false));
  initialise(seed);
}

void GptImpl::initialise(uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.layers);
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool is_norm = name.find("norm") != std::string::npos;
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (is_norm) {
      p.fill_(is_bias ? 0.0 : 1.0);
    } else if (is_bias) {
      p.zero_();
    } else {
      const bool residual = name.find("attn.proj.") != std::string::npos ||
                            name.find("mlp.proj.") != std::string::npos || name.find("mlp.down.") != std::string::npos;
      // Drawn on the CPU in parameter order, then copied: same values on any device.
      at::Tensor values = at::empty(p.sizes(), at::kFloat);
      values.normal_(0.0, residual ? residual_std : 0.02, generator);
      p.copy_(values);
    }
  }
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= config_.context, "sequence of ", t, " tokens is longer than the model's context ", config_.context);
  const at::Tensor input = hooks_ ? hooks_->before("", tokens) : tokens;
  at::Tensor x = wte->forward(input);
  if (wpe) x = x + wpe->forward(at::arange(t, tokens.options()));
  x = at::dropout(x, config_.dropout, is_training());
  for (size_t i = 0; i < blocks->size(); ++i) {
    if (!hooks_) {
      x = blocks->ptr(i)->as<Block>()->forward(x);
      continue;
    }
    const std::string name = "blocks." + std::to_string(i);
    x = hooks_->after(name, blocks->ptr(i)->as<Block>()->forward(hooks_->before(name, x)));
  }
  x = norm_f->forward(x);
  const at::Tensor logits = head ? head->forward(x) : at::linear(x, wte->weight);
  return hooks_ ? hooks_->after("", logits) : logits;
}

at::Tensor GptImpl::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  const at::Tensor logits = forward(tokens);
  // In fp32 whatever the parameters' dtype: the log-softmax over the vocabulary needs the range.
  return at::cross_entropy_loss(logits.view({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace meshtrain::model
