// What the HTTP front end's server (http_frontend.cpp) and its endpoint
// handlers (api_handlers.cpp, tokenizer_handlers.cpp) share.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/serve/http_frontend.h"
#include "meshtrain/serve/openai_api.h"

namespace meshtrain::serve {

constexpr auto kPoll = std::chrono::milliseconds(200);
constexpr size_t kBodyLimit = size_t{8} << 20;  // bytes of a request body, however it is sent

class GuardedServer;

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& type,
                const std::string& param = "");
std::string event(const std::string& data);
// The socket of the connection this handler thread serves, or -1.
int current_client();
// The request body, read as it comes however it is sent (Content-Length,
// chunked, or to the end): false, with the error response set, when it
// passes kBodyLimit or does not arrive in time.
bool read_body(const httplib::Request& req, const httplib::ContentReader& content, std::string& body,
               httplib::Response& res);

// One API request's generations: n per prompt, each a job, and what the
// answer needs of each.
struct Generation {
  struct One {
    std::shared_ptr<CompletionJob> job;
    int64_t index = 0;                  // the choice's index
    std::string prefix;                 // the echoed prompt text
    std::vector<TokenLogprob> tokens;   // the generated tokens (logprobs asked)
    std::string text;
    bool finished = false, started = false;
  };
  std::vector<One> ones;
  int64_t prompt_tokens = 0;
  bool chat = false, echo = false;
};

struct HttpFrontend::Impl {
  explicit Impl(int threads);
  ~Impl();
  FrontendCallbacks callbacks;
  ServedModel model;
  std::unique_ptr<GuardedServer> guarded;
  httplib::Server* server = nullptr;
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> in_flight{0};  // generations not yet answered in full
  const int64_t created = static_cast<int64_t>(std::time(nullptr));

  void completions(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content);
  void chat(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content);
  void tokenize(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content);
  void detokenize(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content);
  void tokenizer_info(httplib::Response& res);

  // Checks and submits every job; false (the response set) when one is refused.
  bool start(Generation& g, httplib::Response& res);
  void answer(Generation& g, httplib::Response& res);
  void stream(std::shared_ptr<Generation> g, bool include_usage, httplib::Response& res);
  ojson logprobs_of(const Generation& g, const Generation::One& one, const std::vector<TokenLogprob>& tokens,
                    bool with_prompt) const;
};

}  // namespace meshtrain::serve
