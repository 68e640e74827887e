// ClientStream: one client connection as cpp-httplib's Stream, its request
// already received (Note [Admission]); and whether that client is still there.
#pragma once

#include <httplib.h>

#include <chrono>
#include <string>

namespace meshtrain::serve {

// Reads come from `request`, the bytes admission received whole, and end
// there (one request per connection): a handler never waits on a client to
// read. Writes go to the socket as httplib's own socket stream sends them,
// each waiting at most `io_timeout`, and fail once the client has gone.
// Does not own the socket.
class ClientStream : public httplib::Stream {
 public:
  ClientStream(int socket, std::chrono::milliseconds io_timeout, std::string request);

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  int socket() const override { return socket_; }

 private:
  int wait_for(short events, std::chrono::milliseconds timeout) const;

  int socket_;
  std::chrono::milliseconds io_timeout_;
  std::string request_;
  size_t read_ = 0;  // bytes of request_ read so far
};

// Whether the client of `socket` has closed its side (or the connection
// broke): what a handler asks while it waits, to stop work nobody will read.
bool client_gone(int socket);

}  // namespace meshtrain::serve
