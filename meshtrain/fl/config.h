// The federated server's configuration: a TOML file with [model] (as for
// `meshtrain train`) and [fl], [fl.client], [fl.compression], [fl.secagg],
// [fl.data], [fl.server] (meshtrain fl server --help-config lists the keys),
// plus section.key=value overrides.
#pragma once

#include "meshtrain/fl/codec.h"
#include "meshtrain/fl/robust.h"
#include "meshtrain/fl/strategy.h"
#include "meshtrain/model/gpt_config.h"

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::fl {

class FlConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// TLS for either side. Server: cert/key are its own, `ca` verifies client
// certificates under mutual TLS. Client: `ca` verifies the server, cert/key
// are its own under mutual TLS. `insecure`: plaintext, loopback only.
struct TlsConfig {
  std::string cert, key, ca;
  bool mutual = false;
  std::vector<std::string> allow;  // mutual TLS: client certificate common names admitted (empty: any the CA signed)
  bool insecure = false;
};

struct FlConfig {
  std::string preset = "tiny";
  model::GptConfig model = model::GptConfig::preset("tiny");
  // [fl]
  int64_t rounds = 10;
  double fraction = 1.0;        // of the available clients sampled each round
  int64_t clients_per_round = 0;  // results a round waits for (0: fraction of the available, at least min_fit)
  double over_select = 0;       // sampled: the target x (1 + over_select), so that dropouts still leave the target
  // "sync": rounds; "async": buffered asynchronous aggregation (Note [Buffered asynchronous rounds]).
  std::string mode = "sync";
  int64_t min_available = 1;    // clients connected before a round starts
  int64_t min_fit = 1;          // results needed for the round to count
  double deadline_s = 120;      // per round phase: later results are dropped
  double wait_clients_s = 120;  // how long a round waits for min_available
  uint64_t seed = 1;
  std::string label;            // names this configuration in metrics and plots (default: the compression)
  StrategyConfig strategy;
  Aggregation aggregation;  // how the round's updates combine (Note [Robust aggregation])
  // Bounds on one client (Note [Client bounds] in server_rounds.h).
  double clip_norm = 0;      // a fixed bound on each update's global L2 norm (0: none), when not clip_auto
  bool clip_auto = true;     // fl.clip_norm = "auto": clip_factor times the round's median update norm
  double clip_factor = 3;
  double max_message_mb = 0;             // a result larger than this is refused (0: from the model)
  int64_t max_examples_per_client = 0;   // a client's weight at most this (0: what it declared at Join)
  double max_regression = 0.5;  // a round that raises the validation loss more than this is rolled back
  int64_t keep_states = 3;      // the last good states kept in out/states/
  // [fl.async]: fl.mode = "async" (Note [Buffered asynchronous rounds] in server_async.cpp).
  int64_t async_buffer = 10;          // K: updates per aggregation
  int64_t async_concurrency = 0;      // clients training at once (0: every connected client)
  int64_t max_staleness = 4;          // versions an update may lag the model and still count
  double staleness_exponent = 0.5;    // an update of staleness s is scaled by (1 + s)^-exponent
  // [fl.dp]: DP-FedAvg (Note [Differential privacy] in dp.h).
  double noise_multiplier = 0;  // z: Gaussian noise of std z·clip_norm on the sum (0: off)
  double dp_delta = 1e-5;       // δ of the (ε, δ) reported
  // [fl.client]
  int64_t local_steps = 5;
  int64_t batch = 8;
  double lr = 0.05;
  std::string optimizer = "sgd";  // "sgd" | "adamw"
  // [fl.compression]
  CompressionSpec compression;
  // [fl.secagg]
  bool secagg = false;
  int64_t threshold = 2;
  double clip = 0.5;
  int64_t secagg_bits = 16;
  // [fl.data]
  std::string val_file;        // server-side validation token file (fl split's val.bin)
  std::string clients_dir;     // fl simulate: one client per subdirectory holding train.bin
  int64_t eval_batches = 4;
  // [fl.server]
  std::string listen = "127.0.0.1:0";  // port 0: any free port (printed, and written to --port-file)
  // Note [Admission without mutual TLS] (admission.h): each 0 or "" for none.
  std::string join_token_file;
  double joins_per_minute = 0;  // per source address
  int64_t ids_per_address = 0;  // live ids per source address
  double grpc_memory_mb = 256;  // gRPC's own buffers for all connections (Note [Messages in chunks])
  std::string out = "runs/fl";         // metrics.jsonl, state.safetensors, loss.svg
  bool resume = true;
  TlsConfig tls;

  // Loads `path` (empty: defaults), applies overrides ("section.key=value",
  // e.g. "fl.rounds=3"), validates. Throws FlConfigError naming the key.
  static FlConfig load(const std::string& path, const std::vector<std::string>& overrides);
  void validate() const;
  void validate_async() const;
  std::string display_label() const { return label.empty() ? compression.describe() : label; }
  // fl.max_message_mb in bytes; 0 means a full float32 update plus a quarter
  // and 4 MiB (never above gRPC's 2 GiB).
  int64_t max_message_bytes() const;
  bool dp() const { return noise_multiplier > 0; }
  bool async() const { return mode == "async"; }
  static std::string describe_keys();
  // The keys whose values change what a federation computes (the rule that
  // combines updates, the clients' training, the compression, secure
  // aggregation, noise, sampling), as key -> value: a run resumed with other
  // values would be neither run (Note [Resuming a federation]).
  std::map<std::string, std::string> result_settings() const;
};

bool is_loopback_address(const std::string& host_port);

}  // namespace meshtrain::fl
