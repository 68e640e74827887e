// `meshtrain fl client`: joins a federation server, then polls for tasks —
// train locally and send the encoded update (FIT), or take a step of secure
// aggregation — until the server says STOP. Reconnects and rejoins when the
// server restarts.
#pragma once

#include "meshtrain/fl/config.h"

#include <grpcpp/channel.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace meshtrain::fl {

class EnginePool;

class ClientError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ClientOptions {
  std::string id;
  std::string server = "127.0.0.1:50051";
  std::string data;               // a directory holding train.bin (fl split), or a token file
  TlsConfig tls;                  // ca: verifies the server; cert/key: this client's, for mutual TLS
  std::string join_token;         // the federation's join token, where it has one (Note [Admission without mutual TLS])
  double connect_timeout_s = 60;  // to reach (or reach again) the server
  // For exercising the server's fault handling: wait this long before
  // sending each training result; stop answering after this phase
  // ("fit", "share", "mask") of the first round that gets there.
  double straggle_s = 0;
  double slow_factor = 1;  // take this many times as long per training task (sleeping the difference)
  std::string drop_after;
  int leave_after = 0;  // > 0: leave the federation (Leave) after this many rounds
  bool leave_on_signal = false;  // SIGINT/SIGTERM: leave the federation (Leave) at the next poll, return 0

  bool quiet = false;
  // A pooled client (Note [A pool of clients] in client_pool.h): trains on an
  // engine leased from `engines`, opens its data only while it trains, and
  // holds no Presence call.
  EnginePool* engines = nullptr;
  std::shared_ptr<grpc::Channel> channel;  // shared by pooled clients (empty: its own)
};

// A channel to the federation server at `server` (a chunk its largest message, quick reconnects).
std::shared_ptr<grpc::Channel> client_channel(const std::string& server, const TlsConfig& tls);

// A client's data order: its sampler shuffles with this seed (from its id),
// the same in every round and after a restart.
uint64_t client_sampler_seed(const std::string& id);

// Returns 0 when the server stopped the federation or after --leave-after, 3 after --drop-after.
// Throws ClientError with what to do when the server cannot be reached or refuses.
int run_client(const ClientOptions& options);

}  // namespace meshtrain::fl
