// The loop that feeds completion jobs to the batch engine: a bounded queue,
// continuous batching, and under tensor parallel the same steps on every rank.
#pragma once

#include "meshtrain/serve/batch_engine.h"
#include "meshtrain/serve/completion.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>

namespace meshtrain::serve {

struct SchedulerOptions {
  int64_t max_batch = 16;  // sequences decoded together
  int64_t queue = 64;      // jobs waiting for room beyond those; more are refused
};

// Note [Serving loop]
// Rank 0 runs the loop and the HTTP front end; its handler threads submit()
// jobs. Each turn the loop takes queued jobs into the batch while there is
// room (prefilled together), ends the sequences whose text hit a stop string
// or whose client left, and decodes one token for every running sequence;
// each token goes through the job's TextStream to the waiting handler. Under
// tensor parallel, rank 0 broadcasts each turn's joins and ends to the group
// (one small message) and every rank makes the same engine calls; while idle
// it sends an empty turn every half second, so no rank waits in a collective
// past the communicator's timeout. drain() stops new jobs; the loop returns
// once every accepted job is done (and tells the other ranks to return).
class Scheduler {
 public:
  // `group`: the tensor-parallel group (null or size 1: this rank alone).
  Scheduler(InferenceModel& model, parallel::CommPtr group, SchedulerOptions options);
  ~Scheduler();

  // Rank 0, any thread. Checks a job against the model (prompt within the
  // context, options in range); throws std::invalid_argument saying what is wrong.
  void check(const CompletionJob& job) const;
  // Queues one request's jobs together (their prompts then share a prefill), or none of them.
  Submitted submit(std::vector<std::shared_ptr<CompletionJob>> jobs);
  void drain();
  bool draining() const;

  // The loop, on every rank of the group; returns after drain() (rank 0) or
  // when rank 0 says so.
  void run();

 private:
  struct Turn;
  struct Live;
  Turn next_turn();
  void apply(const Turn& turn);
  void deliver(const std::vector<TokenEvent>& events);
  void fail_all(const std::string& message);

  InferenceModel& model_;
  parallel::CommPtr group_;
  SchedulerOptions options_;
  BatchEngine engine_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<CompletionJob>> queue_;
  bool draining_ = false;
  std::map<uint64_t, std::unique_ptr<Live>> live_;  // rank 0: running jobs by sequence id
  uint64_t next_id_ = 1;
};

}  // namespace meshtrain::serve
