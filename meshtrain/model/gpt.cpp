#include "meshtrain/model/gpt.h"

#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/embedding.h"
#include "meshtrain/model/fused/linear.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/qkv_layout.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

namespace meshtrain::model {

namespace {

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// x·Wᵀ + b through ATen's linear, which folds a [B, T, in] input into one addmm
// (under autocast with the bias in bf16 too). libtorch's functional linear,
// which LinearImpl::forward calls, adds the bias in place after the matmul for
// such inputs: an fp32 round trip over the output per call under bf16.
// Distributed tensors keep the module's own forward. `fused`: the weight's
// gradient added into its .grad by the product (Note [Weight gradients in place]).
at::Tensor apply_linear(torch::nn::LinearImpl* layer, const at::Tensor& x, bool fused, bool glu_made_again = false) {
  if (!fused::plain(x)) return layer->forward(x);
  return fused ? fused::linear(x, layer->weight, layer->bias, glu_made_again) : at::linear(x, layer->weight, layer->bias);
}

// x's first 2 * half dims rotated by the angles whose cos and sin are c, s
// (broadcast over x); the rest, under partial rotary, as they are.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  const int64_t half = c.size(-1), d = x.size(-1);
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  if (2 * half == d) return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
  return at::cat({x1 * c - x2 * s, x1 * s + x2 * c, x.narrow(-1, 2 * half, d - 2 * half)}, -1);
}

}  // namespace

at::Tensor apply_rope_at(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  const int64_t b = x.size(0), t = x.size(2), half = cos.size(-1);
  const at::Tensor index = positions.to(cos.device()).reshape({-1});
  return rotate(x, cos.index_select(0, index).view({b, 1, t, half}).to(x.scalar_type()),
                sin.index_select(0, index).view({b, 1, t, half}).to(x.scalar_type()));
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset) {
  const int64_t t = x.size(-2);
  // Tables in the activations' dtype (bfloat16 parameters give bfloat16 activations).
  return rotate(x, cos.narrow(0, offset, t).to(x.scalar_type()), sin.narrow(0, offset, t).to(x.scalar_type()));
}

QkvHeads split_qkv(const at::Tensor& qkv_out, const GptConfig& config) {
  const auto [q, k, v] = split_qkv_heads(qkv_out, 2, config);  // [B, T, H, hd] each
  return {q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)};
}

NormImpl::NormImpl(NormStyle kind, int64_t width, bool bias, double eps, bool fused, bool plus_one)
    : rms_(kind == NormStyle::kRmsNorm), fused_(fused), plus_one_(plus_one), eps_(eps) {
  weight_ = register_parameter("weight", plus_one ? torch::zeros({width}) : torch::ones({width}));
  if (!rms_ && bias) bias_ = register_parameter("bias", torch::zeros({width}));
}

at::Tensor NormImpl::forward(const at::Tensor& x) {
  const at::Tensor scale = plus_one_ ? weight_ + 1 : weight_;
  if (fused_ && fused::eligible_anywhere(x) && fused::eligible_anywhere(weight_)) return fused::add_norm(x, {}, scale, bias_, rms_, eps_).second;
  if (rms_ && x.is_cuda()) {
    // ATen's rms_norm is one kernel each way on a GPU where input and weight
    // share a dtype (else a composition, with a warning): the composition's
    // result type, fp32 under autocast as the composition below gives it.
    const at::ScalarType type = at::promote_types(x.scalar_type(), scale.scalar_type());
    return at::rms_norm(x.to(type), {x.size(-1)}, scale.to(type), eps_);
  }
  if (rms_) return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * scale;
  return at::layer_norm(x, {x.size(-1)}, scale, bias_, eps_);
}

std::pair<at::Tensor, at::Tensor> NormImpl::forward_add(const at::Tensor& x, const at::Tensor& residual) {
  if (fused_ && fused::eligible_anywhere(x) && fused::eligible_anywhere(residual) && fused::eligible_anywhere(weight_)) {
    return fused::add_norm(x, residual, plus_one_ ? weight_ + 1 : weight_, bias_, rms_, eps_);
  }
  const at::Tensor h = x + residual;
  return {h, forward(h)};
}

