#include "meshtrain/serve/batch_engine.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace meshtrain::serve {

namespace {

// An error's message for a client: without libtorch's backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

}  // namespace

BatchEngine::BatchEngine(InferenceModel& model, int64_t max_batch)
    : model_(model), max_batch_(max_batch), cache_(std::make_shared<model::KvCache>(model.gpt())) {
  if (max_batch < 1) throw std::invalid_argument("the batch must hold at least one sequence");
  cache_->set_storage(model_.kv_storage());
  attached_ = cache_->attach(*model_.gpt());
}

BatchEngine::~BatchEngine() = default;

void BatchEngine::check(const GenerationRequest& request) const {
  model::SampleOptions options = request.options;
  if (options.tokens == 0) options.tokens = 1;  // 0 scores the prompt; the rest must still be in range
  options.validate();
  const int64_t context = model_.config().context;
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  if (prompt == 0) throw std::invalid_argument("the prompt is empty; give at least one token of text");
  if (prompt + request.options.tokens > context) {
    throw std::invalid_argument("the prompt (" + std::to_string(prompt) + " tokens) and max_tokens (" +
                                std::to_string(request.options.tokens) + ") exceed the model's context of " +
                                std::to_string(context) + " tokens; shorten the prompt or lower max_tokens");
  }
  const int64_t vocab = model_.config().vocab_size;
  for (int64_t t : request.prompt) {
    if (t < 0 || t >= vocab) throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary");
  }
  const RequestExtras& x = request.extras;
  if (x.logprobs > 20) throw std::invalid_argument("logprobs is at most 20");
  for (const auto& [id, bias] : x.logit_bias) {
    if (id < 0 || id >= vocab) throw std::invalid_argument("logit_bias names token " + std::to_string(id) + ", outside the vocabulary");
    if (!(std::fabs(bias) <= 100)) throw std::invalid_argument("a logit_bias value is outside [-100, 100]");
  }
  for (double penalty : {x.presence_penalty, x.frequency_penalty}) {
    if (!(std::fabs(penalty) <= 2)) throw std::invalid_argument("penalties must be in [-2, 2]");
  }
}

namespace {

// Each row's entry for its token in log-probabilities [n, V], with the k
// likeliest of the ids `allowed` (bool [V], or undefined for all): one
// gather and one topk for all rows, read back through raw pointers.
std::vector<TokenLogprob> logprobs_of(const at::Tensor& log_probs, const std::vector<int64_t>& tokens, int64_t k,
                                      const at::Tensor& allowed) {
  const int64_t n = log_probs.size(0), v = log_probs.size(1);
  const at::Tensor chosen = log_probs.gather(1, at::tensor(tokens, at::kLong).view({n, 1})).view({n}).contiguous();
  std::vector<TokenLogprob> out(static_cast<size_t>(n));
  const float* c = chosen.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) out[i].token = tokens[i], out[i].logprob = c[i];
  if (k <= 0) return out;
  at::Tensor candidates = log_probs;
  if (allowed.defined() && allowed.size(0) >= v) {
    candidates = log_probs.masked_fill(allowed.narrow(0, 0, v).logical_not(), -std::numeric_limits<float>::infinity());
  }
  auto [values, ids] = candidates.topk(std::min<int64_t>(k, v), -1);
  values = values.contiguous(), ids = ids.contiguous();
  const float* tv = values.data_ptr<float>();
  const int64_t* ti = ids.data_ptr<int64_t>();
  const int64_t kk = values.size(1);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < kk; ++j) out[i].top.emplace_back(ti[i * kk + j], tv[i * kk + j]);
  }
  return out;
}

}  // namespace

std::vector<TokenEvent> BatchEngine::admit(const std::vector<GenerationRequest>& all) {
  if (static_cast<int64_t>(all.size()) > room()) throw std::logic_error("batch engine: more requests than room");
  std::vector<TokenEvent> refused;
  std::vector<GenerationRequest> requests;
  for (const GenerationRequest& r : all) {
    try {
      check(r);
      requests.push_back(r);
    } catch (const std::invalid_argument& e) {
      TokenEvent event;
      event.id = r.id, event.last = true, event.error = e.what();
      refused.push_back(std::move(event));
    }
  }
  if (requests.empty()) return refused;
  std::vector<TokenEvent> events = prefill(requests);
  events.insert(events.begin(), refused.begin(), refused.end());
  return events;
}

