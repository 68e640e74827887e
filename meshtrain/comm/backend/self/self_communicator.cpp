#include "meshtrain/comm/backend/self/self_communicator.h"

#include <algorithm>
#include <condition_variable>

namespace meshtrain::comm {

// A receive's completion: set when a send of its tag is copied into it.
class SelfCommunicator::Receive final : public WorkImpl {
 public:
  Receive(Op op, std::chrono::milliseconds timeout, std::string prefix)
      : op_(std::move(op)), timeout_(timeout), prefix_(std::move(prefix)) {}

  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
    if (!done_cv_.wait_for(lock, timeout_, [&] { return done_; })) {
      abandoned_ = true;  // a later send of the tag is not delivered into it
      throw CommError(prefix_ + op_.describe() + ": no send of tag " + std::to_string(op_.tag) + " within " +
                      std::to_string(timeout_.count()) + " ms (a one-rank group receives only what it sent)");
    }
  }
  bool completed() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  bool abandoned() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return abandoned_;
  }
  // Copies `send`'s buffered tensor in and wakes the waiter, or (`error`) fails the receive with it;
  // false when the waiter has given up.
  bool deliver(const Op& send, const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abandoned_) return false;
    if (!error.empty()) {
      error_ = std::make_exception_ptr(CommError(prefix_ + op_.describe() + ": " + error));
    } else {
      op_.output.copy_(send.input.view(op_.output.sizes()));
    }
    done_ = true;
    done_cv_.notify_all();
    return true;
  }
  const Op& op() const { return op_; }

 private:
  Op op_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  bool abandoned_ = false;
  std::exception_ptr error_;  // a send that does not fit
};

SelfCommunicator::SelfCommunicator(const std::string& name, CommOptions options)
    : Communicator(0, 1, name, std::move(options)) {}

std::shared_ptr<SelfCommunicator> SelfCommunicator::create(const std::string& name, CommOptions options) {
  return std::shared_ptr<SelfCommunicator>(new SelfCommunicator(name, std::move(options)));
}

bool SelfCommunicator::match_locked(Receive& receive) {
  for (auto it = sent_.begin(); it != sent_.end(); ++it) {
    if (it->tag != receive.op().tag) continue;
    const at::Tensor& out = receive.op().output;
    // As MPI's truncation error: the receive fails, and the send is consumed by it.
    std::string error;
    if (it->input.numel() != out.numel() || it->input.scalar_type() != out.scalar_type()) {
      error = "a send of " + std::to_string(it->input.numel()) + " " + std::string(c10::toString(it->input.scalar_type())) +
              " values does not fit " + std::to_string(out.numel()) + " " + std::string(c10::toString(out.scalar_type()));
    }
    if (!receive.deliver(*it, error)) return true;  // given up: leaves the queue, the send stays for another
    sent_.erase(it);
    return true;
  }
  return false;
}

Work SelfCommunicator::submit(Op op) {
  if (is_collective(op.kind)) {  // here only with options().one_rank_through_backend
    run_locally(op);
    return Work();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [](const auto& r) { return r->abandoned(); }),
                 waiting_.end());
  if (op.kind == OpKind::kSend) {
    op.input = op.input.clone();  // buffered: the caller may reuse its tensor at once
    sent_.push_back(std::move(op));
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (!match_locked(**it)) {
        ++it;
        continue;
      }
      const bool delivered = (*it)->completed();  // else given up: try the next
      it = waiting_.erase(it);
      if (delivered) break;
    }
    return Work();
  }
  auto receive = std::make_shared<Receive>(std::move(op), options().timeout, error_prefix());
  if (!match_locked(*receive)) waiting_.push_back(receive);
  return Work(receive);
}

std::shared_ptr<Communicator> SelfCommunicator::do_split(Op, int color, int, const std::string& name,
                                                         CommOptions child_options) {
  if (color < 0) return nullptr;
  return create(name, std::move(child_options));
}

}  // namespace meshtrain::comm
