// TLS in front of the HTTP server: each accepted connection's handshake and
// records are handled in one poll() loop, and the plaintext is handed on as a
// local socket, so that admission, the handlers and their limits stay as they
// are. See Note [TLS].
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace meshtrain::serve {

struct TlsLimits {
  std::chrono::milliseconds handshake_timeout{10000};  // from the connection to a finished handshake
  std::chrono::milliseconds stall_timeout{30000};      // no byte moved either way
  size_t connections = 1024;                           // at once; more are closed at once
};

// Note [TLS]
// `serve --ssl-certfile F --ssl-keyfile K` (vLLM's names) serves HTTPS. The
// front takes each accepted TCP connection, does the TLS handshake without a
// thread of its own (non-blocking, in one poll() loop for every connection),
// and then hands on one end of a socketpair, through which the connection's
// decrypted bytes flow both ways. Everything behind it (Note [Admission]:
// whole requests before a handler, time and memory bounds, lingering) sees a
// plain socket and is unchanged. A client that never finishes its handshake
// is closed after `handshake_timeout`; one that stops reading or sending
// after `stall_timeout`; plaintext HTTP on the TLS port fails the handshake
// and is closed. An answer sent, the front sends close_notify and its FIN,
// then reads and drops what the client still sends for 2 s before closing,
// as admission lingers (a close with bytes unread would reset the connection
// before the client read the answer). Each direction buffers at most one TLS record (16 KiB): the
// loop reads from a side only once the other has taken what came before, so
// TCP flow control holds a fast sender back. TLS 1.2 or later.
class TlsFront {
 public:
  // Loads the certificate chain and key (PEM); throws std::runtime_error naming
  // the file and OpenSSL's reason. `hand_on` gets the plaintext socket of each
  // connection whose handshake finished, and owns it.
  TlsFront(const std::string& cert_file, const std::string& key_file, std::function<void(int)> hand_on,
           TlsLimits limits = {});
  ~TlsFront();  // stop()
  // Throws as the constructor would for these files: a check before a model loads.
  static void check_files(const std::string& cert_file, const std::string& key_file);
  TlsFront(const TlsFront&) = delete;
  TlsFront& operator=(const TlsFront&) = delete;

  void add(int socket);  // an accepted TCP connection; the front owns it. Any thread.
  // Takes no more connections, closes those with no request yet, and lets the others send what their server
  // side wrote, for up to `timeout`; then stop().
  void finish(std::chrono::milliseconds timeout);
  void stop();           // closes every connection and ends the loop

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::serve