at::Tensor HookChain::call(const std::string& module, const at::Tensor& input, ForwardHooks::Forward forward) const {
  // hooks[i] wraps hooks[0..i-1], which wrap the module's own forward. Each
  // level owns what it calls, so a hook may keep `forward` past the call.
  for (const std::shared_ptr<ForwardHooks>& hook : hooks) {
    forward = [hook, module, inner = std::move(forward)](const at::Tensor& x) { return hook->around(module, x, inner); };
  }
  return forward(input);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& config, std::shared_ptr<HookChain> chain,
                                                 const std::string& name, int64_t block)
    : config_(config),
      head_dim_(config.head_dim()),
      dropout_(config.dropout),
      rope_(config.position == PositionStyle::kRope),
      fused_(config.fused),
      spec_(attention_spec(config, block)),
      attention_(std::make_shared<LocalAttention>(config.fused)),
      chain_(std::move(chain)),
      qkv_name_(name + ".qkv"),
      core_name_(name + ".core"),
      proj_name_(name + ".proj"),
      drop_name_(name + ".drop") {
  qkv = register_module("qkv", linear(config.width, config.qkv_width(), config.qkv_has_bias()));
  proj = register_module("proj", linear(config.q_width(), config.width, config.proj_has_bias()));
  if (config.qk_norm != QkNorm::kNone) {
    const bool per_head = config.qk_norm == QkNorm::kHead;
    const int64_t q_size = per_head ? head_dim_ : config.q_width(), k_size = per_head ? head_dim_ : config.kv_width();
    q_norm = register_module("q_norm", Norm(NormStyle::kRmsNorm, q_size, false, config.norm_eps, config.fused, config.norm_plus_one));
    k_norm = register_module("k_norm", Norm(NormStyle::kRmsNorm, k_size, false, config.norm_eps, config.fused, config.norm_plus_one));
  }
  if (rope_) {
    RopeTables tables = rope_tables(config);
    cos_ = register_buffer("rope_cos", tables.cos);
    sin_ = register_buffer("rope_sin", tables.sin);
  }
}

std::pair<at::Tensor, at::Tensor> CausalSelfAttentionImpl::normalize_qk(const at::Tensor& q, const at::Tensor& k) const {
  if (!q_norm) return {q, k};
  auto normalize = [&](const Norm& norm, const at::Tensor& x) {
    if (config_.qk_norm == QkNorm::kHead) return norm.ptr()->forward(x);  // [B, H, T, hd] over hd
    // Over every head of a position at once (OLMo 2), in the heads' order.
    const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
    return norm.ptr()->forward(x.transpose(1, 2).reshape({b, t, h * d})).view({b, t, h, d}).transpose(1, 2);
  };
  return {normalize(q_norm, q), normalize(k_norm, k)};
}

QkvHeads CausalSelfAttentionImpl::heads(const at::Tensor& qkv_out, const Batch& batch) const {
  const bool whole = rope_ && 2 * cos_.size(1) == head_dim_;  // the fused kernel rotates whole heads
  if (fused_ && whole && !q_norm && !batch.positions.defined() && fused::eligible(qkv_out) && qkv_out.dim() == 3 &&
      qkv_out.is_contiguous()) {
    // Note [Heads from the fused projection]
    const auto [q, k, v] = fused::rotated_heads(qkv_out, qkv_head_offsets(qkv_out.size(2), config_), head_dim_, cos_, sin_);
    return {q, k, v};
  }
  auto [q, k, v] = split_qkv(qkv_out, config_);
  const bool fused = fused_ && fused::eligible(q);
  const at::Tensor& positions = batch.positions;  // Note [Batch]
  std::tie(q, k) = normalize_qk(q, k);
  if (rope_ && positions.defined()) {
    q = apply_rope_at(q, cos_, sin_, positions);
    k = apply_rope_at(k, cos_, sin_, positions);
  } else if (rope_) {
    q = fused && whole ? fused::rope(q, cos_, sin_) : apply_rope(q, cos_, sin_);
    k = fused && whole ? fused::rope(k, cos_, sin_) : apply_rope(k, cos_, sin_);
  }
  return {q, k, v};
}

std::shared_ptr<Attention> CausalSelfAttentionImpl::set_attention(std::shared_ptr<Attention> attention) {
  TORCH_CHECK(attention, "a block's attention object must be set");
  std::swap(attention_, attention);
  return attention;
}

