#include "meshtrain/serve/batch_engine.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
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
  model_.gpt()->add_forward_hooks(cache_);
}

BatchEngine::~BatchEngine() { model_.gpt()->remove_forward_hooks(cache_.get()); }

void BatchEngine::check(const GenerationRequest& request) const {
  request.options.validate();
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
}

std::vector<TokenEvent> BatchEngine::admit(const std::vector<GenerationRequest>& all) {
  if (static_cast<int64_t>(all.size()) > room()) throw std::logic_error("batch engine: more requests than room");
  std::vector<TokenEvent> refused;
  std::vector<GenerationRequest> requests;
  for (const GenerationRequest& r : all) {
    try {
      check(r);
      requests.push_back(r);
    } catch (const std::invalid_argument& e) {
      refused.push_back(TokenEvent{r.id, 0, true, e.what()});
    }
  }
  if (requests.empty()) return refused;
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
  model_.gpt()->remove_forward_hooks(cache_.get());
  model_.gpt()->add_forward_hooks(fresh);
  if (b > 1) fresh->set_padding(pads);
  at::Tensor logits;
  try {
    logits = model_.gpt()->forward(tokens).select(1, longest - 1);
  } catch (...) {
    model_.gpt()->remove_forward_hooks(fresh.get());
    model_.gpt()->add_forward_hooks(cache_);
    throw;
  }
  model_.gpt()->remove_forward_hooks(fresh.get());
  model_.gpt()->add_forward_hooks(cache_);
  cache_->append_rows(*fresh);
  std::vector<size_t> added;
  for (const GenerationRequest& r : requests) {
    added.push_back(rows_.size());
    rows_.push_back(Row{r.id, model_.with_split(r.options), at::make_generator<at::CPUGeneratorImpl>(r.options.seed), 0, 0});
  }
  std::vector<TokenEvent> events = sample(logits, added);
  drop_finished();
  events.insert(events.begin(), refused.begin(), refused.end());
  return events;
}

std::vector<TokenEvent> BatchEngine::step() {
  if (rows_.empty()) return {};
  torch::NoGradGuard no_grad;
  std::vector<int64_t> last;
  std::vector<size_t> all;
  for (size_t i = 0; i < rows_.size(); ++i) last.push_back(rows_[i].last_token), all.push_back(i);
  const at::Tensor logits = model_.gpt()->forward(at::tensor(last, at::kLong).view({-1, 1})).select(1, 0);
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
      row.last_token = model::pick_next(whole.narrow(0, i, 1), row.options, row.generator).item<int64_t>();
    } catch (const std::exception& e) {
      row.made = row.options.tokens;  // leaves the batch at drop_finished()
      events.push_back(TokenEvent{row.id, 0, true, "generation failed: " + message_of(e)});
      continue;
    }
    ++row.made;
    events.push_back(TokenEvent{row.id, row.last_token, row.made >= row.options.tokens, ""});
  }
  return events;
}

void BatchEngine::cancel(uint64_t id) {
  for (Row& row : rows_) {
    if (row.id == id) row.made = row.options.tokens;
  }
  drop_finished();
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
