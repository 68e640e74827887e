#include "meshtrain/serve/client_stream.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace meshtrain::serve {

namespace {

void ip_and_port(const sockaddr_storage& addr, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
    inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
    port = ntohs(a.sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof text);
    port = ntohs(a.sin6_port);
  }
  ip = text;
}

}  // namespace

ClientStream::ClientStream(int socket, std::chrono::milliseconds io_timeout, std::string request)
    : socket_(socket), io_timeout_(io_timeout), request_(std::move(request)) {}

int ClientStream::wait_for(short events, std::chrono::milliseconds timeout) const {
  pollfd fd{socket_, events, 0};
  int n;
  do {
    n = poll(&fd, 1, static_cast<int>(std::max<int64_t>(timeout.count(), 0)));
  } while (n < 0 && errno == EINTR);
  return n;
}

bool ClientStream::is_readable() const { return read_ < request_.size(); }

bool ClientStream::is_writable() const { return wait_for(POLLOUT, io_timeout_) > 0 && !client_gone(socket_); }

ssize_t ClientStream::read(char* ptr, size_t size) {
  const size_t n = std::min(size, request_.size() - read_);
  std::memcpy(ptr, request_.data() + read_, n);
  read_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t ClientStream::write(const char* ptr, size_t size) {
  if (!is_writable()) return -1;
  ssize_t n;
  do {
    n = send(socket_, ptr, size, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n;
}

void ClientStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t length = sizeof addr;
  if (getpeername(socket_, reinterpret_cast<sockaddr*>(&addr), &length) == 0) ip_and_port(addr, ip, port);
}

void ClientStream::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t length = sizeof addr;
  if (getsockname(socket_, reinterpret_cast<sockaddr*>(&addr), &length) == 0) ip_and_port(addr, ip, port);
}

bool client_gone(int socket) {
  pollfd fd{socket, POLLIN | POLLRDHUP, 0};
  if (poll(&fd, 1, 0) <= 0) return false;
  if (fd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  char byte;
  return recv(socket, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace meshtrain::serve
