#include "meshtrain/model/kv_cache.h"

#include <algorithm>
#include <stdexcept>

namespace meshtrain::model {

// Block `block`'s attention object: the cache's layer of that block.
class KvCache::LayerAttention final : public Attention {
 public:
  LayerAttention(KvCache* cache, int64_t block) : cache_(cache), block_(block) {}
  at::Tensor forward(const QkvHeads& heads, const AttentionSpec& spec, const Batch& batch, bool training) override {
    (void)batch;  // its positions placed the heads; the cache knows its slots
    (void)training;
    return cache_->attend(block_, heads, spec);
  }

 private:
  KvCache* cache_;
  int64_t block_;
};

KvCache::KvCache(const Gpt& model) : config_(model->config()) {
  for (int64_t i = 0; i < config_.layers; ++i) {
    Layer layer;
    layer.window = config_.window_of(i);
    layers_.push_back(layer);
  }
}

std::unique_ptr<AttentionSwap> KvCache::attach(GptImpl& model) {
  return std::make_unique<AttentionSwap>(model,
                                         [this](int64_t block) { return std::make_shared<LayerAttention>(this, block); });
}

Batch KvCache::next(const at::Tensor& tokens) const {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  check_room(t);
  Batch batch(tokens);
  // Slots length_ .. length_ + t − 1, counted per row from its first real token.
  batch.positions = pads_.defined() ? positions(t) : (at::arange(t, at::kLong) + length_).view({1, t}).expand({b, t});
  return batch;
}

void KvCache::clear() {
  for (Layer& layer : layers_) layer.set({}, {}), layer.dropped = 0;
  pads_ = at::Tensor();
  length_ = 0;
  blocks_done_ = 0;
}

void KvCache::check_not_rolled() const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].dropped > 0) {
      throw std::logic_error("kv cache: block " + std::to_string(i) +
                             " rolled its window; its rows cannot be rearranged");
    }
  }
}

void KvCache::roll(Layer& layer) {
  // Compacted once twice the window is held, so the copy is amortised over
  // `keep` tokens; the attention mask hides the older keys meanwhile.
  const int64_t keep = layer.window - 1, have = layer.k.size(2);
  if (have <= std::max<int64_t>(2 * keep, 1)) return;
  auto shift = [&](at::Tensor& cached, at::Tensor& room) {
    const at::Tensor tail = cached.narrow(2, have - keep, keep).clone();
    if (!room.defined()) room = at::empty_like(cached);
    room.narrow(2, 0, keep).copy_(tail);
    cached = room.narrow(2, 0, keep);
  };
  shift(layer.k, layer.k_room);
  shift(layer.v, layer.v_room);
  layer.dropped += have - keep;
}

void KvCache::set_padding(const std::vector<int64_t>& pads) {
  if (rolling_) throw std::logic_error("kv cache: a rolling cache holds one unpadded sequence");
  if (length_ != 0) throw std::logic_error("kv cache: set_padding after tokens were cached; clear() first");
  pads_ = at::tensor(pads, at::kLong);
}

int64_t KvCache::rows() const {
  const Layer& first = layers_.front();
  return first.k.defined() ? first.k.size(0) : 0;
}

at::Tensor KvCache::pads_or_zeros() const { return pads_.defined() ? pads_ : at::zeros({rows()}, at::kLong); }

void KvCache::pad_left(int64_t slots) {
  if (slots == 0) return;
  for (Layer& layer : layers_) {
    auto padded = [&](const at::Tensor& x) {
      std::vector<int64_t> shape = x.sizes().vec();
      shape[2] = slots;
      return at::cat({at::zeros(shape, x.options()), x}, 2);
    };
    layer.set(padded(layer.k), padded(layer.v));
  }
  pads_ = pads_or_zeros() + slots;
  length_ += slots;
}

void KvCache::append_rows(const KvCache& other) {
  check_not_rolled();
  other.check_not_rolled();
  if (blocks_done_ != 0 || other.blocks_done_ != 0) throw std::logic_error("kv cache: append_rows inside a forward");
  if (other.rows() == 0) return;
  if (rows() == 0) {
    for (size_t i = 0; i < layers_.size(); ++i) layers_[i].set(other.layers_[i].k, other.layers_[i].v);
    pads_ = other.pads_or_zeros();
    length_ = other.length_;
    return;
  }
  KvCache joining = other;
  if (joining.length_ < length_) joining.pad_left(length_ - joining.length_);
  if (length_ < joining.length_) pad_left(joining.length_ - length_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& layer = layers_[i];
    const Layer& theirs = joining.layers_[i];
    layer.set(at::cat({layer.k, theirs.k}, 0), at::cat({layer.v, theirs.v}, 0));
  }
  pads_ = at::cat({pads_or_zeros(), joining.pads_or_zeros()});
}

