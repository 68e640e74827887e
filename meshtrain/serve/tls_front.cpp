#include "meshtrain/serve/tls_front.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <csignal>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace meshtrain::serve {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kRecord = 16 << 10;  // one TLS record's plaintext
constexpr auto kLinger = std::chrono::seconds(2);  // reading what a client still sends after its answer

std::string openssl_reason() {
  const unsigned long code = ERR_get_error();
  char text[256] = "unknown";
  if (code != 0) ERR_error_string_n(code, text, sizeof text);
  ERR_clear_error();
  return text;
}

// A server context of TLS 1.2 or later with the certificate chain and its key; throws naming the file at fault.
SSL_CTX* load_context(const std::string& cert_file, const std::string& key_file) {
  SSL_CTX* context = SSL_CTX_new(TLS_server_method());
  if (!context) throw std::runtime_error("TLS: " + openssl_reason());
  SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION);
  SSL_CTX_set_mode(context, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(context, cert_file.c_str()) != 1) {
    const std::string reason = openssl_reason();
    SSL_CTX_free(context);
    throw std::runtime_error("--ssl-certfile " + cert_file + ": not a PEM certificate chain (" + reason + ")");
  }
  if (SSL_CTX_use_PrivateKey_file(context, key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(context) != 1) {
    const std::string reason = openssl_reason();
    SSL_CTX_free(context);
    throw std::runtime_error("--ssl-keyfile " + key_file + ": not the PEM private key of --ssl-certfile " + cert_file +
                             " (" + reason + ")");
  }
  return context;
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }


// The client has bytes of ours it has not taken.
}  // namespace

// One client: its TCP socket and TLS session, our end of the plaintext pair, and what waits to go each way.
struct TlsConnection {
  int tcp = -1;
  int plain = -1;  // -1: the handshake is not done; -2: closed (lingering)
  SSL* ssl = nullptr;
  // Of the handshake; then, while the client has bytes of ours to take, of its next read; then of lingering.
  std::chrono::steady_clock::time_point deadline;
  std::string to_plain, to_tcp;
  bool tcp_done = false;       // the client sent close_notify or closed
  bool plain_done = false;     // the server side has finished writing (its answer is all in to_tcp or sent)
  bool plain_gone = false;     // the server side reads no more: what the client sends is dropped
  bool closing_sent = false;   // our close_notify is out, and our FIN
  bool lingering = false;      // the answer is out; the client's last bytes are read and dropped (Note [TLS])
  bool want_tcp_write = false; // the last TLS operation waits for the socket to take bytes
  bool broken = false;         // a TLS or socket failure: closed without more ado
  size_t moved = 0;            // bytes moved either way, so far
};

struct TlsFront::Impl {
  std::function<void(int)> hand_on;
  TlsLimits limits;
  SSL_CTX* context = nullptr;
  std::mutex mutex;
  std::vector<int> added;  // accepted, not yet in the loop
  bool stopped = false;
  int wake_pipe[2] = {-1, -1};
  std::thread thread;
  std::map<int, TlsConnection> connections;  // by TCP socket; the loop's own
  bool finishing = false;                    // under mutex: no new connections, no new handshakes
  std::atomic<size_t> open{0};               // connections.size(), for finish()

  void wake() { (void)!write(wake_pipe[1], "x", 1); }
  void loop();
  void take_added();
  void step(TlsConnection& c, short tcp_events, short plain_events, Clock::time_point now);
  bool handshake(TlsConnection& c, Clock::time_point now);
  void pump_in(TlsConnection& c);
  void pump_out(TlsConnection& c);
  void close(TlsConnection& c);
  int tls_error(TlsConnection& c, int result);
  // The client has bytes of ours it has not taken.
  static bool waits_on_client(const TlsConnection& c) { return !c.to_tcp.empty() || c.want_tcp_write; }
};

TlsFront::TlsFront(const std::string& cert_file, const std::string& key_file, std::function<void(int)> hand_on,
                   TlsLimits limits)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.hand_on = std::move(hand_on);
  m.limits = limits;
  m.context = load_context(cert_file, key_file);
  if (pipe(m.wake_pipe) != 0) {
    SSL_CTX_free(m.context);
    throw std::runtime_error("TLS: pipe failed");
  }
  // A client gone mid-answer must fail a write, not end the process (OpenSSL writes with write(2)).
  std::signal(SIGPIPE, SIG_IGN);
  set_nonblocking(m.wake_pipe[0]);
  set_nonblocking(m.wake_pipe[1]);
  m.thread = std::thread([&m] { m.loop(); });
}

void TlsFront::check_files(const std::string& cert_file, const std::string& key_file) {
  SSL_CTX_free(load_context(cert_file, key_file));
}

