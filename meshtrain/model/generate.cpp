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

at::Tensor generate(Gpt& model, const at::Tensor& prompt, const SampleOptions& options) {
  options.validate();
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  const int64_t context = model->config().context;
  at::Tensor sequence = prompt.numel() ? prompt.to(at::kLong).view({1, -1}) : at::zeros({1, 1}, at::kLong);
  const int64_t start = prompt.numel() ? sequence.size(1) : 1;
  std::optional<CacheScope> scope;
  if (options.kv_cache) scope.emplace(model, options);
  if (scope) scope->cache().set_rolling(true);  // one sequence: windowed blocks keep only their window
  // The logits after the last `context` tokens: from the cache while the
  // sequence fits, else (a sliding window) a forward over the window.
  auto last_logits = [&](bool fresh) {
    at::Tensor logits;
    if (scope && !fresh && scope->cache().length() < context) {
      logits = model->forward(scope->cache().next(sequence.narrow(1, sequence.size(1) - 1, 1))).select(1, 0);
    } else {
      if (scope) scope->cache().clear();
      const int64_t t = std::min(context, sequence.size(1));
      const at::Tensor window = sequence.narrow(1, sequence.size(1) - t, t);
      logits = model->forward(scope ? scope->cache().next(window) : Batch(window)).select(1, t - 1);
    }
    return options.full_vocabulary ? options.full_vocabulary(logits) : logits;
  };
  for (int64_t i = 0; i < options.tokens; ++i) {
    const at::Tensor next = pick_next(last_logits(i == 0), options, generator);
    sequence = at::cat({sequence, next}, 1);
    if (options.on_token && !options.on_token(next.item<int64_t>())) break;
  }
  model->train(was_training);
  return sequence.narrow(1, start, sequence.size(1) - start).view({-1});
}

std::vector<at::Tensor> generate_batch(Gpt& model, const std::vector<at::Tensor>& prompts, const SampleOptions& options) {
  options.validate();
  if (prompts.empty()) return {};
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  const int64_t b = static_cast<int64_t>(prompts.size());
  int64_t longest = 1;
  for (const at::Tensor& p : prompts) longest = std::max<int64_t>(longest, p.numel());
  if (longest + options.tokens > model->config().context) {
    throw std::invalid_argument("generate_batch: the longest prompt (" + std::to_string(longest) + ") and " +
                                std::to_string(options.tokens) + " new tokens exceed the context " +
                                std::to_string(model->config().context));
  }
  // Left-padded prompts; an empty prompt is a single 0 token, as in generate().
  at::Tensor tokens = at::zeros({b, longest}, at::kLong);
  std::vector<int64_t> pads;
  for (int64_t r = 0; r < b; ++r) {
    const at::Tensor p = prompts[r].numel() ? prompts[r].to(at::kLong).view({-1}) : at::zeros({1}, at::kLong);
    pads.push_back(longest - p.numel());
    tokens[r].narrow(0, pads.back(), p.numel()).copy_(p);
  }
  std::vector<at::Generator> generators;
  for (int64_t r = 0; r < b; ++r) generators.push_back(at::make_generator<at::CPUGeneratorImpl>(options.seed));
  CacheScope scope(model, options);
  scope.cache().set_padding(pads);
  auto whole = [&](const at::Tensor& logits) { return options.full_vocabulary ? options.full_vocabulary(logits) : logits; };
  at::Tensor logits = whole(model->forward(scope.cache().next(tokens)).select(1, longest - 1));
  std::vector<at::Tensor> out(b);
  for (int64_t i = 0; i < options.tokens; ++i) {
    std::vector<at::Tensor> next;
    for (int64_t r = 0; r < b; ++r) next.push_back(pick_next(logits.narrow(0, r, 1), options, generators[r]));
    const at::Tensor step = at::cat(next, 0);  // [B, 1]
    for (int64_t r = 0; r < b; ++r) out[r] = out[r].defined() ? at::cat({out[r], next[r].view({1})}) : next[r].view({1});
    if (i + 1 < options.tokens) logits = whole(model->forward(scope.cache().next(step)).select(1, 0));
  }
  model->train(was_training);
  return out;
}

}  // namespace meshtrain::model
