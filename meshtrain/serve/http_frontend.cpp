#include "meshtrain/serve/http_frontend.h"

#include "meshtrain/serve/admission.h"
#include "meshtrain/serve/client_stream.h"
#include "meshtrain/serve/openai_api.h"

#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

namespace meshtrain::serve {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(200);
constexpr size_t kBodyLimit = size_t{8} << 20;             // bytes of a request body, however it is sent
constexpr auto kHeadTimeout = std::chrono::seconds(10);    // for a request line and headers to arrive (Note [Admission])
constexpr auto kBodyTimeout = std::chrono::seconds(30);    // for the whole request, head to body end
constexpr auto kIoTimeout = std::chrono::seconds(5);       // for any one read or write
constexpr size_t kHeadLimit = 16 << 10;

// The connection this handler thread serves (the socket of GuardedServer::serve).
thread_local int t_client = -1;

// cpp-httplib's server with Note [Admission] in front: a connection reaches
// a handler thread only with its request head in full, and is served as
// one request (Connection: close) through a ClientStream whose reads end at
// kBodyTimeout after admission.
class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(int threads)
      : handlers_(static_cast<size_t>(threads)),
        admission_([this](int socket) { handlers_.enqueue([this, socket] { serve(socket); }); },
                   std::chrono::duration_cast<std::chrono::milliseconds>(kHeadTimeout), kHeadLimit) {
    new_task_queue = [] { return new httplib::ThreadPool(1); };  // accepting only hands sockets to admission
  }
  ~GuardedServer() override { shut_down(); }

  // After stop(): no more connections waiting, handlers finished.
  void shut_down() {
    admission_.stop();
    if (!handlers_down_.exchange(true)) handlers_.shutdown();
  }

 private:
  bool process_and_close_socket(socket_t socket) override {
    admission_.add(socket);
    return true;
  }

  void serve(int socket) {
    ClientStream stream(socket, std::chrono::duration_cast<std::chrono::milliseconds>(kIoTimeout),
                        std::chrono::steady_clock::now() + kBodyTimeout);
    t_client = socket;
    bool closed = false;
    process_request(stream, /*close_connection=*/true, closed, nullptr);
    t_client = -1;
    shutdown(socket, SHUT_RDWR);
    close(socket);
  }

  httplib::ThreadPool handlers_;
  std::atomic<bool> handlers_down_{false};
  Admission admission_;
};

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& type,
                const std::string& param = "") {
  res.status = status;
  res.set_content(error_response(message, type, param), "application/json");
}

std::string event(const std::string& data) { return "data: " + data + "\n\n"; }

}  // namespace

struct HttpFrontend::Impl {
  explicit Impl(int threads) : server(threads) {}
  FrontendCallbacks callbacks;
  std::string model;
  GuardedServer server;
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> in_flight{0};  // completions not yet answered in full
  const int64_t created = static_cast<int64_t>(std::time(nullptr));

  void completions(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content);
  void stream(const std::shared_ptr<CompletionJob>& job, const std::string& id, int64_t created, httplib::Response& res);
};

HttpFrontend::HttpFrontend(FrontendCallbacks callbacks, std::string model, int threads, bool log)
    : impl_(std::make_unique<Impl>(threads)) {
  impl_->callbacks = std::move(callbacks);
  impl_->model = std::move(model);
  Impl* impl = impl_.get();
  httplib::Server& s = impl->server;
  s.set_payload_max_length(kBodyLimit);
  s.set_read_timeout(kIoTimeout);
  s.set_write_timeout(kIoTimeout);
  s.Post("/v1/completions", [impl](const httplib::Request& req, httplib::Response& res,
                                   const httplib::ContentReader& content) { impl->completions(req, res, content); });
  s.Get("/v1/models", [impl](const httplib::Request&, httplib::Response& res) {
    res.set_content(models_response(impl->model, impl->created), "application/json");
  });
  s.Get("/health", [impl](const httplib::Request&, httplib::Response& res) {
    const bool draining = impl->callbacks.draining();
    res.status = draining ? 503 : 200;
    res.set_content(draining ? R"({"status":"draining"})" : R"({"status":"ok"})", "application/json");
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      send_error(res, 404, "no route " + req.method + " " + req.path + "; try POST /v1/completions, GET /v1/models or GET /health",
                 "invalid_request_error");
    } else if (res.status == 413) {
      send_error(res, 413, "the request body is larger than 8 MiB", "invalid_request_error");
    } else {
      send_error(res, res.status, "HTTP status " + std::to_string(res.status), "invalid_request_error");
    }
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, 500, "internal error: " + what, "server_error");
  });
  if (log) {
    s.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "meshtrain serve: %s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
    });
  }
}

HttpFrontend::~HttpFrontend() { stop(); }

