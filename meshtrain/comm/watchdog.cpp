#include "meshtrain/comm/watchdog.h"

#include "meshtrain/comm/job_environment.h"
#include "meshtrain/util/fatal_signal.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

namespace meshtrain::comm {

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);
constexpr auto kIdleWake = std::chrono::seconds(1);

void default_abort(const std::string&) { std::_Exit(kWatchdogExitCode); }

}  // namespace

Watchdog& Watchdog::instance() {
  // Intentionally leaked: the watchdog must outlive every communicator, including
  // those destroyed during static destruction.
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t Watchdog::start(WatchedOp op, std::chrono::milliseconds timeout, std::function<bool()> poll) {
  const auto now = Clock::now();
  const auto deadline = now + timeout;
  uint64_t token;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    token = next_token_++;
    // The watchdog thread only needs waking when this op's deadline (or its
    // polling) comes before the thread's planned wake-up; it never sleeps longer
    // than kIdleWake, so with the usual timeouts of seconds to minutes issuing an
    // op costs no context switch.
    wake = deadline < planned_wake_ || static_cast<bool>(poll);
    entries_.emplace(token, Entry{std::move(op), now, deadline, timeout, std::move(poll)});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  if (wake) wake_.notify_all();
  return token;
}

void Watchdog::finish(uint64_t token) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.erase(token);
}

void Watchdog::set_context(std::string context) {
  std::lock_guard<std::mutex> lock(mutex_);
  util::set_fatal_signal_context(context);  // the step a crash report names (Note [Fatal signals])
  context_ = std::move(context);
}

std::string Watchdog::context() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return context_;
}

Watchdog::AbortHandler Watchdog::set_abort_handler(AbortHandler handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::swap(abort_handler_, handler);
  return handler;
}

size_t Watchdog::watched() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

// Note [Naming the stuck peer]
// A point-to-point op (and a broadcast's root) waits for one known peer;
// a collective waits for every other rank of its communicator, and MPI
// cannot tell which of them is late. So the line names the peer, or the
// other ranks, as world ranks with their hosts (from the start-up exchange,
// Note [Job environment]): "it runs on hostA; it waits for rank 3 on hostB".
namespace {

std::string whom_it_waits_for(const WatchedOp& op) {
  const std::vector<int>& world = *op.world_ranks;
  const Placement& placement = job_placement();
  const int me = world[op.rank];
  const std::string text = placement.host_of(me).empty() ? "" : "it runs on " + placement.host_of(me) + "; ";
  const bool one_peer = op.op.peer >= 0 && op.op.peer < static_cast<int>(world.size()) &&
                        (op.op.kind == OpKind::kSend || op.op.kind == OpKind::kRecv || op.op.peer != op.rank);
  std::vector<int> others;
  for (int r : world) {
    if (r != me) others.push_back(r);
  }
  return text + "it waits for " + placement.describe(one_peer ? std::vector<int>{world[op.op.peer]} : others);
}

}  // namespace

std::string Watchdog::timeout_line(const WatchedOp& op, std::chrono::duration<double> elapsed,
                                   std::chrono::milliseconds timeout) const {
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(1);
  const std::vector<int>* world = op.world_ranks.get();
  const bool known = world && op.rank >= 0 && op.rank < static_cast<int>(world->size());
  line << "meshtrain: rank " << (known ? (*world)[op.rank] : op.rank) << ": watchdog: " << op.op.describe()
       << " on communicator '" << op.communicator << "' (sequence #" << op.op.sequence << ") did not complete after "
       << elapsed.count() << " s (timeout " << timeout.count() / 1000.0 << " s)";
  if (!context_.empty()) line << " during " << context_;
  if (known) line << "; " << whom_it_waits_for(op);
  line << "; a peer rank died, hangs, or issued different collectives. Aborting the job.";
  return line.str();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    const auto now = Clock::now();
    std::vector<uint64_t> done;
    const Entry* expired = nullptr;
    Clock::time_point next_wake = now + kIdleWake;
    bool polling = false;
    for (auto& [token, entry] : entries_) {
      if (entry.poll && entry.poll()) {
        done.push_back(token);
        continue;
      }
      if (entry.deadline <= now) {
        expired = &entry;
        break;
      }
      polling = polling || static_cast<bool>(entry.poll);
      if (entry.deadline < next_wake) next_wake = entry.deadline;
    }
    for (uint64_t token : done) entries_.erase(token);
    if (expired) {
      const std::string line = timeout_line(expired->op, now - expired->start, expired->timeout);
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
      AbortHandler handler = abort_handler_ ? abort_handler_ : AbortHandler(default_abort);
      entries_.clear();
      lock.unlock();
      handler(line);
      lock.lock();
      continue;
    }
    if (polling && now + kPollInterval < next_wake) next_wake = now + kPollInterval;
    if (now + kIdleWake < next_wake) next_wake = now + kIdleWake;
    planned_wake_ = next_wake;
    wake_.wait_until(lock, next_wake);
  }
}

WatchdogContext::WatchdogContext(std::string context) : previous_(Watchdog::instance().context()) {
  Watchdog::instance().set_context(std::move(context));
}

WatchdogContext::~WatchdogContext() { Watchdog::instance().set_context(std::move(previous_)); }

}  // namespace meshtrain::comm