void KvCache::keep_rows(const std::vector<int64_t>& rows) {
  check_not_rolled();
  if (blocks_done_ != 0) throw std::logic_error("kv cache: keep_rows inside a forward");
  if (rows.empty()) return clear();
  const at::Tensor index = at::tensor(rows, at::kLong);
  pads_ = pads_or_zeros().index_select(0, index);
  const int64_t unused = pads_.min().item<int64_t>();  // slots before every row's first token
  for (Layer& layer : layers_) {
    layer.set(layer.k.index_select(0, index).narrow(2, unused, length_ - unused),
              layer.v.index_select(0, index).narrow(2, unused, length_ - unused));
  }
  pads_ = pads_ - unused;
  length_ -= unused;
}

namespace {

// Of t new queries (slots length .. length + t - 1) over every slot so far:
// [B, 1, t, length + t], false on each row's padding, except that a padding
// query sees itself (its softmax needs a key).
at::Tensor padding_allowed(const at::Tensor& pads, int64_t length, int64_t t) {
  const int64_t total = length + t;
  const at::Tensor rows = at::arange(t, at::kLong).view({1, t, 1}) + length;
  const at::Tensor cols = at::arange(total, at::kLong).view({1, 1, total});
  return (cols >= pads.view({-1, 1, 1})).logical_or(cols == rows).unsqueeze(1);
}

}  // namespace

at::Tensor KvCache::positions(int64_t t) const {  // [B, t]: cache slots length_ .. length_ + t - 1, per row
  return (at::arange(t, at::kLong).view({1, t}) + length_ - pads_.view({-1, 1})).clamp_min(0);
}

void KvCache::check_room(int64_t t) const {
  if (length_ + t > config_.context) {
    throw std::invalid_argument("kv cache: " + std::to_string(length_ + t) + " tokens exceed the model's context " +
                                std::to_string(config_.context) + "; clear() and start again");
  }
}

void KvCache::append(at::Tensor& cached, at::Tensor& room, const at::Tensor& fresh) const {
  const int64_t used = cached.defined() ? cached.size(2) : 0, t = fresh.size(2);
  if (!room.defined() || room.size(2) < used + t) {
    const int64_t capacity = std::min(config_.context, std::max({used + t, 2 * used, int64_t{16}}));
    std::vector<int64_t> shape = fresh.sizes().vec();
    shape[2] = capacity;
    at::Tensor grown = storage_ ? storage_(shape, fresh.options()) : at::empty(shape, fresh.options());
    if (used > 0) grown.narrow(2, 0, used).copy_(cached);
    room = grown;
  }
  room.narrow(2, used, t).copy_(fresh);
  cached = room.narrow(2, 0, used + t);
}

at::Tensor KvCache::attend(int64_t block, const QkvHeads& heads, const AttentionSpec& spec) {
  Layer& layer = layers_[block];
  const at::Tensor& q = heads.q;
  const int64_t t = q.size(2);
  check_room(t);
  append(layer.k, layer.k_room, heads.k);
  append(layer.v, layer.v_room, heads.v);
  // Keys and values are kept per key/value head (a grouped-query model's
  // cache is heads / kv_heads times smaller); attention's grouped-query mode
  // reads them without repeating them for each query head.
  const bool grouped = q.size(1) != layer.k.size(1);
  const at::Tensor keys = layer.k.device() == q.device() ? layer.k : layer.k.to(q.device());
  const at::Tensor values = layer.v.device() == q.device() ? layer.v : layer.v.to(q.device());
  at::Tensor y;
  if (!spec.plain()) {
    const at::Tensor allowed = pads_.defined() ? padding_allowed(pads_, length_, t).to(q.device()) : at::Tensor();
    y = variant_attention(q, keys, values, spec, /*training=*/false, allowed);
  } else if (length_ == 0 && !pads_.defined()) {
    y = at::scaled_dot_product_attention(q, keys, values, /*attn_mask=*/{}, 0.0, /*is_causal=*/true, std::nullopt, grouped);
  } else {
    // New query i (slot length_ + i) sees every cached key and the new ones up
    // to itself, a row's padding never (a padding query sees itself alone).
    const at::Tensor query_slots = at::arange(length_, length_ + t, at::kLong);
    at::Tensor mask = allowed_pairs(query_slots, at::arange(length_ + t, at::kLong), spec);
    if (pads_.defined()) mask = mask.logical_and(padding_allowed(pads_, length_, t));
    y = at::scaled_dot_product_attention(q, keys, values, /*attn_mask=*/mask, 0.0, /*is_causal=*/false, std::nullopt,
                                         grouped);
  }
  if (rolling_ && layer.window > 0 && !pads_.defined()) roll(layer);
  if (++blocks_done_ == config_.layers) {
    length_ = layer.dropped + layer.k.size(2);
    blocks_done_ = 0;
  }
  return y;
}

}  // namespace meshtrain::model
