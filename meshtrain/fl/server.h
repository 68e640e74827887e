// `meshtrain fl server`: the federation's coordinator. A gRPC service
// (Join, PollChunks, SubmitChunks, Leave, Presence: federation.proto; every
// one a callback, Note [Calls without threads]) in front of a round loop that
// samples clients, hands out tasks, waits for results until each phase's
// deadline (stragglers are dropped), aggregates with the strategy, evaluates
// on the validation data, writes one metrics row and checkpoints its state
// every round, and resumes from that checkpoint after a crash.
#pragma once

#include "meshtrain/fl/config.h"
#include "meshtrain/fl/federation.grpc.pb.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::fl {

class Coordinator;  // the state the service and the round loop share (coordinator.h)
class Rounds;       // the model, strategy and bookkeeping of the rounds (server_rounds.h)

class Server {
 public:
  explicit Server(FlConfig config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // Runs the remaining rounds, then tells every client to stop. Returns the
  // rounds that failed (below min_fit, secure aggregation below t).
  int run();
  std::vector<at::Tensor> weights() const;  // the global model, in parameter order

 private:
  FlConfig config_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<wire::Federation::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Rounds> rounds_;
  int port_ = 0;
};

}  // namespace meshtrain::fl
