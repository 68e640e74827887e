// Continuous batching: many generations decoded together, joining and leaving
// between forwards (Note [Continuous batching]).
#pragma once

#include "meshtrain/model/kv_cache.h"
#include "meshtrain/serve/completion.h"
#include "meshtrain/serve/inference_model.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::serve {

struct GenerationRequest {
  uint64_t id = 0;
  std::vector<int64_t> prompt;  // token ids; prompt + options.tokens must fit the context
  model::SampleOptions options;  // tokens (max; 0: score the prompt only), temperature, top_k, top_p, seed
  RequestExtras extras;          // logprobs, logit bias, penalties
};

struct TokenEvent {
  uint64_t id = 0;
  int64_t token = 0;  // -1 for a request that only scores its prompt
  bool last = false;  // the request's max tokens reached: it has left the batch
  TokenLogprob logprob;  // with extras.logprobs >= 0: the token's logprob and alternatives
  std::vector<TokenLogprob> prompt;  // with extras.prompt_logprobs, on the first event
  // Not empty: this request failed (no token) and has left the batch; the
  // others go on (Note [Continuous batching]).
  std::string error;
};

// Each sequence samples with its own generator seeded from its options, so
// without bias or penalties its tokens are those model::generate() gives for
// the same prompt and options alone (the batch changes which rows share a matmul, not what a
// row computes). A request that fails (refused by check() when it is
// admitted, or its sampling throws) leaves the batch alone, with an error
// event; every rank of a tensor-parallel group fails it alike, since they
// check the same requests and sample from the same logits. Collective under
// tensor parallel: every rank of the group must make the same calls in the
// same order.
class BatchEngine {
 public:
  BatchEngine(InferenceModel& model, int64_t max_batch);
  ~BatchEngine();

  // Throws std::invalid_argument saying what is wrong with a request (empty
  // prompt, beyond the context, sampling options out of range).
  void check(const GenerationRequest& request) const;
  // Prefills the requests together (left-padded) and adds them to the batch;
  // returns each one's first token (or its error). At most room() requests.
  std::vector<TokenEvent> admit(const std::vector<GenerationRequest>& requests);
  // One forward over the running sequences' last tokens: a token for each.
  std::vector<TokenEvent> step();
  // Ends a running sequence (a stop string, a client gone). Unknown ids are ignored.
  void cancel(uint64_t id);
  // Ends every running sequence with a fresh cache: after a step that threw,
  // when what the cache holds is unknown. Their ids.
  std::vector<uint64_t> reset();

  int64_t running() const { return static_cast<int64_t>(rows_.size()); }
  int64_t room() const { return max_batch_ - running(); }

 private:
  struct Row {
    uint64_t id;
    model::SampleOptions options;
    RequestExtras extras;
    at::Generator generator;
    int64_t last_token;
    int64_t made;  // tokens generated so far
    std::vector<int64_t> generated;  // for the penalties
  };
  std::vector<TokenEvent> sample(const at::Tensor& logits, const std::vector<size_t>& rows);
  TokenEvent sample_row(Row& row, const at::Tensor& logits);
  std::vector<TokenEvent> prefill(const std::vector<GenerationRequest>& requests);
  std::vector<TokenEvent> join(const std::vector<GenerationRequest>& requests, const at::Tensor& all_logits,
                               const std::vector<int64_t>& pads, const std::shared_ptr<model::KvCache>& fresh);
  std::vector<TokenLogprob> prompt_logprobs(const GenerationRequest& request, const at::Tensor& logits, int64_t pad) const;
  void drop_finished();

  InferenceModel& model_;
  int64_t max_batch_;
  std::shared_ptr<model::KvCache> cache_;  // the running batch's, attached to the model
  std::unique_ptr<model::AttentionSwap> attached_;  // cache_ as the model's attention
  std::vector<Row> rows_;                   // in cache row order
};

}  // namespace meshtrain::serve