at::Tensor CausalSelfAttentionImpl::attend(const at::Tensor& qkv_out, const Batch& batch) {
  const int64_t b = qkv_out.size(0), t = qkv_out.size(1);
  const QkvHeads h = heads(qkv_out, batch);
  return attention_->forward(h, spec_, batch, is_training()).transpose(1, 2).reshape({b, t, -1});
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x, const Batch& batch) {
  const HookChain& c = *chain_;
  const at::Tensor qkv_out = c.call(qkv_name_, x, [this](const at::Tensor& in) { return apply_linear(qkv.get(), in, fused_); });
  const at::Tensor y = c.call(core_name_, qkv_out, [this, batch](const at::Tensor& in) { return attend(in, batch); });
  const at::Tensor out = c.call(proj_name_, y, [this](const at::Tensor& in) { return apply_linear(proj.get(), in, fused_); });
  return c.call(drop_name_, out, [this](const at::Tensor& in) { return at::dropout(in, dropout_, is_training()); });
}

MlpImpl::MlpImpl(const GptConfig& config, std::shared_ptr<HookChain> chain, const std::string& name)
    : dropout_(config.dropout),
      fused_(config.fused),
      gelu_gate_(config.mlp == MlpStyle::kGeglu),
      chain_(std::move(chain)),
      fc_name_(name + ".fc"),
      proj_name_(name + ".proj"),
      gate_name_(name + ".gate"),
      up_name_(name + ".up"),
      down_name_(name + ".down"),
      drop_name_(name + ".drop") {
  const int64_t d = config.width, h = config.mlp_hidden();
  const bool bias = config.mlp_has_bias();
  if (config.mlp == MlpStyle::kGelu) {
    fc = register_module("fc", linear(d, h, bias));
    proj = register_module("proj", linear(h, d, bias));
  } else {
    gate = register_module("gate", linear(d, h, bias));
    up = register_module("up", linear(d, h, bias));
    down = register_module("down", linear(h, d, bias));
  }
}

at::Tensor MlpImpl::activation(const at::Tensor& x) {
  const HookChain& c = *chain_;
  auto call = [&](const std::string& name, const torch::nn::Linear& layer, const at::Tensor& in) {
    return c.call(name, in, [impl = layer.ptr(), this](const at::Tensor& y) { return apply_linear(impl.get(), y, fused_); });
  };
  if (fc && fused_ && fused::plain(x)) {
    // The bias is added with the GELU (tensor parallel's plan knows: bias_in_model).
    const at::Tensor a = c.call(fc_name_, x, [impl = fc.ptr()](const at::Tensor& y) { return fused::linear(y, impl->weight, {}); });
    const at::Tensor& bias = fc->bias;
    if (fused::eligible_anywhere(a) && (!bias.defined() || fused::eligible_anywhere(bias))) return fused::bias_gelu(a, bias);
    return at::gelu(bias.defined() ? a + bias : a, "tanh");
  }
  if (fc) return at::gelu(call(fc_name_, fc, x), "tanh");
  const at::Tensor g = call(gate_name_, gate, x), u = call(up_name_, up, x);
  if (fused_ && fused::eligible_anywhere(g) && fused::eligible_anywhere(u)) return gelu_gate_ ? fused::geglu(g, u) : fused::swiglu(g, u);
  if (gelu_gate_) return at::gelu(g, "tanh") * u;  // GeGLU (Gemma)
  return at::silu(g) * u;
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  const HookChain& c = *chain_;
  const at::Tensor hidden = activation(x);
  const torch::nn::Linear& out_layer = fc ? proj : down;
  const at::Tensor out = c.call(fc ? proj_name_ : down_name_, hidden, [impl = out_layer.ptr(), this](const at::Tensor& y) {
    return apply_linear(impl.get(), y, fused_, glu_made_again_);
  });
  return c.call(drop_name_, out, [this](const at::Tensor& in) { return at::dropout(in, dropout_, is_training()); });
}

BlockImpl::BlockImpl(const GptConfig& config, std::shared_ptr<HookChain> chain, const std::string& name, bool experts,
                     int64_t index)
    : fused_(config.fused),
      placement_(config.norm_placement),
      chain_(std::move(chain)),
      norm1_name_(name + ".norm1"),
      attn_name_(name + ".attn"),
      norm2_name_(name + ".norm2"),
      mlp_name_(name + ".mlp"),
      moe_name_(name + ".moe"),
      post1_name_(name + ".post1"),
      post2_name_(name + ".post2") {
  auto norm = [&] { return Norm(config.norm, config.width, config.bias, config.norm_eps, config.fused, config.norm_plus_one); };
  norm1 = register_module("norm1", norm());
  attn = register_module("attn", CausalSelfAttention(config, chain_, attn_name_, index));
  norm2 = register_module("norm2", norm());
  if (placement_ == NormPlacement::kSandwich) {
    post1 = register_module("post1", norm());
    post2 = register_module("post2", norm());
  }
  if (experts) {
    moe = register_module("moe", Moe(config));
  } else {
    mlp = register_module("mlp", Mlp(config, chain_, mlp_name_));
  }
}

