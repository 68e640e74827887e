// Many federated clients in one process (Note [A pool of clients]).
#pragma once

#include "meshtrain/fl/client.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace meshtrain::parallel {
class StepEngine;
}

namespace meshtrain::fl {

// Note [A pool of clients]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A federation of thousands of clients on one machine cannot give each its
// own process and model: `fl simulate --pool W` runs every client as a thread
// of one process, speaking the protocol as a client process would (its own
// Join, session, long polls and uploads, a hundred clients to a channel),
// while the trainers are shared: W step engines (W = the cores is the sizing
// to start from), each a model and its local optimizer, and a client holds
// one only while it trains a task. Its data is its token file, mapped and
// read only while it trains; what it keeps between tasks is its session, its
// sampler's seed and, in a secure round, its keys. A pooled client holds no
// Presence call: the clients live and die with the pool, and the server's
// 30 s liveness covers the pool's death. Between tasks a client's thread
// waits in its long poll (a 2 MiB stack, most of it never touched); the
// server holds its calls as bytes (Note [Calls without threads]). The cost
// that grows with the clients is that long poll: each answers WAIT after a
// second, so 10,000 clients are 10,000 polls a second.

// The pool's trainers: at most `engines` step engines, each leased to one
// client at a time.
class EnginePool {
 public:
  explicit EnginePool(int engines);
  ~EnginePool();
  struct Slot;
  // A step engine for the model `model_json` describes, held until the lease ends.
  class Lease {
   public:
    Lease(EnginePool& pool, const std::string& model_json);
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    parallel::StepEngine& engine();

   private:
    EnginePool& pool_;
    Slot* slot_;
  };

 private:
  std::mutex mutex_;
  std::condition_variable free_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

// Runs every client of `clients` on a thread of this process, sharing
// `engines` trainers; returns 0 when every client ended as the server asked.
int run_client_pool(std::vector<ClientOptions> clients, int engines);

}  // namespace meshtrain::fl
