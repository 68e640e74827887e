// Admission: connections wait here, holding no thread, until their request
// has arrived in full; and refused connections linger here until closed.
// See Note [Admission].
#pragma once

#include "meshtrain/serve/request_framing.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace meshtrain::serve {

struct AdmissionLimits {
  std::chrono::milliseconds head_timeout{10000};     // request line and headers, from the connection
  std::chrono::milliseconds request_timeout{30000};  // the whole request, from the connection
  std::chrono::milliseconds linger{2000};            // reading what a refused client still sends
  size_t head_bytes = 16 << 10;
  size_t body_bytes = 8 << 20;
  size_t budget_bytes = 128 << 20;  // large bodies being received or served, all connections together
  size_t small_body_bytes = 64 << 10;  // bodies up to this size need no share of the budget
  size_t connections = 1024;           // waiting or lingering at once; more are closed at once
};

// Note [Admission]
// A slow or idle client must not hold a handler thread: one sending its
// headers or its body a byte a second would otherwise keep a thread for as
// long as it likes, and a hundred of them lock everyone out. So a new
// connection first waits in one poll() loop that reads its bytes as they
// come, until the request is whole (RequestFraming: the head, then
// Content-Length bytes or the chunks up to the last). Only then does a
// handler thread get it, with the request in memory: the HTTP server reads
// from there and never waits on the client for a byte.
//
// Time: a head not complete within `head_timeout`, or a request not whole
// within `request_timeout`, is answered 408. A head past its limit is
// closed; a body past its limit is handed on as soon as that is known, so
// that the server answers 413 from the bytes received (and reads no more).
//
// Memory: a body larger than `small_body_bytes` is read only once it holds
// a share of `budget_bytes` (its declared length; for chunks, the most
// their framing may take), which it keeps until its handler has finished
// with it (the Share handed on). Bodies holding a share are always read, so
// they finish or time out and give their share back; the others wait, not
// read (their senders held by TCP flow control). Heads and small bodies are
// bounded by `connections` times their limits. So the bytes of requests
// received or being served never pass budget_bytes plus that.
//
// Lingering: a refused client may still be sending (a body refused as too
// large, a timed-out upload); closing the socket with its bytes unread
// would reset the connection and lose the answer. Such a socket is shut for
// writing and handed to this loop, which reads and drops what arrives until
// the client closes or `linger` passes. A client asking for
// "Expect: 100-continue" gets its 100 from here once its head is in and its
// body may be read.
class Admission {
 public:
  // A body's share of the budget, given back when the last copy is destroyed.
  class Share;
  // `request`: the request's bytes (head and body); the callee owns the
  // socket, and keeps `share` until it is done with the request.
  using Handle = std::function<void(int socket, std::string request, std::shared_ptr<Share> share)>;
  Admission(Handle handle, AdmissionLimits limits);
  ~Admission();  // stop()
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Takes ownership of a connected socket. Any thread.
  void add(int socket);
  // Takes ownership of a socket whose answer has been sent (see Lingering). Any thread.
  void linger(int socket);
  // Closes every waiting and lingering connection and ends the loop.
  void stop();
  // Connections closed for a request that came too slowly or too large, or for want of room, so far.
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
    std::shared_ptr<Share> share;  // set once the body may be read
    bool continued = false;        // 100 Continue sent
  };
  void loop();
  // Whether `waiting`'s bytes may be read now: a head, a small body, or a body holding its share.
  bool may_read(int socket, Waiting& waiting);
  // Reads what has arrived on `socket`: the framing's verdict, or kRefuse when the client closed first.
  RequestFraming::Verdict receive(int socket, Waiting& waiting);
  // Answers 408 and lingers connections past their deadlines; closes lingering ones past theirs.
  // The earliest deadline left.
  std::chrono::steady_clock::time_point expire(std::chrono::steady_clock::time_point now);
  void drain_lingering(int socket);
  void give_back(size_t bytes);
  void wake();

  Handle handle_;
  const AdmissionLimits limits_;
  int wake_[2] = {-1, -1};  // a non-blocking pipe: add(), linger(), stop() and freed shares interrupt poll()
  mutable std::mutex mutex_;
  std::map<int, Waiting> waiting_;                                 // protected by mutex_
  std::map<int, std::chrono::steady_clock::time_point> lingering_;  // protected by mutex_
  std::atomic<size_t> shared_{0};  // bytes of budget held by shares: taken by the loop, given back by any thread
  bool stopped_ = false;  // protected by mutex_
  size_t refused_ = 0;    // protected by mutex_
  std::thread thread_;
};

}  // namespace meshtrain::serve