int HttpFrontend::bind(const std::string& host, int port) {
  const int bound = port == 0 ? impl_->server.bind_to_any_port(host) : (impl_->server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    throw std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) +
                             " (in use, or not an address of this machine); pick another --port or --host");
  }
  return bound;
}

void HttpFrontend::listen() { impl_->server.listen_after_bind(); }

void HttpFrontend::stop() {
  // Answers being streamed finish first (stopping cuts them off), for at most 30 s.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (impl_->in_flight > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(kPoll / 10);
  if (impl_->server.is_running()) impl_->server.stop();
  impl_->server.shut_down();
}

namespace {

// The request body, read as it comes however it is sent (Content-Length,
// chunked, or to the end): false, with the error response set, when it
// passes kBodyLimit or does not arrive in time.
bool read_body(const httplib::Request& req, const httplib::ContentReader& content, std::string& body,
               httplib::Response& res) {
  const std::string declared = req.get_header_value("Content-Length");
  if (!declared.empty() && declared.find_first_not_of("0123456789") == std::string::npos &&
      (declared.size() > 18 || std::stoull(declared) > kBodyLimit)) {  // refused before a byte is read
    send_error(res, 413, "the request body is larger than 8 MiB", "invalid_request_error");
    return false;
  }
  bool too_large = false;
  const bool ok = content([&](const char* data, size_t length) {
    if (body.size() + length > kBodyLimit) {
      too_large = true;
      return false;
    }
    body.append(data, length);
    return true;
  });
  if (ok) return true;
  if (too_large) {
    send_error(res, 413, "the request body is larger than 8 MiB", "invalid_request_error");
  } else {
    send_error(res, 408, "the request body did not arrive in full in time", "invalid_request_error");
  }
  return false;
}

}  // namespace

void HttpFrontend::Impl::completions(const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& content) {
  std::string body;
  if (!read_body(req, content, body, res)) return;
  CompletionParams params;
  try {
    params = parse_completion_request(body, model);
  } catch (const ApiError& e) {
    return send_error(res, e.status, e.what(), e.type, e.param);
  }
  auto job = std::make_shared<CompletionJob>(params);
  try {
    callbacks.check(*job);
  } catch (const std::invalid_argument& e) {
    return send_error(res, 400, e.what(), "invalid_request_error");
  }
  ++in_flight;
  switch (callbacks.submit(job)) {
    case Submitted::kQueued:
      break;
    case Submitted::kQueueFull:
      --in_flight;
      res.set_header("Retry-After", "1");
      return send_error(res, 429, "the server is busy: its queue is full; retry in a moment", "rate_limit_error");
    case Submitted::kDraining:
      --in_flight;
      return send_error(res, 503, "the server is shutting down", "server_error");
  }
  const std::string id = "cmpl-" + std::to_string(next_id++);
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  if (params.stream) return stream(job, id, now, res);
  std::string text = params.echo ? params.prompt : std::string(), piece;
  const int client = t_client;
  while (job->next(piece, kPoll)) {
    text += piece;
    if (client >= 0 && !job->abandoned && client_gone(client)) job->abandoned = true;  // nobody waits for the answer
  }
  --in_flight;
  if (job->abandoned) {  // nobody reads this; 499 (client closed request) shows in the log
    res.status = 499;
    return;
  }
  if (!job->error().empty()) return send_error(res, 500, job->error(), "server_error");
  res.set_content(completion_response(id, now, model, text, job->finish_reason(),
                                      static_cast<int64_t>(job->prompt_ids.size()), job->completion_tokens()),
                  "application/json");
}

void HttpFrontend::Impl::stream(const std::shared_ptr<CompletionJob>& job, const std::string& id, int64_t created,
                                httplib::Response& res) {
  auto echoed = std::make_shared<bool>(!job->params().echo);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, id, created, echoed](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& data) {
          if (sink.write(data.data(), data.size())) return true;
          job->abandoned = true;  // the client went away
          return false;
        };
        if (!*echoed) {
          *echoed = true;
          if (!send(event(completion_chunk(id, created, model, job->params().prompt, "")))) return false;
        }
        std::string piece;
        const bool more = job->next(piece, kPoll);
        if (!piece.empty() && !send(event(completion_chunk(id, created, model, piece, "")))) return false;
        if (more) return true;
        const std::string last = job->error().empty()
                                     ? completion_chunk(id, created, model, "", job->finish_reason())
                                     : error_response(job->error(), "server_error", "");
        if (!send(event(last)) || !send(event("[DONE]"))) return false;
        sink.done();
        return true;
      },
      [this, job](bool success) {
        if (!success) job->abandoned = true;
        --in_flight;
      });
}

}  // namespace meshtrain::serve