std::vector<TokenEvent> BatchEngine::prefill(const std::vector<GenerationRequest>& requests) {
  torch::NoGradGuard no_grad;
  // Prefill in a cache of the new rows alone, then join the running batch.
  int64_t longest = 0;
  for (const GenerationRequest& r : requests) longest = std::max<int64_t>(longest, r.prompt.size());
  const int64_t b = static_cast<int64_t>(requests.size());
  at::Tensor tokens = at::zeros({b, longest}, at::kLong);
  std::vector<int64_t> pads;
  for (int64_t i = 0; i < b; ++i) {
    const std::vector<int64_t>& p = requests[i].prompt;
    pads.push_back(longest - static_cast<int64_t>(p.size()));
    tokens[i].narrow(0, pads.back(), p.size()).copy_(at::tensor(p, at::kLong));
  }
  auto fresh = std::make_shared<model::KvCache>(model_.gpt());
  fresh->set_storage(model_.kv_storage());
  at::Tensor all_logits;
  {
    const std::unique_ptr<model::AttentionSwap> attached = fresh->attach(*model_.gpt());  // over the running cache
    if (b > 1) fresh->set_padding(pads);
    all_logits = model_.gpt()->forward(fresh->next(tokens));
  }
  // Joining changes the running batch's cache layer by layer: what it held
  // (tensor handles: joining builds new tensors) comes back if anything
  // after this point throws (Note [Forward failures]).
  const model::KvCache saved_cache = *cache_;
  const std::vector<Row> saved_rows = rows_;
  try {
    return join(requests, all_logits, pads, fresh);
  } catch (...) {
    *cache_ = saved_cache;
    rows_ = saved_rows;
    throw;
  }
}

// The prefilled requests that generate join the batch (their first tokens
// sampled); each one's prompt is scored where asked.
std::vector<TokenEvent> BatchEngine::join(const std::vector<GenerationRequest>& requests, const at::Tensor& all_logits,
                                          const std::vector<int64_t>& pads, const std::shared_ptr<model::KvCache>& fresh) {
  const int64_t b = static_cast<int64_t>(requests.size()), longest = all_logits.size(1);
  // Only the requests that generate join the batch; one that scores its prompt is done here.
  std::vector<int64_t> joining;
  for (int64_t i = 0; i < b; ++i) {
    if (requests[static_cast<size_t>(i)].options.tokens > 0) joining.push_back(i);
  }
  if (static_cast<int64_t>(joining.size()) < b) fresh->keep_rows(joining);
  if (!joining.empty()) cache_->append_rows(*fresh);
  std::vector<size_t> added;
  for (int64_t i : joining) {
    const GenerationRequest& r = requests[static_cast<size_t>(i)];
    added.push_back(rows_.size());
    rows_.push_back(Row{r.id, model_.with_split(r.options), r.extras, at::make_generator<at::CPUGeneratorImpl>(r.options.seed),
                        0, 0, {}});
  }
  std::vector<TokenEvent> events;
  if (!joining.empty()) {
    events = sample(all_logits.select(1, longest - 1).index_select(0, at::tensor(joining, at::kLong)), added);
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<TokenLogprob> scored = prompt_logprobs(requests[i], all_logits[static_cast<int64_t>(i)], pads[i]);
    if (requests[i].options.tokens == 0) {  // scored, nothing to generate
      TokenEvent event;
      event.id = requests[i].id, event.token = -1, event.last = true;
      events.push_back(std::move(event));
    }
    for (TokenEvent& e : events) {
      if (e.id == requests[i].id) e.prompt = std::move(scored);
    }
  }
  drop_finished();
  return events;
}

// Each prompt token's logprob, from the logits of the position before it
// (`logits`: the request's row of the prefill, `pad` positions of left padding).
std::vector<TokenLogprob> BatchEngine::prompt_logprobs(const GenerationRequest& request, const at::Tensor& logits,
                                                       int64_t pad) const {
  const std::vector<int64_t>& p = request.prompt;
  if (!request.extras.prompt_logprobs) return {};
  std::vector<TokenLogprob> out{TokenLogprob{p[0], std::nan(""), {}}};
  if (p.size() < 2) return out;
  const model::SampleOptions options = model_.with_split(request.options);
  at::Tensor rows = logits.narrow(0, pad, static_cast<int64_t>(p.size()) - 1);
  if (options.full_vocabulary) rows = options.full_vocabulary(rows);
  const std::vector<TokenLogprob> scored =
      logprobs_of(at::log_softmax(rows.to(at::kFloat), -1), std::vector<int64_t>(p.begin() + 1, p.end()),
                  std::max<int64_t>(request.extras.logprobs, 0), options.sampleable);
  out.insert(out.end(), scored.begin(), scored.end());
  return out;
}

