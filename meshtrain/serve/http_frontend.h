// The OpenAI-compatible HTTP API in front of a scheduler (cpp-httplib).
// No libtorch here: the scheduler is reached through callbacks.
#pragma once

#include "meshtrain/serve/completion.h"

#include <functional>
#include <memory>
#include <string>

namespace meshtrain::serve {

struct FrontendCallbacks {
  std::function<void(CompletionJob&)> check;  // throws std::invalid_argument: a 400 with its message
  std::function<Submitted(std::shared_ptr<CompletionJob>)> submit;
  std::function<bool()> draining;
};

// Routes: POST /v1/completions (stream: true as server-sent events),
// GET /v1/models, GET /health. Errors in OpenAI's JSON shape: 400 for a bad
// request, 404 for another model or path, 429 when the queue is full, 503
// while draining. One line per request to stderr when `log` is set.
class HttpFrontend {
 public:
  HttpFrontend(FrontendCallbacks callbacks, std::string model, int threads, bool log);
  ~HttpFrontend();
  // Binds (port 0: any free port); throws std::runtime_error when it cannot.
  int bind(const std::string& host, int port);
  void listen();  // serves until stop(); call on a thread of its own
  void stop();    // stops accepting; returns when handlers in flight are done

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::serve
