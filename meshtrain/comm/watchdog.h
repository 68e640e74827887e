// Watchdog: turns a communicator op that does not finish within its timeout
// into one clear line on stderr and the end of the whole job. See Note [Watchdog].
#pragma once

#include "meshtrain/comm/op.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::comm {

// Note [Watchdog]
// A peer that died, hangs, or issued a different sequence of collectives leaves
// the other ranks blocked inside MPI or NCCL forever. Every backend registers
// each op with the process-wide watchdog when the op starts running and
// finishes it when it completes (or gives a poll function the watchdog calls,
// for GPU events). One watchdog thread sleeps until the earliest deadline (at
// most a second, so registering an op with a later deadline need not wake it:
// the hot path is a locked map insert and erase, no context switch); an op
// past its deadline produces one line naming the rank, op, communicator,
// sequence number, elapsed time and the current context (e.g. "step 12"), and
// then the abort handler, which by default ends the whole job (MPI_Abort when
// MPI is up, otherwise _Exit) with kWatchdogExitCode. The line is printed
// before anything else is attempted, so it appears even if aborting hangs (the
// runtime's MPI abort handler also arms a timer that _Exits the process).

inline constexpr int kWatchdogExitCode = 70;

struct WatchedOp {
  int rank = -1;
  std::string communicator;  // communicator name, e.g. "world" or "mesh:tp"
  Op op;                     // described only if it times out
  // The world rank of each of the communicator's ranks, when the backend knows
  // them: the line then names ranks as the job does, with their hosts.
  std::shared_ptr<const std::vector<int>> world_ranks;
};

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  using AbortHandler = std::function<void(const std::string& line)>;

  // The process-wide instance; its thread starts with the first watched op.
  static Watchdog& instance();

  // Starts watching an op that must finish within `timeout`. When `poll` is
  // given the watchdog calls it (from its thread) and stops watching once it
  // returns true; otherwise the caller must call finish(). Thread-safe.
  uint64_t start(WatchedOp op, std::chrono::milliseconds timeout, std::function<bool()> poll = {});
  void finish(uint64_t token);

  // Text appended to timeout lines, e.g. "step 12"; empty for none. Thread-safe.
  void set_context(std::string context);
  std::string context() const;

  // Replaces what happens after the timeout line is printed (the runtime installs
  // MPI_Abort; tests install a recorder). Returns the previous handler.
  AbortHandler set_abort_handler(AbortHandler handler);

  // Number of ops being watched (for tests).
  size_t watched() const;

  // The line printed for `op` after `elapsed` (exposed for tests).
  std::string timeout_line(const WatchedOp& op, std::chrono::duration<double> elapsed,
                           std::chrono::milliseconds timeout) const;

  ~Watchdog();

 private:
  Watchdog() = default;
  void run();

  struct Entry {
    WatchedOp op;
    Clock::time_point start;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
    std::function<bool()> poll;
  };

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::map<uint64_t, Entry> entries_;  // State below is protected by mutex_.
  uint64_t next_token_ = 1;
  std::string context_;
  AbortHandler abort_handler_;
  Clock::time_point planned_wake_ = Clock::time_point::min();  // when the thread will next look
  bool stopping_ = false;
  std::thread thread_;
};

// Sets the watchdog context for the lifetime of the object, restoring the previous one.
class WatchdogContext {
 public:
  explicit WatchdogContext(std::string context);
  ~WatchdogContext();
  WatchdogContext(const WatchdogContext&) = delete;
  WatchdogContext& operator=(const WatchdogContext&) = delete;

 private:
  std::string previous_;
};

}  // namespace meshtrain::comm
