#include "meshtrain/model/generate.h"

#include "meshtrain/model/kv_cache.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>

namespace meshtrain::model {

namespace {

// A cache attached to the model for the length of a generation.
class CacheScope {
 public:
  CacheScope(Gpt& model, const SampleOptions& options) : cache_(model) {
    if (options.kv_storage) cache_.set_storage(options.kv_storage);
    attached_ = cache_.attach(*model);
  }
  KvCache& cache() { return cache_; }

 private:
  KvCache cache_;
  std::unique_ptr<AttentionSwap> attached_;
};

}  // namespace

void SampleOptions::validate() const {
  if (tokens < 1) throw std::invalid_argument("max tokens must be at least 1 (got " + std::to_string(tokens) + ")");
  if (!(temperature >= 0 && std::isfinite(temperature))) {
    throw std::invalid_argument("temperature must be a finite number >= 0 (0: greedy); got " + std::to_string(temperature));
  }
  if (top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0: the whole vocabulary); got " + std::to_string(top_k));
  if (!(top_p > 0 && top_p <= 1)) throw std::invalid_argument("top_p must be in (0, 1]; got " + std::to_string(top_p));
}

at::Tensor pick_next(at::Tensor logits, const SampleOptions& options, at::Generator& generator) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  logits = logits.to(at::kFloat);
  if (!at::isfinite(logits).all().item<bool>()) {
    throw std::runtime_error("the model's logits are not finite (NaN or infinity); nothing can be sampled from them");
  }
  if (options.sampleable.defined()) {
    const int64_t v = std::min(logits.size(-1), options.sampleable.size(0));
    at::Tensor allowed = at::zeros({logits.size(-1)}, at::kBool);
    allowed.narrow(0, 0, v).copy_(options.sampleable.narrow(0, 0, v));
    logits = logits.masked_fill(allowed.logical_not(), kNone);
  }
  if (options.temperature < kGreedyBelow) return logits.argmax(-1, /*keepdim=*/true);
  // Shifted by the maximum first: the temperature then only scales values <= 0.
  logits = (logits - std::get<0>(logits.max(-1, /*keepdim=*/true))) / options.temperature;
  if (options.top_k > 0 && options.top_k < logits.size(-1)) {
    const at::Tensor kth = std::get<0>(logits.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, kNone);
  }
  if (options.top_p < 1) {
    // Keep the likeliest tokens until their probabilities reach top_p (the
    // token that crosses it included); the likeliest always, however small
    // top_p is (compared in double: a float rounds 1e-46 to 0).
    auto [sorted, order] = logits.sort(-1, /*descending=*/true);
    const at::Tensor p = at::softmax(sorted.to(at::kDouble), -1);
    at::Tensor drop_sorted = (p.cumsum(-1) - p) >= options.top_p;
    drop_sorted.select(-1, 0).fill_(false);
    const at::Tensor drop = at::zeros_like(logits, at::kBool).scatter(-1, order, drop_sorted);
    logits = logits.masked_fill(drop, kNone);
  }
  return at::multinomial(at::softmax(logits, -1), 1, false, generator);
}

std::vector<at::Tensor> decode(Gpt& model, Decoder& decoder, int64_t rows, const SampleOptions& options) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  std::vector<at::Generator> generators;
  for (int64_t r = 0; r < rows; ++r) generators.push_back(at::make_generator<at::CPUGeneratorImpl>(options.seed));
  auto whole = [&](const at::Tensor& logits) { return options.full_vocabulary ? options.full_vocabulary(logits) : logits; };
  at::Tensor logits = whole(decoder.prefill(model));
  std::vector<std::vector<at::Tensor>> picked(rows);
  for (int64_t i = 0; i < options.tokens; ++i) {
    std::vector<at::Tensor> next;
    for (int64_t r = 0; r < rows; ++r) {
      next.push_back(pick_next(logits.narrow(0, r, 1), options, generators[r]));
      picked[r].push_back(next.back().view({1}));
    }
    if (options.on_token && !options.on_token(next.front().item<int64_t>())) break;
    if (i + 1 < options.tokens) logits = whole(decoder.next(model, at::cat(next, 0)));
  }
  model->train(was_training);
  std::vector<at::Tensor> out;
  for (auto& row : picked) out.push_back(row.empty() ? at::empty({0}, at::kLong) : at::cat(row));
  return out;
}