at::Tensor BlockImpl::feed_forward(const at::Tensor& m) {
  const HookChain& c = *chain_;
  if (moe) return c.call(moe_name_, m, [this](const at::Tensor& in) { return moe->forward(in); });
  return c.call(mlp_name_, m, [this](const at::Tensor& in) { return mlp->forward(in); });
}

// Note [Norm placement]
// "pre" (GPT-2, Llama): h = x + attn(norm1(x)), y = h + ff(norm2(h)).
// "post" (OLMo 2): h = x + norm1(attn(x)), y = h + norm2(ff(h)): the norm
// of each sublayer's output, inside the residual branch.
// "sandwich" (Gemma 2): h = x + post1(attn(norm1(x))), y = h + post2(ff(norm2(h))).
at::Tensor BlockImpl::attend(const at::Tensor& a, const Batch& batch) {
  return chain_->call(attn_name_, a, [this, batch](const at::Tensor& in) { return attn->forward(in, batch); });
}

at::Tensor BlockImpl::forward_post(const at::Tensor& x, const Batch& batch) {
  const HookChain& c = *chain_;
  const bool sandwich = placement_ == NormPlacement::kSandwich;
  auto through = [&](const std::string& name, Norm& norm, const at::Tensor& in) {
    return c.call(name, in, [&norm](const at::Tensor& y) { return norm->forward(y); });
  };
  const at::Tensor a = sandwich ? through(norm1_name_, norm1, x) : x;
  const at::Tensor attended = attend(a, batch);
  const at::Tensor h = x + (sandwich ? through(post1_name_, post1, attended) : through(norm1_name_, norm1, attended));
  const at::Tensor m = sandwich ? through(norm2_name_, norm2, h) : h;
  const at::Tensor fed = feed_forward(m);
  return h + (sandwich ? through(post2_name_, post2, fed) : through(norm2_name_, norm2, fed));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const Batch& batch) {
  if (placement_ != NormPlacement::kPre) return forward_post(x, batch);
  const HookChain& c = *chain_;
  const at::Tensor a = c.call(norm1_name_, x, [this](const at::Tensor& in) { return norm1->forward(in); });
  const at::Tensor attended = attend(a, batch);
  if (!fused_) {
    const at::Tensor h = x + attended;
    return h + feed_forward(c.call(norm2_name_, h, [this](const at::Tensor& in) { return norm2->forward(in); }));
  }
  // The residual add and norm2 in one pass (Note [Forward hooks]).
  at::Tensor h;
  const at::Tensor m = c.call(norm2_name_, attended, [this, x, &h](const at::Tensor& in) {
    auto [sum, normed] = norm2->forward_add(x, in);
    h = sum;
    return normed;
  });
  TORCH_CHECK(h.defined(), "a hook around ", norm2_name_, " did not call the norm");
  return h + feed_forward(m);
}

GptImpl::GptImpl(const GptConfig& config, uint64_t seed) : config_(config) {
  config_.validate();
  wte = register_module("wte", torch::nn::Embedding(config_.vocab_size, config_.width));
  if (config_.position == PositionStyle::kLearned) wpe = register_module("wpe", torch::nn::Embedding(config_.context, config_.width));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.layers; ++i) {
    block_names_.push_back("blocks." + std::to_string(i));
    blocks->push_back(Block(config_, chain_, block_names_.back(), config_.is_moe_block(i), i));
  }
  norm_f = register_module(
      "norm_f", Norm(config_.norm, config_.width, config_.bias, config_.norm_eps, config_.fused, config_.norm_plus_one));
  if (!config_.tie_embeddings) head = register_module("head", linear(config_.width, config_.vocab_size, false));
  initialise(seed);
}

std::vector<Moe> GptImpl::moe_layers() const {
  std::vector<Moe> out;
  for (int64_t i = 0; i < config_.layers; ++i) {
    const Moe& moe = blocks->ptr(i)->as<BlockImpl>()->moe;
    if (moe) out.push_back(moe);
  }
  return out;
}

CausalSelfAttentionImpl& GptImpl::attention(int64_t i) { return *blocks->ptr(i)->as<BlockImpl>()->attn; }

