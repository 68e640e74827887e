#include "meshtrain/parallel/context_parallel_generate.h"

#include "meshtrain/comm/agree.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace meshtrain::parallel {
namespace {

constexpr float kHidden = -std::numeric_limits<float>::infinity();

// Appends `fresh` [B, Hkv, t, D] after the rows `cached` holds, in `room`,
// which doubles when full: O(t) per token, not O(cached).
void append(at::Tensor& cached, at::Tensor& room, const at::Tensor& fresh) {
  const int64_t n = cached.defined() ? cached.size(2) : 0, t = fresh.size(2);
  if (!room.defined() || room.size(2) < n + t) {
    std::vector<int64_t> sizes = fresh.sizes().vec();
    sizes[2] = std::max<int64_t>(2 * (n + t), 16);
    at::Tensor bigger = at::empty(sizes, fresh.options());
    if (n > 0) bigger.narrow(2, 0, n).copy_(cached);
    room = bigger;
  }
  room.narrow(2, n, t).copy_(fresh);
  cached = room.narrow(2, 0, n + t);
}

}  // namespace

// Block `block`'s attention object: the cache's layer of that block.
class ContextParallelCache::LayerAttention final : public model::Attention {
 public:
  LayerAttention(ContextParallelCache* cache, int64_t block) : cache_(cache), block_(block) {}
  at::Tensor forward(const model::QkvHeads& heads, const model::AttentionSpec& spec, const model::Batch& batch,
                     bool training) override {
    (void)batch;  // the cache knows the prefill's rows and the decoded position
    (void)training;
    model::AttentionSpec rule = spec;
    rule.scale = spec.scale_for(heads.q.size(-1));
    return cache_->attend(block_, heads, rule);
  }

 private:
  ContextParallelCache* cache_;
  int64_t block_;
};

ContextParallelCache::ContextParallelCache(std::shared_ptr<comm::Communicator> cp)
    : cp_(std::move(cp)), counts_(cp_->size(), 0), positions_(at::empty({0}, at::kLong)) {}

std::unique_ptr<model::AttentionSwap> ContextParallelCache::attach(model::GptImpl& model) {
  return std::make_unique<model::AttentionSwap>(
      model, [this](int64_t block) { return std::make_shared<LayerAttention>(this, block); });
}

model::Batch ContextParallelCache::prefill(const at::Tensor& tokens, const at::Tensor& rows, int64_t length,
                                           int64_t context) {
  const int64_t cp = cp_->size(), padded = rows.size(0) * cp;
  for (int64_t r = 0; r < cp; ++r) counts_[r] += (zigzag_positions(padded, cp, r) < length).sum().item<int64_t>();
  rows_ = rows;
  keep_ = length;
  positions_ = at::cat({positions_, rows.masked_select(rows < length)});
  model::Batch batch(tokens);
  batch.columns = rows;
  // The padding's positions may pass the context's tables; no real row sees them.
  batch.positions = rows.clamp_max(context - 1).unsqueeze(0);
  return batch;
}

model::Batch ContextParallelCache::decode(const at::Tensor& token, int64_t position) {
  const int64_t owner = std::min_element(counts_.begin(), counts_.end()) - counts_.begin();
  ++counts_[owner];
  owner_ = owner == cp_->rank();
  if (owner_) positions_ = at::cat({positions_, at::full({1}, position, at::kLong)});
  rows_ = at::Tensor();
  position_ = position;
  model::Batch batch(token);
  batch.positions = at::full({1, 1}, position, at::kLong);
  return batch;
}

at::Tensor ContextParallelCache::attend(int64_t block, const model::QkvHeads& h, const model::AttentionSpec& rule) {
  Layer& layer = layers_[block];
  at::Tensor y;
  if (rows_.defined()) {
    y = ring_attention(h.q, h.k, h.v, rows_, cp_, rule);
    const at::Tensor kept = (rows_ < keep_).nonzero().view({-1}).to(h.k.device());
    append(layer.k, layer.k_room, h.k.index_select(2, kept));
    append(layer.v, layer.v_room, h.v.index_select(2, kept));
  } else {
    if (owner_) {
      append(layer.k, layer.k_room, h.k);
      append(layer.v, layer.v_room, h.v);
    }
    y = decode_attention(layer, h, rule);
  }
  return y;
}

