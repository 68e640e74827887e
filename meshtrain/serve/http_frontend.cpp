#include "meshtrain/serve/http_frontend.h"

#include "meshtrain/serve/admission.h"
#include "meshtrain/serve/client_stream.h"
#include "meshtrain/serve/frontend_impl.h"
#include "meshtrain/serve/tls_front.h"

#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

namespace meshtrain::serve {

namespace {

constexpr auto kIoTimeout = std::chrono::seconds(5);  // for any one write to a client

// The connection this handler thread serves (the socket of GuardedServer::serve).
thread_local int t_client = -1;

}  // namespace

// cpp-httplib's server with Note [Admission] in front: a connection reaches
// a handler thread only with its request in full, and is served as one
// request (Connection: close) through a ClientStream that reads it from memory.
class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(int threads)
      : handlers_(static_cast<size_t>(threads)),
        admission_(
            [this](int socket, std::string request, std::shared_ptr<Admission::Share> share) {
              handlers_.enqueue([this, socket, request = std::move(request), share = std::move(share)]() mutable {
                serve(socket, std::move(request), std::move(share));
              });
            },
            admission_limits()) {
    new_task_queue = [] { return new httplib::ThreadPool(1); };  // accepting only hands sockets to admission
  }
  ~GuardedServer() override { shut_down(); }

  // HTTPS from here on (Note [TLS]): accepted connections go through the TLS front to admission.
  void use_tls(const std::string& cert_file, const std::string& key_file) {
    tls_ = std::make_unique<TlsFront>(cert_file, key_file, [this](int socket) { admission_.add(socket); });
  }

  // After stop(): no more connections waiting, handlers finished.
  void shut_down() {
    admission_.stop();
    if (!handlers_down_.exchange(true)) handlers_.shutdown();
    if (tls_) tls_->finish(std::chrono::seconds(5));  // the answers written, sent
  }

 private:
  bool process_and_close_socket(socket_t socket) override {
    if (tls_) tls_->add(socket);
    else admission_.add(socket);
    return true;
  }

  static AdmissionLimits admission_limits() {
    AdmissionLimits limits;
    limits.body_bytes = kBodyLimit;
    return limits;
  }

  void serve(int socket, std::string request, std::shared_ptr<Admission::Share> share) {
    {  // the request's bytes, and their share of the budget, are given back before the socket is
      ClientStream stream(socket, std::chrono::duration_cast<std::chrono::milliseconds>(kIoTimeout), std::move(request));
      t_client = socket;
      bool closed = false;
      process_request(stream, /*close_connection=*/true, closed, nullptr);
      t_client = -1;
    }
    share.reset();
    // A client still sending (a body refused as too large) would get a reset
    // instead of the answer if the socket closed with its bytes unread: it
    // lingers in admission's loop (Note [Admission]).
    pollfd fd{socket, POLLIN, 0};
    if (poll(&fd, 1, 0) > 0 && (fd.revents & POLLIN)) return admission_.linger(socket);
    shutdown(socket, SHUT_RDWR);
    close(socket);
  }

  httplib::ThreadPool handlers_;
  std::atomic<bool> handlers_down_{false};
  Admission admission_;
  std::unique_ptr<TlsFront> tls_;  // null: plain HTTP
};

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& type,
                const std::string& param) {
  res.status = status;
  res.set_content(error_response(message, type, param), "application/json");
}

std::string event(const std::string& data) { return "data: " + data + "\n\n"; }

int current_client() { return t_client; }

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
  } else {  // admission hands on only whole requests: what is missing never came
    send_error(res, 400, "the request body ended before its declared length or last chunk", "invalid_request_error");
  }
  return false;
}


HttpFrontend::Impl::Impl(int threads) : guarded(std::make_unique<GuardedServer>(threads)), server(guarded.get()) {}
HttpFrontend::Impl::~Impl() = default;

namespace {

void routes(HttpFrontend::Impl* impl, httplib::Server& s) {
  using Reader = httplib::ContentReader;
  s.Post("/v1/completions", [impl](const httplib::Request& req, httplib::Response& res, const Reader& content) {
    impl->completions(req, res, content);
  });
  s.Post("/v1/chat/completions", [impl](const httplib::Request& req, httplib::Response& res, const Reader& content) {
    impl->chat(req, res, content);
  });
  s.Post("/tokenize", [impl](const httplib::Request& req, httplib::Response& res, const Reader& content) {
    impl->tokenize(req, res, content);
  });
  s.Post("/detokenize", [impl](const httplib::Request& req, httplib::Response& res, const Reader& content) {
    impl->detokenize(req, res, content);
  });
  s.Get("/tokenizer_info", [impl](const httplib::Request&, httplib::Response& res) { impl->tokenizer_info(res); });
  s.Get("/v1/models", [impl](const httplib::Request&, httplib::Response& res) {
    res.set_content(models_response(impl->model.name, impl->created), "application/json");
  });
  s.Get(R"(/v1/models/(.+))", [impl](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != impl->model.name) {
      return send_error(res, 404, "the model '" + std::string(req.matches[1]) + "' does not exist; this server serves '" +
                                      impl->model.name + "'", "invalid_request_error", "model");
    }
    res.set_content(model_response(impl->model.name, impl->created), "application/json");
  });
}

}  // namespace

