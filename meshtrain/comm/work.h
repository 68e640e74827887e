// Work: the handle an asynchronous communicator op returns.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace meshtrain::comm {

// Backend-specific completion state behind a Work.
class WorkImpl {
 public:
  virtual ~WorkImpl() = default;
  // Blocks until the op's result may be used by the caller (on a GPU backend: until
  // the caller's current stream is ordered after the op); rethrows the op's error.
  virtual void wait() = 0;
  // True once the op has finished, successfully or not. Never blocks.
  virtual bool completed() const = 0;
};

// A handle to an issued op. Until wait() returns, the op's tensors must stay
// untouched by the caller (the Work keeps them alive). Copyable; all copies
// refer to the same op. A default-constructed Work is already complete.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<WorkImpl> impl) : impl_(std::move(impl)) {}

  void wait() const {
    if (impl_) impl_->wait();
  }
  bool completed() const { return !impl_ || impl_->completed(); }

 private:
  std::shared_ptr<WorkImpl> impl_;
};

// Waits for every work in order; rethrows the first error after all have finished.
void wait_all(const std::vector<Work>& works);

// A Work finished by a host thread (the MPI progress thread). Thread-safe.
class HostWork final : public WorkImpl {
 public:
  explicit HostWork(std::vector<at::Tensor> keep_alive) : keep_alive_(std::move(keep_alive)) {}

  void wait() override;
  bool completed() const override;
  // Marks the op finished (with `error` when it failed) and wakes waiters. Once.
  void finish(std::exception_ptr error = nullptr);

 private:
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;                 // protected by mutex_
  std::exception_ptr error_;          // protected by mutex_
  std::vector<at::Tensor> keep_alive_;  // released by finish()
};

}  // namespace meshtrain::comm
