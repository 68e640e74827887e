// Admission: connections wait here, holding no thread, until their request
// has arrived in full. See Note [Admission].
#pragma once

#include "meshtrain/serve/request_framing.h"

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace meshtrain::serve {

struct AdmissionLimits {
  std::chrono::milliseconds head_timeout{10000};     // request line and headers, from the connection
  std::chrono::milliseconds request_timeout{30000};  // the whole request, from the connection
  size_t head_bytes = 16 << 10;
  size_t body_bytes = 8 << 20;
  size_t buffered_bytes = 128 << 20;  // requests being received, all connections together
};

// Note [Admission]
// A slow or idle client must not hold a handler thread: one sending its
// headers or its body a byte a second would otherwise keep a thread for as
// long as it likes, and a hundred of them lock everyone out. So a new
// connection first waits in one poll() loop that reads its bytes as they
// come, until the request is whole (RequestFraming: the head, then
// Content-Length bytes or the chunks up to the last). Only then does a
// handler thread get it, with the request in memory: the HTTP server reads
// from there and never waits on the client for a byte. A request whose head
// is not complete within `head_timeout`, or that is not whole within
// `request_timeout`, is answered 408 and closed here; a head past its limit
// is closed; a body past its limit is handed on as soon as that is known, so
// that the server answers 413 from the bytes received (and reads no more).
// Memory is bounded: a connection holds at most RequestFraming::byte_limit()
// bytes, and while the bytes held for all connections pass `buffered_bytes`,
// bodies are not read (the senders wait, by TCP flow control, until others
// finish or time out); heads are read still. A client asking for
// "Expect: 100-continue" gets its 100 from here, once its head is in.
class Admission {
 public:
  // `request`: the request's bytes (head and body); the callee owns the socket.
  using Handle = std::function<void(int socket, std::string request)>;
  Admission(Handle handle, AdmissionLimits limits);
  ~Admission();  // stop()
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Takes ownership of a connected socket. Any thread.
  void add(int socket);
  // Closes every waiting connection and ends the loop.
  void stop();
  // Connections closed for a request that came too slowly or too large, so far.
  size_t refused() const;

 private:
  struct Waiting {
    Waiting(std::chrono::steady_clock::time_point start, const AdmissionLimits& limits)
        : head_deadline(start + limits.head_timeout),
          request_deadline(start + limits.request_timeout),
          framing(limits.head_bytes, limits.body_bytes) {}
    std::chrono::steady_clock::time_point head_deadline, request_deadline;
    std::string bytes;
    RequestFraming framing;
    bool continued = false;  // 100 Continue sent
  };
  void loop();
  // Reads what has arrived on `socket`: the framing's verdict, or kRefuse when the client closed first.
  RequestFraming::Verdict receive(int socket, Waiting& waiting);
  // Closes connections past their deadlines (408); the earliest deadline left.
  std::chrono::steady_clock::time_point expire(std::chrono::steady_clock::time_point now);
  void close_socket(int socket);

  Handle handle_;
  const AdmissionLimits limits_;
  int wake_[2] = {-1, -1};  // a pipe: add() and stop() interrupt poll()
  mutable std::mutex mutex_;
  std::map<int, Waiting> waiting_;  // protected by mutex_
  size_t buffered_ = 0;             // bytes in waiting_, protected by mutex_
  bool stopped_ = false;            // protected by mutex_
  size_t refused_ = 0;              // protected by mutex_
  std::thread thread_;
};

}  // namespace meshtrain::serve
