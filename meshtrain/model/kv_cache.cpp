#include "meshtrain/model/kv_cache.h"

#include <stdexcept>

namespace meshtrain::model {

KvCache::KvCache(const Gpt& model) : config_(model->config()) {
  auto buffers = model->named_buffers();
  for (int64_t i = 0; i < config_.layers; ++i) {
    const std::string prefix = "blocks." + std::to_string(i) + ".attn.";
    Layer layer;
    if (const at::Tensor* cos = buffers.find(prefix + "rope_cos")) layer.cos = *cos, layer.sin = buffers[prefix + "rope_sin"];
    layers_[prefix + "core"] = layer;
  }
}

void KvCache::clear() {
  for (auto& [name, layer] : layers_) layer.k = layer.v = at::Tensor();
  length_ = 0;
  blocks_done_ = 0;
}

void KvCache::check_room(int64_t t) const {
  if (length_ + t > config_.context) {
    throw std::invalid_argument("kv cache: " + std::to_string(length_ + t) + " tokens exceed the model's context " +
                                std::to_string(config_.context) + "; clear() and start again");
  }
}

at::Tensor KvCache::around(const std::string& module, const at::Tensor& input, const Forward& forward) {
  if (module == "wpe") {  // positions length_, length_ + 1, ...
    check_room(input.size(0));
    return forward(input + length_);
  }
  auto it = layers_.find(module);
  if (it == layers_.end()) return forward(input);
  const at::Tensor out = attend(it->second, input);
  if (++blocks_done_ == config_.layers) {
    length_ = it->second.k.size(2);
    blocks_done_ = 0;
  }
  return out;
}

at::Tensor KvCache::attend(Layer& layer, const at::Tensor& qkv_out) {
  const int64_t b = qkv_out.size(0), t = qkv_out.size(1), w = qkv_out.size(2) / 3;
  const int64_t head_dim = config_.head_dim();
  check_room(t);
  std::vector<at::Tensor> parts = qkv_out.split(w, -1);
  auto heads = [&](const at::Tensor& y) { return y.view({b, t, -1, head_dim}).transpose(1, 2); };
  at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  if (layer.cos.defined()) {
    q = apply_rope(q, layer.cos, layer.sin, length_);
    k = apply_rope(k, layer.cos, layer.sin, length_);
  }
  layer.k = layer.k.defined() ? at::cat({layer.k, k}, 2) : k.contiguous();
  layer.v = layer.v.defined() ? at::cat({layer.v, v}, 2) : v.contiguous();
  at::Tensor y;
  if (length_ == 0) {
    y = at::scaled_dot_product_attention(q, layer.k, layer.v, /*attn_mask=*/{}, 0.0, /*is_causal=*/true);
  } else {
    // New query i (position length_ + i) sees every cached key and the new ones up to itself.
    const int64_t total = length_ + t;
    const at::Tensor rows = at::arange(t, at::kLong).view({t, 1}) + length_, cols = at::arange(total, at::kLong).view({1, total});
    y = at::scaled_dot_product_attention(q, layer.k, layer.v, /*attn_mask=*/cols <= rows, 0.0, /*is_causal=*/false);
  }
  return y.transpose(1, 2).reshape({b, t, w});
}

}  // namespace meshtrain::model