// Note [API key]
// As vLLM's --api-key: the OpenAI clients send `Authorization: Bearer KEY`;
// a request to a /v1 route (the model's: models, completions, chat) without
// it, or with another key, gets 401 in OpenAI's error shape before the route
// runs. As there, the routes outside /v1 stay open: /health for load
// balancers, and /tokenize, /detokenize and /tokenizer_info, which hold only
// the tokenizer and which lm-eval's remote tokenizer calls without a key. The key
// is compared in time independent of where it differs, and never printed
// (the request log has the client's address, method, path and status; the launcher masks it
// in the command line it prints).
bool authorized(const httplib::Request& req, const std::string& key) {
  const std::string header = req.get_header_value("Authorization");
  const std::string expected = "Bearer " + key;
  unsigned char differ = header.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    differ |= static_cast<unsigned char>(expected[i] ^ (i < header.size() ? header[i] : 0));
  }
  return differ == 0;
}

HttpFrontend::HttpFrontend(FrontendCallbacks callbacks, ServedModel model, int threads, bool log, std::string api_key)
    : impl_(std::make_unique<Impl>(threads)) {
  impl_->callbacks = std::move(callbacks);
  impl_->model = std::move(model);
  Impl* impl = impl_.get();
  httplib::Server& s = *impl->server;
  s.set_payload_max_length(kBodyLimit);
  s.set_write_timeout(kIoTimeout);
  // Admission sent the 100 already where the body may come; a body declared too large gets its 413, not a 100.
  s.set_expect_100_continue_handler([](const httplib::Request& req, httplib::Response& res) {
    const std::string declared = req.get_header_value("Content-Length");
    if (!declared.empty() && declared.find_first_not_of("0123456789") == std::string::npos &&
        (declared.size() > 18 || std::stoull(declared) > kBodyLimit)) {
      send_error(res, 413, "the request body is larger than 8 MiB", "invalid_request_error");
      return 413;
    }
    return 100;
  });
  if (!api_key.empty()) {
    s.set_pre_routing_handler([key = std::move(api_key)](const httplib::Request& req, httplib::Response& res) {
      const bool guarded = req.path == "/v1" || req.path.rfind("/v1/", 0) == 0;
      if (!guarded || authorized(req, key)) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, 401,
                 req.has_header("Authorization") ? "the API key is not this server's"
                                                 : "this server needs an API key: send 'Authorization: Bearer <key>' "
                                                   "(the OpenAI clients' api_key)",
                 "invalid_request_error", "api_key");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  routes(impl, s);
  s.Get("/health", [impl](const httplib::Request&, httplib::Response& res) {
    const bool draining = impl->callbacks.draining();
    res.status = draining ? 503 : 200;
    res.set_content(draining ? R"({"status":"draining"})" : R"({"status":"ok"})", "application/json");
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      send_error(res, 404, "no route " + req.method + " " + req.path + "; try POST /v1/completions, POST /v1/chat/completions, GET /v1/models or GET /health",
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
    // The client's address and port, where the connection has one (not a TLS front's local socket).
    s.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      const std::string client =
          req.remote_addr.empty() ? "" : req.remote_addr + ":" + std::to_string(req.remote_port) + " ";
      std::fprintf(stderr, "meshtrain serve: %s%s %s %d\n", client.c_str(), req.method.c_str(), req.path.c_str(),
                   res.status);
    });
  }
}

HttpFrontend::~HttpFrontend() { stop(); }

int HttpFrontend::bind(const std::string& host, int port) {
  httplib::Server& s = *impl_->server;
  const int bound = port == 0 ? s.bind_to_any_port(host) : (s.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    throw std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) +
                             " (in use, or not an address of this machine); pick another --port or --host");
  }
  return bound;
}

void HttpFrontend::use_tls(const std::string& cert_file, const std::string& key_file) {
  impl_->guarded->use_tls(cert_file, key_file);
}

void HttpFrontend::listen() { impl_->server->listen_after_bind(); }

void HttpFrontend::stop() {
  // Answers being streamed finish first (stopping cuts them off), for at most 30 s.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (impl_->in_flight > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(kPoll / 10);
  if (impl_->server->is_running()) impl_->server->stop();
  impl_->guarded->shut_down();
}

}  // namespace meshtrain::serve
