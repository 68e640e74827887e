#include "meshtrain/serve/admission.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace meshtrain::serve {

namespace {

using Clock = std::chrono::steady_clock;
using Verdict = RequestFraming::Verdict;

constexpr size_t kReadPerWake = 1 << 20;  // per connection and wake, so one fast sender cannot starve the rest

// Best effort: the client may be gone, or not reading.
void send_now(int socket, const std::string& bytes) {
  (void)!send(socket, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

std::string timeout_response(bool head_complete) {
  const std::string message = head_complete ? "the request body did not arrive in full in time"
                                            : "the request's headers did not arrive in full in time";
  const std::string body = R"({"error":{"message":")" + message +
                           R"(","type":"invalid_request_error","param":null,"code":null}})";
  return "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace

Admission::Admission(Handle handle, AdmissionLimits limits) : handle_(std::move(handle)), limits_(limits) {
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
      waiting_.emplace(socket, Waiting(Clock::now(), limits_));
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
  for (const auto& entry : waiting_) close_socket(entry.first);
  waiting_.clear();
  buffered_ = 0;
}

size_t Admission::refused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

void Admission::close_socket(int socket) {
  shutdown(socket, SHUT_RDWR);
  close(socket);
}

Verdict Admission::receive(int socket, Waiting& waiting) {
  char chunk[64 << 10];
  size_t taken = 0;
  Verdict verdict = Verdict::kIncomplete;
  while (taken < kReadPerWake) {
    const size_t room = waiting.framing.byte_limit() + 1 - std::min(waiting.bytes.size(), waiting.framing.byte_limit());
    const ssize_t n = recv(socket, chunk, std::min(sizeof chunk, room), MSG_DONTWAIT);
    if (n == 0) return Verdict::kRefuse;  // closed before the request was whole
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? verdict : Verdict::kRefuse;
    }
    waiting.bytes.append(chunk, static_cast<size_t>(n));
    buffered_ += static_cast<size_t>(n);
    taken += static_cast<size_t>(n);
    const bool had_head = waiting.framing.head_complete();
    verdict = waiting.framing.inspect(waiting.bytes);
    if (!had_head && waiting.framing.head_complete()) waiting.bytes.reserve(waiting.framing.expected_bytes());
    if (verdict != Verdict::kIncomplete) return verdict;
    if (waiting.framing.expects_continue() && !waiting.continued) {
      send_now(socket, "HTTP/1.1 100 Continue\r\n\r\n");
      waiting.continued = true;
    }
  }
  return verdict;
}

Clock::time_point Admission::expire(Clock::time_point now) {
  Clock::time_point next = now + std::chrono::seconds(60);
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = it->second;
    const bool head = w.framing.head_complete();
    if ((!head && w.head_deadline <= now) || w.request_deadline <= now) {  // not in time
      send_now(it->first, timeout_response(head));
      close_socket(it->first);
      ++refused_;
      buffered_ -= w.bytes.size();
      it = waiting_.erase(it);
      continue;
    }
    next = std::min(next, head ? w.request_deadline : w.head_deadline);
    ++it;
  }
  return next;
}

void Admission::loop() {
  while (true) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    const auto now = Clock::now();
    Clock::time_point next_deadline;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      next_deadline = expire(now);
      const bool over_budget = buffered_ >= limits_.buffered_bytes;
      for (const auto& [socket, waiting] : waiting_) {
        if (over_budget && waiting.framing.head_complete()) continue;  // its body waits for room
        fds.push_back({socket, POLLIN | POLLRDHUP, 0});
      }
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1;
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 1))) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) {
      char drain[64];
      (void)!read(wake_[0], drain, sizeof drain);
    }
    std::vector<std::pair<int, std::string>> whole;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto it = waiting_.find(fds[i].fd);
        if (it == waiting_.end()) continue;
        const Verdict verdict = receive(fds[i].fd, it->second);
        if (verdict == Verdict::kIncomplete) continue;
        buffered_ -= it->second.bytes.size();
        if (verdict == Verdict::kRefuse) {
          close_socket(fds[i].fd);
          ++refused_;
        } else {
          whole.emplace_back(fds[i].fd, std::move(it->second.bytes));
        }
        waiting_.erase(it);
      }
    }
    for (auto& [socket, request] : whole) handle_(socket, std::move(request));
  }
}

}  // namespace meshtrain::serve
