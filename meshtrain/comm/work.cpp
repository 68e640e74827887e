#include "meshtrain/comm/work.h"

namespace meshtrain::comm {

void wait_all(const std::vector<Work>& works) {
  std::exception_ptr first;
  for (const Work& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void HostWork::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool HostWork::completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void HostWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    // Released before anyone can see the op done: from then on the tensors
    // are the caller's alone (memory accounting relies on it).
    keep_alive_.clear();
    done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

}  // namespace meshtrain::comm