AttentionSwap::AttentionSwap(GptImpl& model, const std::function<std::shared_ptr<Attention>(int64_t block)>& make)
    : model_(&model) {
  for (int64_t i = 0; i < model.config().layers; ++i) previous_.push_back(model.attention(i).set_attention(make(i)));
}

AttentionSwap::~AttentionSwap() {
  for (size_t i = 0; i < previous_.size(); ++i) model_->attention(static_cast<int64_t>(i)).set_attention(previous_[i]);
}

void GptImpl::remove_forward_hooks(const ForwardHooks* hooks) {
  auto& list = chain_->hooks;
  list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& h) { return h.get() == hooks; }), list.end());
}

void GptImpl::initialise(uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = config_.init_std / std::sqrt(2.0 * config_.layers);
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool is_norm = name.find("norm") != std::string::npos || name.find(".post1.") != std::string::npos ||
                         name.find(".post2.") != std::string::npos;
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (is_norm) {
      p.fill_(is_bias || config_.norm_plus_one ? 0.0 : 1.0);  // (1 + w) norms start at w = 0
    } else if (is_bias) {
      p.zero_();
    } else {
      const bool residual = name.find("attn.proj.") != std::string::npos ||
                            name.find("mlp.proj.") != std::string::npos || name.find("mlp.down.") != std::string::npos ||
                            name.find("moe.proj_weight") != std::string::npos ||
                            name.find("moe.down_weight") != std::string::npos;
      // Drawn on the CPU in parameter order, then copied: same values on any device.
      at::Tensor values = at::empty(p.sizes(), at::kFloat);
      values.normal_(0.0, residual ? residual_std : config_.init_std, generator);
      p.copy_(values);
    }
  }
}

void GptImpl::make_glu_output_again(int64_t block, bool on) {
  BlockImpl* b = blocks->ptr(block)->as<BlockImpl>();
  if (b->mlp) b->mlp->make_glu_output_again(on);
}

at::Tensor GptImpl::embed(const Batch& batch) {
  const at::Tensor& tokens = batch.tokens;
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= config_.context, "sequence of ", t, " tokens is longer than the model's context ", config_.context);
  const HookChain& c = *chain_;
  // The lookups add their rows' gradients into a held .grad (Note [Embedding gradients in place]).
  auto lookup = [this](torch::nn::Embedding table, const at::Tensor& ids) {
    return config_.fused ? fused::embedding(table->weight, ids) : table->forward(ids);
  };
  at::Tensor x = c.call("wte", tokens, [this, lookup](const at::Tensor& in) { return lookup(wte, in); });
  // Gemma: times sqrt(width), rounded to the activations' dtype as Hugging Face does.
  if (config_.embed_scale) x = x * at::scalar_tensor(std::sqrt(static_cast<double>(config_.width)), x.options());
  if (wpe) {
    // Packed rows restart positions at each document, a KV cache's continue (Note [Batch]).
    const at::Tensor positions = batch.positions.defined() ? batch.positions.to(tokens.device())
                                                           : at::arange(t, tokens.options());
    x = x + c.call("wpe", positions, [this, lookup](const at::Tensor& in) { return lookup(wpe, in); });
  }
  return c.call("drop", x, [this](const at::Tensor& in) { return at::dropout(in, config_.dropout, is_training()); });
}

at::Tensor GptImpl::block(int64_t i, const at::Tensor& x, const Batch& batch) {
  BlockImpl* block = blocks->ptr(i)->as<BlockImpl>();
  return chain_->call(block_names_[i], x, [block, batch](const at::Tensor& in) { return block->forward(in, batch); });
}

at::Tensor GptImpl::project(const at::Tensor& x) {
  const HookChain& c = *chain_;
  const at::Tensor y = c.call("norm_f", x, [this](const at::Tensor& in) { return norm_f->forward(in); });
  const at::Tensor logits =
      c.call("head", y, [this](const at::Tensor& in) { return head ? head->forward(in) : tied_head_logits(in, wte->weight); });
  return soft_cap(logits, config_.logit_softcap);  // Gemma 2
}