std::vector<TokenEvent> BatchEngine::step() {
  if (rows_.empty()) return {};
  torch::NoGradGuard no_grad;
  std::vector<int64_t> last;
  std::vector<size_t> all;
  for (size_t i = 0; i < rows_.size(); ++i) last.push_back(rows_[i].last_token), all.push_back(i);
  const at::Tensor logits = model_.gpt()->forward(cache_->next(at::tensor(last, at::kLong).view({-1, 1}))).select(1, 0);
  std::vector<TokenEvent> events = sample(logits, all);
  drop_finished();
  return events;
}

std::vector<TokenEvent> BatchEngine::sample(const at::Tensor& logits, const std::vector<size_t>& rows) {
  // `logits` rows are `rows`' (the first logits row is rows[0]); the gather of
  // a split vocabulary is one collective for all of them.
  const at::Tensor whole = rows_[rows[0]].options.full_vocabulary ? rows_[rows[0]].options.full_vocabulary(logits) : logits;
  std::vector<TokenEvent> events;
  for (size_t i = 0; i < rows.size(); ++i) {
    Row& row = rows_[rows[i]];
    try {
      events.push_back(sample_row(row, whole.narrow(0, static_cast<int64_t>(i), 1)));
    } catch (const std::exception& e) {
      row.made = row.options.tokens;  // leaves the batch at drop_finished()
      TokenEvent event;
      event.id = row.id, event.last = true, event.error = "generation failed: " + message_of(e);
      events.push_back(std::move(event));
    }
  }
  return events;
}

// One row's next token: bias and penalties adjust the logits it is sampled
// from; its logprob is read from the model's own distribution.
TokenEvent BatchEngine::sample_row(Row& row, const at::Tensor& logits) {
  TokenEvent event;
  event.id = row.id;
  if (row.options.tokens == 0) {  // scoring only: no token
    event.token = -1;
    event.last = true;
    return event;
  }
  const at::Tensor raw = logits.to(at::kFloat);
  at::Tensor adjusted = raw;
  const RequestExtras& x = row.extras;
  if (!x.logit_bias.empty() || ((x.presence_penalty != 0 || x.frequency_penalty != 0) && !row.generated.empty())) {
    adjusted = raw.clone();
    auto a = adjusted.accessor<float, 2>();
    for (const auto& [id, bias] : x.logit_bias) a[0][id] += static_cast<float>(bias);
    std::vector<int64_t> seen = row.generated;
    std::sort(seen.begin(), seen.end());
    for (size_t k = 0; k < seen.size();) {
      size_t n = k;
      while (n < seen.size() && seen[n] == seen[k]) ++n;
      a[0][seen[k]] -= static_cast<float>(x.presence_penalty + x.frequency_penalty * static_cast<double>(n - k));
      k = n;
    }
  }
  row.last_token = model::pick_next(adjusted, row.options, row.generator).item<int64_t>();
  if (x.presence_penalty != 0 || x.frequency_penalty != 0) row.generated.push_back(row.last_token);
  ++row.made;
  event.token = row.last_token;
  event.last = row.made >= row.options.tokens;
  if (x.logprobs >= 0) {
    event.logprob = logprobs_of(at::log_softmax(raw, -1), {row.last_token}, x.logprobs, row.options.sampleable)[0];
  }
  return event;
}

void BatchEngine::cancel(uint64_t id) {
  for (Row& row : rows_) {
    if (row.id == id) row.made = row.options.tokens;
  }
  drop_finished();
}

std::vector<uint64_t> BatchEngine::reset() {
  std::vector<uint64_t> ids;
  for (const Row& row : rows_) ids.push_back(row.id);
  rows_.clear();
  attached_.reset();
  cache_ = std::make_shared<model::KvCache>(model_.gpt());
  cache_->set_storage(model_.kv_storage());
  attached_ = cache_->attach(*model_.gpt());
  return ids;
}

void BatchEngine::drop_finished() {
  std::vector<int64_t> keep;
  std::vector<Row> kept;
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (rows_[i].made < rows_[i].options.tokens) keep.push_back(static_cast<int64_t>(i)), kept.push_back(rows_[i]);
  }
  if (kept.size() == rows_.size()) return;
  cache_->keep_rows(keep);
  rows_ = std::move(kept);
}

}  // namespace meshtrain::serve
