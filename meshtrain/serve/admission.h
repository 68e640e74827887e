// Admission: connections wait here, holding no thread, until their request
// head has arrived in full. See Note [Admission].
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace meshtrain::serve {

// Note [Admission]
// A slow or idle client must not hold a handler thread: one sending its
// headers a byte a second would otherwise keep a thread for as long as it
// likes, and a hundred of them lock everyone out. So a new connection first
// waits in one poll() loop until its request line and headers (up to the
// blank line) have arrived, seen with recv(MSG_PEEK) so that the HTTP server
// still reads them itself; SO_RCVLOWAT makes poll() wake only when more
// bytes than the last peek saw have come. A head complete within
// `head_timeout` is handed to `handle` (on a handler thread); a connection
// whose head does not arrive in time, grows past `max_head_bytes`, or closes
// is closed here. Beyond the head, the server's read and write timeouts and
// the body deadline (http_frontend.cpp) bound the time a handler can wait.
class Admission {
 public:
  using Handle = std::function<void(int socket)>;
  Admission(Handle handle, std::chrono::milliseconds head_timeout, size_t max_head_bytes);
  ~Admission();  // stop()
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Takes ownership of a connected socket. Any thread.
  void add(int socket);
  // Closes every waiting connection and ends the loop.
  void stop();
  // Connections closed for a head that came too slowly or too large, so far.
  size_t refused() const;

 private:
  struct Waiting {
    std::chrono::steady_clock::time_point deadline;
    size_t seen = 0;  // bytes of head peeked so far
  };
  void loop();
  // Peeks at `socket`'s bytes: 1 the head is complete, 0 not yet, -1 give up.
  int inspect(int socket, Waiting& waiting);
  void close_socket(int socket);

  Handle handle_;
  const std::chrono::milliseconds head_timeout_;
  const size_t max_head_bytes_;
  int wake_[2] = {-1, -1};  // a pipe: add() and stop() interrupt poll()
  mutable std::mutex mutex_;
  std::map<int, Waiting> waiting_;  // protected by mutex_
  bool stopped_ = false;            // protected by mutex_
  size_t refused_ = 0;              // protected by mutex_
  std::thread thread_;
};

}  // namespace meshtrain::serve