namespace {

// The whole model's call ("") on `batch`: embed, the blocks, then the logits,
// or with `loss` the loss of head_loss, its gradients made `when` (forward()
// and loss() share it).
ForwardHooks::Forward whole_model(GptImpl* model, Batch batch, bool loss,
                                  LossGradients when = LossGradients::kInForward) {
  return [model, batch = std::move(batch), loss, when](const at::Tensor& input) {
    Batch b = batch;
    b.tokens = input;  // as a hook around the whole model passed it on
    at::Tensor x = model->embed(b);
    for (int64_t i = 0; i < model->config().layers; ++i) x = model->block(i, x, b);
    return loss ? model->head_loss(x, b.targets, when, b.weight) : model->project(x);
  };
}

}  // namespace

at::Tensor GptImpl::forward(const Batch& batch) { return chain_->call("", batch.tokens, whole_model(this, batch, false)); }

at::Tensor GptImpl::cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)}), flat_targets = targets.reshape({-1});
  const double z_loss = torch::GradMode::is_enabled() ? config_.z_loss : 0.0;  // a training term (Note [Chunked loss])
  for (const auto& hooks : chain_->hooks) {
    at::Tensor loss = hooks->cross_entropy(flat, flat_targets, z_loss);
    if (loss.defined()) return loss;
  }
  const bool distributed =  // annotations' logits (PrivateUse1): train/config.cpp refuses their z-loss
      flat.key_set().has(c10::DispatchKey::PrivateUse1) || flat_targets.key_set().has(c10::DispatchKey::PrivateUse1);
  TORCH_CHECK(z_loss == 0 || !distributed, "model.z_loss is not ruled for logits sharded by annotations");
  // In fp32 whatever the logits' dtype: the log-softmax over the vocabulary
  // needs the range. The fused kernel reads bf16 logits into fp32 row by row.
  if (config_.fused && fused::eligible(flat) && z_loss == 0) return fused::cross_entropy(flat, flat_targets, kIgnoredTarget);
  // Ignored targets count toward no loss; with none counting the loss is 0 (ATen's mean would be 0 / 0).
  // Annotations' distributed logits are divided by a number, which their rules cover;
  // plain ones by a tensor (no wait for the device).
  if (distributed) {
    const at::Tensor summed =
        at::cross_entropy_loss(flat.to(at::kFloat), flat_targets, {}, at::Reduction::Sum, kIgnoredTarget);
    return summed / std::max(1.0, (flat_targets != kIgnoredTarget).sum().item<double>());
  }
  if (z_loss > 0) return whole_logits_cross_entropy(flat, flat_targets, z_loss);
  const at::Tensor summed =
      at::cross_entropy_loss(flat.to(at::kFloat), flat_targets, {}, at::Reduction::Sum, kIgnoredTarget);
  return summed / (flat_targets != kIgnoredTarget).sum().clamp_min(1);
}

bool GptImpl::chunks_loss(const at::Tensor& x) const {
  if (!config_.chunked_loss || !fused::plain(x)) return false;
  return std::none_of(chain_->hooks.begin(), chain_->hooks.end(),
                      [](const auto& h) { return h->wraps_head() && !h->chunks_head(); });
}

at::Tensor GptImpl::head_loss(const at::Tensor& x, const at::Tensor& targets, LossGradients when, double loss_weight) {
  if (!chunks_loss(x)) return cross_entropy(project(x), targets);
  const at::Tensor y = chain_->call("norm_f", x, [this](const at::Tensor& in) { return norm_f->forward(in); });
  const at::Tensor& w = head ? head->weight : wte->weight;
  const double z_loss = torch::GradMode::is_enabled() ? config_.z_loss : 0.0;  // a training term (Note [Chunked loss])
  for (const auto& hooks : chain_->hooks) {
    if (!hooks->wraps_head()) continue;
    at::Tensor loss = hooks->head_loss(y, w, targets, config_.logit_softcap, when, loss_weight, z_loss);
    if (loss.defined()) return loss;
  }
  return chunked_cross_entropy(y, w, targets, config_.logit_softcap, 0, {}, when, 0, config_.fused, loss_weight, z_loss);
}

at::Tensor GptImpl::loss(const Batch& batch, LossGradients when) {
  TORCH_CHECK(batch.targets.defined(), "a loss needs the batch's targets");
  // Through "" as forward() goes, so that hooks around the whole model (ZeRO-3's root unit) see the
  // loss's computation; it returns the loss itself where the loss is chunked, else the logits.
  const bool chunked = chunks_loss(batch.tokens);
  const at::Tensor out = chain_->call("", batch.tokens, whole_model(this, batch, chunked, when));
  return chunked ? out : cross_entropy(out, batch.targets);
}

}  // namespace meshtrain::model
