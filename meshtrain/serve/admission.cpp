#include "meshtrain/serve/admission.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <tuple>
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

void close_socket(int socket) {
  shutdown(socket, SHUT_RDWR);
  close(socket);
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

class Admission::Share {
 public:
  Share(Admission* owner, size_t bytes) : owner_(owner), bytes_(bytes) {}
  ~Share() { owner_->give_back(bytes_); }
  Share(const Share&) = delete;
  Share& operator=(const Share&) = delete;

 private:
  Admission* owner_;
  size_t bytes_;
};

Admission::Admission(Handle handle, AdmissionLimits limits) : handle_(std::move(handle)), limits_(limits) {
  if (pipe2(wake_, O_NONBLOCK | O_CLOEXEC) != 0) {
    throw std::runtime_error(std::string("admission: cannot create a pipe: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { loop(); });
}

Admission::~Admission() {
  stop();
  close(wake_[0]);
  close(wake_[1]);
}

void Admission::wake() {
  const char byte = 0;
  (void)!write(wake_[1], &byte, 1);  // non-blocking: a full pipe already wakes the loop
}

void Admission::add(int socket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopped_ && waiting_.size() + lingering_.size() < limits_.connections) {
      waiting_.emplace(socket, Waiting(Clock::now(), limits_));
      wake();
      return;
    }
    ++refused_;
  }
  close_socket(socket);
}

void Admission::linger(int socket) {
  shutdown(socket, SHUT_WR);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopped_ && waiting_.size() + lingering_.size() < limits_.connections) {
      lingering_[socket] = Clock::now() + limits_.linger;
      wake();
      return;
    }
  }
  close_socket(socket);
}

// Any thread, with or without mutex_ held (a share may end inside the loop).
void Admission::give_back(size_t bytes) {
  if (bytes == 0) return;
  shared_ -= bytes;
  wake();  // a waiting body may take the room
}

void Admission::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
    wake();
  }
  thread_.join();
  std::map<int, Waiting> waiting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting.swap(waiting_);
    for (const auto& entry : lingering_) close_socket(entry.first);
    lingering_.clear();
  }
  for (const auto& entry : waiting) close_socket(entry.first);
}

size_t Admission::refused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

bool Admission::may_read(int socket, Waiting& waiting) {
  if (!waiting.framing.head_complete() || waiting.share) return true;
  const size_t body = waiting.framing.body_bytes_to_come();
  const bool small = body <= limits_.small_body_bytes;
  if (!small && shared_ + body > limits_.budget_bytes) return false;  // waits for room
  waiting.share = std::make_shared<Share>(this, small ? 0 : body);
  shared_ += small ? 0 : body;
  if (waiting.framing.expects_continue() && !waiting.continued) {
    send_now(socket, "HTTP/1.1 100 Continue\r\n\r\n");
    waiting.continued = true;
  }
  return true;
}

Verdict Admission::receive(int socket, Waiting& waiting) {
  char chunk[64 << 10];
  size_t taken = 0;
  const bool had_head = waiting.framing.head_complete();
  while (taken < kReadPerWake) {
    const size_t limit = had_head ? waiting.framing.byte_limit() : limits_.head_bytes;
    const size_t room = limit + 1 - std::min(waiting.bytes.size(), limit);
    const ssize_t n = recv(socket, chunk, std::min(sizeof chunk, room), MSG_DONTWAIT);
    if (n == 0) return Verdict::kRefuse;  // closed before the request was whole
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? Verdict::kIncomplete : Verdict::kRefuse;
    }
    waiting.bytes.append(chunk, static_cast<size_t>(n));
    taken += static_cast<size_t>(n);
    const Verdict verdict = waiting.framing.inspect(waiting.bytes);
    if (verdict != Verdict::kIncomplete) return verdict;
    if (!had_head && waiting.framing.head_complete()) {  // the body waits for may_read()'s decision
      waiting.bytes.reserve(waiting.framing.expected_bytes());
      return Verdict::kIncomplete;
    }
  }
  return Verdict::kIncomplete;
}

void Admission::drain_lingering(int socket) {
  char drop[64 << 10];
  for (size_t taken = 0; taken < kReadPerWake;) {
    const ssize_t n = recv(socket, drop, sizeof drop, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) break;  // the client closed (or the connection broke): done
    taken += static_cast<size_t>(n);
  }
  lingering_.erase(socket);
  close_socket(socket);
}

Clock::time_point Admission::expire(Clock::time_point now) {
  Clock::time_point next = now + std::chrono::seconds(60);
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = it->second;
    const bool head = w.framing.head_complete();
    if ((!head && w.head_deadline <= now) || w.request_deadline <= now) {  // not in time
      send_now(it->first, timeout_response(head));
      shutdown(it->first, SHUT_WR);
      lingering_[it->first] = now + limits_.linger;  // its bytes unread: no reset before the 408 is read
      ++refused_;
      it = waiting_.erase(it);  // its share, if any, is given back
      continue;
    }
    next = std::min(next, head ? w.request_deadline : w.head_deadline);
    ++it;
  }
  for (auto it = lingering_.begin(); it != lingering_.end();) {
    if (it->second <= now) {
      close_socket(it->first);
      it = lingering_.erase(it);
      continue;
    }
    next = std::min(next, it->second);
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
      for (auto& [socket, waiting] : waiting_) {
        if (may_read(socket, waiting)) fds.push_back({socket, POLLIN | POLLRDHUP, 0});
      }
      for (const auto& entry : lingering_) fds.push_back({entry.first, POLLIN | POLLRDHUP, 0});
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1;
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 1))) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) {
      char drain[256];
      while (read(wake_[0], drain, sizeof drain) > 0) {
      }
    }
    std::vector<std::tuple<int, std::string, std::shared_ptr<Share>>> whole;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (lingering_.count(fds[i].fd)) {
          drain_lingering(fds[i].fd);
          continue;
        }
        auto it = waiting_.find(fds[i].fd);
        if (it == waiting_.end()) continue;
        const Verdict verdict = receive(fds[i].fd, it->second);
        if (verdict == Verdict::kIncomplete) continue;
        if (verdict == Verdict::kRefuse) {
          close_socket(fds[i].fd);
          ++refused_;
        } else {
          whole.emplace_back(fds[i].fd, std::move(it->second.bytes), std::move(it->second.share));
        }
        waiting_.erase(it);
      }
    }
    for (auto& [socket, request, share] : whole) handle_(socket, std::move(request), std::move(share));
  }
}

}  // namespace meshtrain::serve
