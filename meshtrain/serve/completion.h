// One generation on its way through the server: what the client asked for,
// and the channel its text (and log-probabilities) come back on. No libtorch
// here, so the HTTP front end builds without it.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::serve {

// A token with its log-probability under the model (the raw distribution,
// before temperature, penalties or bias) and the likeliest alternatives.
// logprob is NaN where there is none (a prompt's first token).
struct TokenLogprob {
  int64_t token = 0;
  double logprob = std::nan("");
  std::vector<std::pair<int64_t, double>> top;  // (id, logprob), likeliest first
};

// What a request asks beyond sampling.
struct RequestExtras {
  int64_t logprobs = -1;  // -1: none; k >= 0: each new token's logprob and the k likeliest
  bool prompt_logprobs = false;  // the prompt's tokens' too (echo with logprobs; scoring)
  std::vector<std::pair<int64_t, double>> logit_bias;  // added to the logits before sampling
  double presence_penalty = 0;   // subtracted once from each token already generated
  double frequency_penalty = 0;  // subtracted per time a token was generated
};

struct CompletionParams {
  std::string prompt;               // the prompt's text (echo), decoded when it came as ids
  std::vector<int64_t> prompt_ids;  // the tokens generation continues
  int64_t max_tokens = 16;          // 0: score the prompt only
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool skip_special_tokens = true;  // special tokens (<|im_start|>) left out of the text, as vLLM does
  RequestExtras extras;
};

// kTooLarge: one request asks for more generations than the queue holds.
enum class Submitted { kQueued, kQueueFull, kDraining, kTooLarge };

// Filled by the scheduler, read by the HTTP handler waiting on it.
class CompletionJob {
 public:
  explicit CompletionJob(CompletionParams params) : params_(std::move(params)) {}
  const CompletionParams& params() const { return params_; }

  // Scheduler side. Text comes in pieces (held back at a possible stop
  // string); tokens, when logprobs were asked, one by one.
  void push(const std::string& piece, const TokenLogprob* token = nullptr) {
    if (piece.empty() && !token) return;
    std::lock_guard<std::mutex> lock(mutex_);
    pieces_.push_back(piece);
    if (token) tokens_.push_back(*token);
    changed_.notify_all();
  }
  void set_prompt_logprobs(std::vector<TokenLogprob> prompt) {
    std::lock_guard<std::mutex> lock(mutex_);
    prompt_logprobs_ = std::move(prompt);
  }
  void finish(const std::string& reason, int64_t completion_tokens) {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_reason_ = reason;
    completion_tokens_ = completion_tokens;
    done_ = true;
    changed_.notify_all();
  }
  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = message;
    done_ = true;
    changed_.notify_all();
  }

  // Handler side: waits up to `timeout` for text; returns false when the job
  // is done and every piece has been taken. `tokens` gets the tokens that
  // came with the text.
  bool next(std::string& piece, std::vector<TokenLogprob>& tokens, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, timeout, [&] { return !pieces_.empty() || done_; });
    piece.clear();
    tokens.clear();
    const bool any = !pieces_.empty();
    while (!pieces_.empty()) piece += pieces_.front(), pieces_.pop_front();
    while (!tokens_.empty()) tokens.push_back(std::move(tokens_.front())), tokens_.pop_front();
    return any || !done_;
  }
  bool next(std::string& piece, std::chrono::milliseconds timeout) {
    std::vector<TokenLogprob> ignored;
    return next(piece, ignored, timeout);
  }
  bool done() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  std::string finish_reason() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return finish_reason_;
  }
  std::string error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  int64_t completion_tokens() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return completion_tokens_;
  }
  std::vector<TokenLogprob> prompt_logprobs() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return prompt_logprobs_;
  }
  // The client went away: the scheduler ends the generation.
  std::atomic<bool> abandoned{false};

 private:
  CompletionParams params_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::string> pieces_;
  std::deque<TokenLogprob> tokens_;
  std::vector<TokenLogprob> prompt_logprobs_;
  bool done_ = false;
  std::string finish_reason_, error_;
  int64_t completion_tokens_ = 0;
};

}  // namespace meshtrain::serve