TlsFront::~TlsFront() {
  stop();
  ::close(impl_->wake_pipe[0]);
  ::close(impl_->wake_pipe[1]);
  SSL_CTX_free(impl_->context);
}

void TlsFront::add(int socket) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (!impl_->stopped) {
      impl_->added.push_back(socket);
      impl_->wake();
      return;
    }
  }
  ::close(socket);
}

void TlsFront::finish(std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->stopped) return;
    impl_->finishing = true;
    impl_->wake();
  }
  const auto deadline = Clock::now() + timeout;
  while (impl_->open > 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  stop();
}

void TlsFront::stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->stopped) return;
    impl_->stopped = true;
    impl_->wake();
  }
  impl_->thread.join();
  for (int socket : impl_->added) ::close(socket);
  impl_->added.clear();
  for (auto& entry : impl_->connections) impl_->close(entry.second);
  impl_->connections.clear();
}

void TlsFront::Impl::take_added() {
  std::vector<int> sockets;
  bool closing;
  {
    std::lock_guard<std::mutex> lock(mutex);
    sockets.swap(added);
    closing = finishing;
  }
  for (int socket : sockets) {
    SSL* ssl = !closing && connections.size() < limits.connections ? SSL_new(context) : nullptr;
    ERR_clear_error();
    if (!ssl) {
      ::close(socket);
      continue;
    }
    set_nonblocking(socket);
    SSL_set_fd(ssl, socket);
    TlsConnection c;
    c.tcp = socket;
    c.ssl = ssl;
    c.deadline = Clock::now() + limits.handshake_timeout;
    connections[socket] = std::move(c);
  }
}

void TlsFront::Impl::close(TlsConnection& c) {
  if (c.ssl) SSL_free(c.ssl);
  c.ssl = nullptr;
  if (c.tcp >= 0) ::close(c.tcp);
  if (c.plain >= 0) ::close(c.plain);
  c.tcp = c.plain = -1;
  c.plain = -2;
}

// 0 when `result` of a TLS call waits for the socket (noting a wait to write); else the failure's SSL_ERROR_*.
int TlsFront::Impl::tls_error(TlsConnection& c, int result) {
  const int error = SSL_get_error(c.ssl, result);
  ERR_clear_error();
  if (error == SSL_ERROR_WANT_READ) return 0;
  if (error == SSL_ERROR_WANT_WRITE) {
    c.want_tcp_write = true;
    return 0;
  }
  return error;
}

bool TlsFront::Impl::handshake(TlsConnection& c, Clock::time_point now) {
  c.want_tcp_write = false;
  const int result = SSL_accept(c.ssl);
  if (result != 1) return tls_error(c, result) == 0;
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return false;
  set_nonblocking(pair[1]);
  c.plain = pair[1];
  c.deadline = now + limits.stall_timeout;
  hand_on(pair[0]);
  return true;
}

// Client -> server: one record's plaintext at a time, once the last has been taken (or dropped, when the
// server side reads no more).
void TlsFront::Impl::pump_in(TlsConnection& c) {
  while (!c.tcp_done) {
    if (!c.to_plain.empty()) {
      const ssize_t n = send(c.plain, c.to_plain.data(), c.to_plain.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) {  // the server side has closed: its answer may still be queued, so only this direction ends
        c.plain_gone = true;
        c.to_plain.clear();
        continue;
      }
      c.to_plain.erase(0, static_cast<size_t>(n));
      c.moved += static_cast<size_t>(n);
      continue;
    }
    char buffer[kRecord];
    c.want_tcp_write = false;
    const int n = SSL_read(c.ssl, buffer, sizeof buffer);
    if (n > 0) {
      if (!c.plain_gone) c.to_plain.assign(buffer, static_cast<size_t>(n));
      c.moved += static_cast<size_t>(n);
      continue;
    }
    const int error = tls_error(c, n);
    if (error == 0) return;
    // close_notify, a closed socket or a broken record: no more from the client.
    c.tcp_done = true;
    if (error != SSL_ERROR_ZERO_RETURN && !c.lingering) c.broken = true;
    if (!c.plain_gone) shutdown(c.plain, SHUT_WR);
  }
}