at::Tensor ContextParallelCache::decode_attention(Layer& layer, const model::QkvHeads& h,
                                                  const model::AttentionSpec& rule) {
  const int64_t b = h.q.size(0), heads = h.q.size(1), d = h.q.size(3), kv = h.k.size(1), g = heads / kv;
  const at::TensorOptions fp32 = h.q.options().dtype(at::kFloat);
  // This rank's part: an output and a log-sum-exp per head (−inf, output 0, where it holds no key).
  at::Tensor out = at::zeros({b, kv, g, 1, d}, fp32), lse = at::full({b, kv, g, 1, 1}, kHidden, fp32);
  if (layer.k.defined() && layer.k.size(2) > 0) {
    // Products in the cache's dtype (no copy of the cache per token), the softmax in fp32.
    const at::Tensor q = h.q.to(layer.k.scalar_type()).reshape({b, kv, g, 1, d});
    at::Tensor s = at::matmul(q, layer.k.unsqueeze(2).transpose(-2, -1)).to(at::kFloat).mul_(rule.scale);
    model::soft_cap_(s, rule.softcap);
    const at::Tensor seen = model::allowed_pairs(at::full({1}, position_, at::kLong), positions_, rule).view({-1});
    s.masked_fill_(seen.logical_not().to(s.device()), kHidden);
    lse = at::logsumexp(s, -1, /*keepdim=*/true);
    const at::Tensor p = s.sub_(lse).exp_().masked_fill_(at::isfinite(lse).logical_not(), 0);
    out = at::matmul(p.to(layer.v.scalar_type()), layer.v.unsqueeze(2)).to(at::kFloat);
  }
  // Every rank's part, merged alike on every rank.
  const at::Tensor mine = at::cat({out.reshape({-1}), lse.reshape({-1})}).to(cp_->device()).contiguous();
  const int64_t cp = cp_->size();
  at::Tensor all = at::empty({cp * mine.numel()}, mine.options());
  cp_->all_gather(all, mine).wait();
  all = all.to(h.q.device()).view({cp, -1});
  const at::Tensor outs = all.narrow(1, 0, out.numel()).view({cp, b, kv, g, 1, d});
  const at::Tensor lses = all.narrow(1, out.numel(), lse.numel()).view({cp, b, kv, g, 1, 1});
  const at::Tensor total = at::logsumexp(lses, 0, /*keepdim=*/true);  // finite: one rank holds the token itself
  return (outs * at::exp(lses - total)).sum(0).reshape({b, heads, 1, d}).to(h.q.scalar_type());
}

namespace {

// The cache split over the cp group as a decode loop's decoder (Note [Decode loop]): the prompt but its
// last token prefilled by ring attention, then every token decoded at its position.
class SplitCacheDecoder final : public model::Decoder {
 public:
  SplitCacheDecoder(const std::shared_ptr<comm::Communicator>& cp, const at::Tensor& sequence)
      : cp_(cp), cache_(cp), sequence_(sequence) {}
  SplitCacheDecoder(const SplitCacheDecoder&) = delete;  // the attached cache holds `this` of cache_
  SplitCacheDecoder& operator=(const SplitCacheDecoder&) = delete;
  ContextParallelCache& cache() { return cache_; }

  at::Tensor prefill(model::Gpt& model) override {
    TORCH_CHECK(!attached_, "SplitCacheDecoder: one prefill per generation");
    attached_ = cache_.attach(*model);
    device_ = model->parameters().front().device();
    const int64_t length = sequence_.size(0), context = model->config().context;
    // All but the last prompt token, padded at the end to a multiple of 2·cp.
    const int64_t prefix = length - 1, chunk = 2 * cp_->size();
    if (prefix > 0) {
      const int64_t padded = (prefix + chunk - 1) / chunk * chunk;
      at::Tensor tokens = at::zeros({1, padded}, at::kLong);
      tokens.narrow(1, 0, prefix).copy_(sequence_.narrow(0, 0, prefix).view({1, -1}));
      const at::Tensor rows = zigzag_positions(padded, cp_->size(), cp_->rank());
      const model::Batch batch = cache_.prefill(tokens.index_select(1, rows), rows, prefix, context).to(device_);
      at::Tensor x = model->embed(batch);  // no logits: none is sampled from
      for (int64_t i = 0; i < model->config().layers; ++i) x = model->block(i, x, batch);
    }
    position_ = length - 1;
    return step(model, sequence_.narrow(0, length - 1, 1).view({1, 1}));
  }
  at::Tensor next(model::Gpt& model, const at::Tensor& tokens) override {
    ++position_;
    return step(model, tokens);
  }

 private:
  at::Tensor step(model::Gpt& model, const at::Tensor& token) {
    return model->forward(cache_.decode(token.cpu(), position_).to(device_)).select(1, 0);
  }

  std::shared_ptr<comm::Communicator> cp_;
  ContextParallelCache cache_;
  std::unique_ptr<model::AttentionSwap> attached_;  // the cache is every block's attention while it lives
  at::Tensor sequence_;                             // the prompt [n]
  at::Device device_ = at::kCPU;
  int64_t position_ = 0;                            // of the newest token
};

}  // namespace

at::Tensor generate_context_parallel(model::Gpt& model, const at::Tensor& prompt, const model::SampleOptions& options,
                                     const std::shared_ptr<comm::Communicator>& cp, std::vector<int64_t>* cached) {
  const at::Tensor sequence = prompt.numel() ? prompt.to(at::kLong).view({-1}) : at::zeros({1}, at::kLong);
  const int64_t length = sequence.size(0), context = model->config().context;
  // Every rank checks alike and fails together, the message said once.
  comm::on_all_or_all_fail(*cp, [&] {
    options.validate();
    if (length + options.tokens > context) {
      throw std::invalid_argument("generate with cp: the prompt (" + std::to_string(length) + " tokens) and " +
                                  std::to_string(options.tokens) + " new tokens exceed the context " +
                                  std::to_string(context) + " (the cache split over cp keeps every token)");
    }
  });
  SplitCacheDecoder decoder(cp, sequence);
  const at::Tensor out = model::decode(model, decoder, 1, options).front().cpu();
  if (cached) *cached = decoder.cache().counts();
  return out;
}

}  // namespace meshtrain::parallel
