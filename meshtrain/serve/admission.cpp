#include "meshtrain/serve/admission.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::serve {

Admission::Admission(Handle handle, std::chrono::milliseconds head_timeout, size_t max_head_bytes)
    : handle_(std::move(handle)), head_timeout_(head_timeout), max_head_bytes_(max_head_bytes) {
  if (pipe(wake_) != 0) throw std::runtime_error(std::string("admission: cannot create a pipe: ") + std::strerror(errno));
  thread_ = std::thread([this] { loop(); });
}

Admission::~Admission() {
  stop();
  close(wake_[0]);
  close(wake_[1]);
}

void Admission::add(int socket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopped_) {
      waiting_[socket] = Waiting{std::chrono::steady_clock::now() + head_timeout_, 0};
      const char byte = 0;
      (void)!write(wake_[1], &byte, 1);
      return;
    }
  }
  close_socket(socket);
}

void Admission::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
    const char byte = 0;
    (void)!write(wake_[1], &byte, 1);
  }
  thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [socket, waiting] : waiting_) close_socket(socket);
  waiting_.clear();
}

size_t Admission::refused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

void Admission::close_socket(int socket) {
  shutdown(socket, SHUT_RDWR);
  close(socket);
}

int Admission::inspect(int socket, Waiting& waiting) {
  std::string buffer(max_head_bytes_ + 1, '\0');
  const ssize_t n = recv(socket, buffer.data(), buffer.size(), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return -1;  // closed before a request
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  buffer.resize(static_cast<size_t>(n));
  if (buffer.find("\r\n\r\n") != std::string::npos) return 1;
  if (buffer.size() > max_head_bytes_) return -1;
  // Wake again only when more than these bytes have arrived (Linux honours SO_RCVLOWAT in poll()).
  waiting.seen = buffer.size();
  const int low = static_cast<int>(waiting.seen + 1);
  setsockopt(socket, SOL_SOCKET, SO_RCVLOWAT, &low, sizeof low);
  return 0;
}

void Admission::loop() {
  while (true) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    auto now = std::chrono::steady_clock::now();
    auto next_deadline = now + std::chrono::seconds(60);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (it->second.deadline <= now) {  // the head did not arrive in time
          close_socket(it->first);
          ++refused_;
          it = waiting_.erase(it);
          continue;
        }
        fds.push_back({it->first, POLLIN | POLLRDHUP, 0});
        next_deadline = std::min(next_deadline, it->second.deadline);
        ++it;
      }
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1;
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 1))) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) {
      char drain[64];
      (void)!read(wake_[0], drain, sizeof drain);
    }
    std::vector<int> ready;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto it = waiting_.find(fds[i].fd);
        if (it == waiting_.end()) continue;
        int verdict = inspect(fds[i].fd, it->second);
        if (verdict == 0 && (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) verdict = -1;  // gone half-way
        if (verdict == 0) continue;
        if (verdict < 0) {
          close_socket(fds[i].fd);
          ++refused_;
        } else {
          const int low = 1;  // the server's own reads take whatever has arrived
          setsockopt(fds[i].fd, SOL_SOCKET, SO_RCVLOWAT, &low, sizeof low);
          ready.push_back(fds[i].fd);
        }
        waiting_.erase(it);
      }
    }
    for (int socket : ready) handle_(socket);
  }
}

}  // namespace meshtrain::serve
