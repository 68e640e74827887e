// The OpenAI-compatible HTTP API in front of a scheduler (cpp-httplib).
// No libtorch here: the scheduler is reached through callbacks.
#pragma once

#include "meshtrain/serve/completion.h"
#include "meshtrain/text/chat_template.h"
#include "meshtrain/text/tokenizer.h"

#include <functional>
#include <memory>
#include <string>

namespace meshtrain::serve {

struct FrontendCallbacks {
  std::function<void(const CompletionJob&)> check;  // throws std::invalid_argument: a 400 with its message
  std::function<Submitted(std::vector<std::shared_ptr<CompletionJob>>)> submit;  // all of a request's, or none
  std::function<bool()> draining;
};

// What the front end knows of the model it serves.
struct ServedModel {
  std::string name;
  const text::Tokenizer* tokenizer = nullptr;
  const text::ChatTemplate* chat = nullptr;  // null: no chat template
  int64_t context = 0;
};

// Routes: POST /v1/completions and /v1/chat/completions (stream: true as
// server-sent events), GET /v1/models and /v1/models/{name}, POST /tokenize
// and /detokenize, GET /tokenizer_info (vLLM's), GET /health. Errors in
// OpenAI's JSON shape: 400 for a bad request, 404 for another model or
// path, 429 when the queue is full, 503 while draining. One line per
// request to stderr when `log` is set. With an `api_key`, every /v1 route
// answers 401 unless the request carries `Authorization: Bearer <api_key>`
// (Note [API key]).
class HttpFrontend {
 public:
  HttpFrontend(FrontendCallbacks callbacks, ServedModel model, int threads, bool log, std::string api_key = "");
  ~HttpFrontend();
  // Binds (port 0: any free port); throws std::runtime_error when it cannot.
  int bind(const std::string& host, int port);
  // Serves HTTPS with this certificate chain and key (PEM files; Note [TLS]); before listen().
  // Throws std::runtime_error naming the file that cannot be used.
  void use_tls(const std::string& cert_file, const std::string& key_file);
  void listen();  // serves until stop(); call on a thread of its own
  void stop();    // stops accepting; returns when handlers in flight are done

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::serve