namespace {

// One sequence (Note [Decode loop]): the cache rolls in windowed blocks; once
// the sequence outgrows the context, or without a cache, each token is a
// forward over the last `context` tokens.
class SequenceDecoder final : public Decoder {
 public:
  SequenceDecoder(Gpt& model, const at::Tensor& prompt, const SampleOptions& options)
      : sequence_(prompt.numel() ? prompt.to(at::kLong).view({1, -1}) : at::zeros({1, 1}, at::kLong)),
        context_(model->config().context) {
    if (!options.kv_cache) return;
    scope_.emplace(model, options);
    scope_->cache().set_rolling(true);  // one sequence: windowed blocks keep only their window
  }
  at::Tensor prefill(Gpt& model) override { return window(model); }
  at::Tensor next(Gpt& model, const at::Tensor& tokens) override {
    sequence_ = at::cat({sequence_, tokens}, 1);
    if (!scope_ || scope_->cache().length() >= context_) return window(model);
    return model->forward(scope_->cache().next(tokens)).select(1, 0);
  }

 private:
  // The logits after the last `context` tokens by a fresh forward over them.
  at::Tensor window(Gpt& model) {
    if (scope_) scope_->cache().clear();
    const int64_t t = std::min(context_, sequence_.size(1));
    const at::Tensor tokens = sequence_.narrow(1, sequence_.size(1) - t, t);
    return model->forward(scope_ ? scope_->cache().next(tokens) : Batch(tokens)).select(1, t - 1);
  }

  at::Tensor sequence_;  // [1, n]: the prompt and every token since
  int64_t context_;
  std::optional<CacheScope> scope_;
};

// Prompts of any lengths, left-padded into one batch with the KV cache.
class PaddedDecoder final : public Decoder {
 public:
  PaddedDecoder(Gpt& model, const std::vector<at::Tensor>& prompts, const SampleOptions& options)
      : scope_(model, options) {
    int64_t longest = 1;
    for (const at::Tensor& p : prompts) longest = std::max<int64_t>(longest, p.numel());
    if (longest + options.tokens > model->config().context) {
      throw std::invalid_argument("generate_batch: the longest prompt (" + std::to_string(longest) + ") and " +
                                  std::to_string(options.tokens) + " new tokens exceed the context " +
                                  std::to_string(model->config().context));
    }
    // An empty prompt is a single 0 token, as in generate().
    tokens_ = at::zeros({static_cast<int64_t>(prompts.size()), longest}, at::kLong);
    std::vector<int64_t> pads;
    for (size_t r = 0; r < prompts.size(); ++r) {
      const at::Tensor p = prompts[r].numel() ? prompts[r].to(at::kLong).view({-1}) : at::zeros({1}, at::kLong);
      pads.push_back(longest - p.numel());
      tokens_[static_cast<int64_t>(r)].narrow(0, pads.back(), p.numel()).copy_(p);
    }
    scope_.cache().set_padding(pads);
  }
  at::Tensor prefill(Gpt& model) override {
    return model->forward(scope_.cache().next(tokens_)).select(1, tokens_.size(1) - 1);
  }
  at::Tensor next(Gpt& model, const at::Tensor& tokens) override {
    return model->forward(scope_.cache().next(tokens)).select(1, 0);
  }

 private:
  CacheScope scope_;
  at::Tensor tokens_;  // [B, longest]: the prompts, left-padded
};

}  // namespace

at::Tensor generate(Gpt& model, const at::Tensor& prompt, const SampleOptions& options) {
  options.validate();
  SequenceDecoder decoder(model, prompt, options);
  return decode(model, decoder, 1, options).front().to(prompt.numel() ? prompt.device() : at::Device(at::kCPU));
}

std::vector<at::Tensor> generate_batch(Gpt& model, const std::vector<at::Tensor>& prompts, const SampleOptions& options) {
  options.validate();
  if (prompts.empty()) return {};
  torch::NoGradGuard no_grad;
  PaddedDecoder decoder(model, prompts, options);
  SampleOptions rows = options;
  rows.on_token = nullptr;  // a callback sees one sequence; each row here is generated whole
  return decode(model, decoder, static_cast<int64_t>(prompts.size()), rows);
}

}  // namespace meshtrain::model
