// SelfCommunicator: the one-rank group of a process that runs without MPI (a
// federated client's local steps). See Note [Self communicator].
#pragma once

#include "meshtrain/comm/communicator.h"

#include <deque>
#include <memory>
#include <mutex>

namespace meshtrain::comm {

// Note [Self communicator]
// A process that trains alone and never starts MPI (a federated client) still
// runs its steps through the step engine, which is written against a world.
// This is that world: rank 0 of 1. Collectives of one rank are done in place
// (Note [One-rank communicators]); a split gives another self communicator
// (or none, for a negative color). A send to oneself is buffered (the tensor
// copied when it is issued, the send complete at once) and a receive takes the
// oldest buffered send of its tag (a send of another size or dtype fails the
// receive, as MPI's truncation error does); a receive whose send has not been
// issued when it is waited on waits up to options().timeout and then fails
// naming the tag, as the watchdog would end a stuck op.
class SelfCommunicator final : public Communicator {
 public:
  static std::shared_ptr<SelfCommunicator> create(const std::string& name = "self", CommOptions options = {});

  const char* backend_name() const override { return "self"; }
  at::Device device() const override { return at::Device(at::kCPU); }

 protected:
  Work submit(Op op) override;
  std::shared_ptr<Communicator> do_split(Op op, int color, int key, const std::string& name,
                                         CommOptions child_options) override;

 private:
  class Receive;
  SelfCommunicator(const std::string& name, CommOptions options);
  // Copies the oldest buffered send of the receive's tag into it, if there is one; true when the
  // receive is done with (matched, or given up by its waiter). Holds mutex_.
  bool match_locked(Receive& receive);

  std::mutex mutex_;
  std::deque<Op> sent_;                            // buffered sends (input cloned), in issue order
  std::deque<std::shared_ptr<Receive>> waiting_;  // receives not yet matched, in issue order
};

}  // namespace meshtrain::comm