// Server -> client: what the server wrote, a record at a time; then our close_notify.
void TlsFront::Impl::pump_out(TlsConnection& c) {
  while (true) {
    if (!c.to_tcp.empty()) {
      c.want_tcp_write = false;
      const int n = SSL_write(c.ssl, c.to_tcp.data(), static_cast<int>(c.to_tcp.size()));
      if (n <= 0) {
        if (tls_error(c, n)) c.broken = true;
        return;
      }
      c.to_tcp.erase(0, static_cast<size_t>(n));
      c.moved += static_cast<size_t>(n);
      continue;
    }
    if (c.plain_done) break;
    char buffer[kRecord];
    const ssize_t n = recv(c.plain, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      c.plain_done = true;
      break;
    }
    c.to_tcp.assign(buffer, static_cast<size_t>(n));
    c.moved += static_cast<size_t>(n);
  }
  if (!c.closing_sent && c.to_tcp.empty()) {
    c.closing_sent = true;
    (void)SSL_shutdown(c.ssl);  // best effort: the answer is complete either way (Connection: close)
    ERR_clear_error();
    shutdown(c.tcp, SHUT_WR);
  }
}

void TlsFront::Impl::step(TlsConnection& c, short tcp_events, short plain_events, Clock::time_point now) {
  if (c.plain == -1) {  // in its handshake
    if (!handshake(c, now) || (c.plain == -1 && now >= c.deadline)) return close(c);
    if (c.plain == -1) return;
    tcp_events = POLLIN;  // the client's first request may have come with its last handshake message
  }
  const size_t before = c.moved;
  if (tcp_events || plain_events) {
    pump_in(c);
    if (!c.broken) pump_out(c);
  }
  if (c.broken || (c.closing_sent && c.tcp_done)) return close(c);
  if (c.closing_sent && !c.lingering) {
    // The answer is out. Closing now, with bytes of the client's unread (a refused upload), would reset the
    // connection, and the client might never read the answer: what it still sends is read and dropped for a
    // while, as admission lingers (Note [Admission]).
    c.lingering = c.plain_gone = true;
    c.to_plain.clear();
    ::close(c.plain);
    c.plain = -2;  // handed on and closed: not a connection in its handshake
    c.deadline = now + kLinger;
    return;
  }
  // Only a client that does not take our bytes is timed here: a server computing a long answer is not a stall,
  // and a client slow to send its request meets admission's deadlines behind us.
  if (!c.lingering && (c.moved != before || !waits_on_client(c))) c.deadline = now + limits.stall_timeout;
  if (now >= c.deadline) close(c);
}

void TlsFront::Impl::loop() {
  bool warned = false;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stopped) return;
    }
    take_added();
    // Only the sockets the loop would act on now are polled: one it would not read (the other side has not
    // taken the last record) is left out, so that its readiness, or its hang-up, cannot spin the loop.
    std::vector<pollfd> fds{{wake_pipe[0], POLLIN, 0}};
    std::vector<std::pair<int, bool>> owner;  // per polled fd after the first: (connection, is the tcp side)
    Clock::time_point next = Clock::now() + std::chrono::seconds(1);
    for (auto& [socket, c] : connections) {
      const bool handshaking = c.plain == -1;
      short tcp = handshaking || (!c.tcp_done && c.to_plain.empty()) ? POLLIN : 0;
      if (c.want_tcp_write) tcp |= POLLOUT;
      short plain = c.plain >= 0 && !c.to_plain.empty() ? POLLOUT : 0;
      if (c.plain >= 0 && c.to_tcp.empty() && !c.plain_done) plain |= POLLIN;
      if (tcp) fds.push_back({c.tcp, tcp, 0}), owner.emplace_back(socket, true);
      if (plain) fds.push_back({c.plain, plain, 0}), owner.emplace_back(socket, false);
      if (handshaking || c.lingering || waits_on_client(c)) next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0) + 1)) < 0 && errno != EINTR) {
      if (!warned) std::fprintf(stderr, "meshtrain serve: TLS: poll failed (%s); retrying\n", std::strerror(errno));
      warned = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (fds[0].revents) {
      char drain[64];
      while (read(wake_pipe[0], drain, sizeof drain) > 0) {
      }
    }
    std::map<int, std::pair<short, short>> events;  // connection -> (tcp, plain) revents
    for (size_t i = 0; i < owner.size(); ++i) {
      auto& e = events[owner[i].first];
      (owner[i].second ? e.first : e.second) |= fds[i + 1].revents;
    }
    bool closing;
    {
      std::lock_guard<std::mutex> lock(mutex);
      closing = finishing;
    }
    const Clock::time_point now = Clock::now();
    for (auto it = connections.begin(); it != connections.end();) {
      TlsConnection& c = it->second;
      if (closing && c.plain == -1) close(c);  // finishing: no request has come on it, none will be served
      else step(c, events[it->first].first, events[it->first].second, now);
      it = c.tcp < 0 ? connections.erase(it) : std::next(it);
    }
    open = connections.size();
  }
}

}  // namespace meshtrain::serve
