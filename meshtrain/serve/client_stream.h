// ClientStream: one client connection as cpp-httplib's Stream, with a read
// deadline for the whole request; and whether that client is still there.
#pragma once

#include <httplib.h>

#include <chrono>
#include <string>
#include <vector>

namespace meshtrain::serve {

// Reads and writes a connected socket as httplib's own socket stream does
// (each read or write waits at most `io_timeout`), and refuses to read past
// `read_deadline`: a body sent a byte at a time cannot hold the handler
// thread longer than that. Does not own the socket.
class ClientStream : public httplib::Stream {
 public:
  ClientStream(int socket, std::chrono::milliseconds io_timeout, std::chrono::steady_clock::time_point read_deadline);

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
  std::chrono::steady_clock::time_point read_deadline_;
  std::vector<char> buffer_;  // read ahead, as httplib's SocketStream does
  size_t buffer_begin_ = 0, buffer_end_ = 0;
};

// Whether the client of `socket` has closed its side (or the connection
// broke): what a handler asks while it waits, to stop work nobody will read.
bool client_gone(int socket);

}  // namespace meshtrain::serve
