// The state the gRPC handlers and the server's round loop share: who is
// connected, the open phase (its tasks waiting to be polled and the results
// in), and the bytes each client sent and received this round.
#pragma once

#include "meshtrain/fl/federation.pb.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace meshtrain::fl {

struct Traffic {
  int64_t up = 0, down = 0;  // serialized protobuf bytes of results and tasks
};

class Coordinator {
 public:
  using Clock = std::chrono::steady_clock;

  // `mutual`: a client's id must be its certificate's common name; `allow`:
  // the names admitted (empty: any the client CA signed); `context`: the
  // model's, at which a client's declared tokens count as sequences.
  Coordinator(bool mutual, std::vector<std::string> allow, int64_t context)
      : mutual_(mutual), allow_(std::move(allow)), context_(context) {}

  // Handlers. Each returns "" or the reason the call is refused.
  // Join: an id that is live is refused (kInUse) unless the request quotes
  // that session or mutual TLS proved the name (Note [Client sessions]); one
  // more live id from `address` than ids_per_address is refused (kBusy, Note
  // [Admission without mutual TLS]).
  enum class Refusal { kDenied, kInUse, kBusy };
  std::string join(const wire::JoinRequest& request, const std::string& peer_name, const std::string& address,
                   std::string* session, Refusal* refusal);
  void limit_ids_per_address(int64_t limit) { ids_per_address_ = limit; }
  // Poll, without waiting: the client's task if one is open for it (serialized;
  // a FIT task is one string every sampled client shares), STOP, or WAIT when
  // the poll began (`since`) a long-poll time (1 s) ago; else `*task` is null
  // and the caller asks again later (Note [Calls without threads]).
  std::string poll(const wire::PollRequest& request, Clock::time_point since, std::shared_ptr<const std::string>* task);
  // Called (under the coordinator's lock: it must take none) when a phase
  // opens or the federation stops, so that waiting polls are answered at once.
  void on_change(std::function<void()> listener);
  // Whether `id` may upload a result now: asked at each chunk of an upload
  // (`first`: its session too, and no other upload of its in progress), so
  // that one the round no longer awaits (closed, or its target in) stops
  // there. upload_ended: the upload's call is over, however it ended.
  // `round` and `kind`: what the upload's first chunk says it answers (round 0: not said).
  std::string may_submit(const std::string& id, const std::string& session, bool first, uint64_t round = 0,
                         wire::Task::Kind kind = wire::Task::WAIT);
  void upload_ended(const std::string& id);
  std::string submit(wire::Result&& result);
  std::string leave(const wire::LeaveRequest& request);
  // Presence: checks the session; then `ended` tells the sweep when to let the
  // call go (the session replaced, left, or the federation stopped), and
  // `gone` records that the client's call broke (its process or link died).
  std::string presence(const wire::PollRequest& request);
  bool ended(const std::string& id, const std::string& session);
  void gone(const std::string& id, const std::string& session);
  // The training sequences a client declared at Join, counted at the model's
  // context where it declared tokens (0: unknown id).
  uint64_t declared_examples(const std::string& id);

