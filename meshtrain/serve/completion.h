// One completion request on its way through the server: what the client
// asked for, and the channel its text comes back on. No libtorch here, so the
// HTTP front end builds without it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace meshtrain::serve {

struct CompletionParams {
  std::string prompt;
  int64_t max_tokens = 16;
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool stream = false;
  bool echo = false;
};

enum class Submitted { kQueued, kQueueFull, kDraining };

// Filled by the scheduler, read by the HTTP handler waiting on it.
class CompletionJob {
 public:
  explicit CompletionJob(CompletionParams params) : params_(std::move(params)) {}
  const CompletionParams& params() const { return params_; }

  // Scheduler side.
  void push(const std::string& piece) {
    if (piece.empty()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    pieces_.push_back(piece);
    changed_.notify_all();
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
  std::vector<int64_t> prompt_ids;  // set when the request is checked

  // Handler side: waits up to `timeout` for text; returns false when the job
  // is done and every piece has been taken.
  bool next(std::string& piece, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, timeout, [&] { return !pieces_.empty() || done_; });
    piece.clear();
    while (!pieces_.empty()) piece += pieces_.front(), pieces_.pop_front();
    return !piece.empty() || !done_;
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
  // The client went away: the scheduler ends the generation.
  std::atomic<bool> abandoned{false};

 private:
  CompletionParams params_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::string> pieces_;
  bool done_ = false;
  std::string finish_reason_, error_;
  int64_t completion_tokens_ = 0;
};

}  // namespace meshtrain::serve