  // Round loop.
  std::vector<std::string> wait_for_clients(size_t count, double seconds);  // connected ids, sorted
  // Opens a phase: each client in `tasks` receives its task at its next poll.
  void open(uint64_t round, wire::Task::Kind kind, std::map<std::string, wire::Task> tasks);
  // The same, one task (its kind set) for every client of `ids`: held once,
  // serialized once; results past `enough` are refused (Note [Sampling clients]).
  void open(uint64_t round, wire::Task task, const std::vector<std::string>& ids, size_t enough = SIZE_MAX);
  // Waits until the phase's `enough` results are in, every client of the phase
  // answered or left, or `seconds` passed; closes the phase (later results are
  // refused) and returns the results in.
  std::map<std::string, wire::Result> close(double seconds);
  // Asynchronous mode (Note [Buffered asynchronous rounds] in server_async.cpp).
  // Opens model version `version`: from now on a client polling with no task
  // in flight, not yet handed this version, is handed `task` while fewer than
  // `concurrency` clients train. A result is taken when it answers the
  // client's task in flight; it joins a buffer that outlives versions. At each
  // version, tasks more than `max_staleness` versions old stop counting: their
  // results will be refused. Once `buffer` results are in, no task is handed
  // out until the next version opens: it would be stale at once.
  void open_async(uint64_t version, wire::Task task, size_t buffer, size_t concurrency, uint64_t max_staleness);
  struct Buffered {
    std::vector<wire::Result> results;  // oldest first, each its version in round()
    std::vector<std::string> assigned;  // handed a task since the last take
    std::vector<std::string> too_stale; // results refused as too stale since the last take
  };
  // Waits until `count` results are buffered, or `seconds` passed, or the
  // federation stops; takes up to `count` of them, oldest first.
  Buffered take_buffered(size_t count, double seconds);
  // Streaming (Note [Streaming the mean] in server_rounds.cpp): while a sink
  // is set, each FIT result the round takes is handed to it at once, outside
  // the lock, and kept without its update; close() returns once every sink
  // call has ended. An empty sink keeps results whole.
  using Sink = std::function<void(const std::string& id, wire::Result& result)>;
  void stream_results(Sink sink);
  std::map<std::string, Traffic> take_traffic();
  // From now on every poll answers STOP with `message`; waits up to `seconds`
  // for the connected clients to have heard it.
  void stop(const std::string& message, double seconds);

 private:
  struct Client {
    std::string session;
    Clock::time_point seen;
    bool left = false, stopped = false;
    uint64_t examples = 0;  // declared at Join
    std::string address;    // the source IP it joined from
  };
  void forget_idle(Clock::time_point now);  // with mutex_ held (Note [Admission without mutual TLS])
  bool live(const Client& c, Clock::time_point now) const;
  bool awaits(const std::string& id) const;  // with mutex_ held: a result of `id` would be taken now
  bool assign_async(const std::string& id);  // with mutex_ held: hands `id` the version's task if it may train now
  std::string refusal(const std::string& id);  // with mutex_ held: why a result of `id` is not taken now
  void changed();  // with mutex_ held: wakes waiters and listeners
  std::string check_session(const std::string& id, const std::string& session);

  std::mutex mutex_;
  std::condition_variable changed_;
  bool mutual_;
  std::vector<std::string> allow_;
  int64_t context_;
  int64_t ids_per_address_ = 0;  // 0: no limit
  std::map<std::string, Client> clients_;
  uint64_t round_ = 0;
  wire::Task::Kind kind_ = wire::Task::WAIT;
  bool phase_open_ = false;
  std::map<std::string, std::shared_ptr<const std::string>> pending_;  // serialized tasks not yet polled
  std::set<std::string> expected_;
  std::map<std::string, wire::Result> results_;
  size_t enough_ = SIZE_MAX;                        // the phase's target of results
  std::set<std::string> uploading_;                 // clients with an upload in progress
  std::map<std::string, Traffic> traffic_;
  Sink sink_;
  int sinking_ = 0;  // sink calls in progress
  // Asynchronous mode.
  bool async_ = false;
  size_t concurrency_ = SIZE_MAX, async_buffer_ = 1;
  uint64_t max_staleness_ = 0;
  std::shared_ptr<const std::string> async_task_;
  std::map<std::string, uint64_t> in_flight_;     // client -> the version it trains
  std::map<std::string, uint64_t> last_version_;  // client -> the last version it was handed
  std::vector<wire::Result> buffer_;
  std::vector<std::string> assigned_, too_stale_;
  bool stopping_ = false;
  std::string stop_message_;
  std::vector<std::function<void()>> listeners_;
};

}  // namespace meshtrain::fl
