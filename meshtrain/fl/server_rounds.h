// The server's round loop (Note [Federated round]).
//
// Note [Federated round]
// Round r: wait for min_available connected clients; sample
// max(min_fit, ceil(fraction·available)) of them (seeded); hand each a FIT
// task (model shape, weights, local settings, the round's seed) and wait
// until all answered or deadline_s passed — the rest are stragglers and are
// dropped. Plain rounds decode each update (update.h) and average by examples;
// under secure aggregation the FIT results carry keys and three more phases
// follow (Note [Secure aggregation]), each with its deadline, and the server
// only ever sees the sum. Fewer than min_fit results (or than t under secure
// aggregation) discard the round: the model is unchanged and the metrics row
// says why. Then the strategy steps, the validation loss is measured, a
// metrics row is appended and the state is checkpointed (atomically) so a
// restarted server resumes at round r + 1.
//
// Note [Client bounds]
// What one broken or hostile client can do to a plain round is bounded
// before any aggregation rule (robust.h) is applied:
// - size: a result over fl.max_message_mb (default: a full float32 update
//   plus a quarter and 4 MiB) is refused at the chunk that passes it, or at
//   its first if it declares more (Note [Messages in chunks] in chunks.h);
// - weight: a result's examples count at most what the client declared at
//   Join (its session cannot grow it) and fl.max_examples_per_client;
// - norm: each decoded update is clipped to fl.clip_norm, by default "auto",
//   fl.clip_factor (3) times the round's lower median norm (robust while
//   fewer than half the clients are hostile); a fixed bound is sent to the
//   clients, which clip too; a non-finite norm rejects the update;
// - rollback: a round whose model is non-finite, or whose validation loss is
//   non-finite or more than fl.max_regression above the last good round's,
//   is undone (the metrics row says why) and never saved; state.safetensors
//   only ever holds a finite model, and the last fl.keep_states good states
//   stay in out/states/ (a restart falls back to them if it is unreadable).
#pragma once

#include "meshtrain/fl/config.h"
#include "meshtrain/fl/coordinator.h"
#include "meshtrain/fl/dp.h"
#include "meshtrain/fl/strategy.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/train/data.h"

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace meshtrain::fl {

// `count` of `ids`, chosen by a shuffle seeded with `seed`, sorted (Note
// [Sampling clients] in server_rounds.cpp); the same for the same ids and seed.
std::vector<std::string> sample_clients(std::vector<std::string> ids, size_t count, uint64_t seed);

class Rounds {
 public:
  Rounds(const FlConfig& config, Coordinator& coordinator);
  int run();  // the rounds that failed
  std::vector<at::Tensor> weights() const;

 private:
  struct Outcome {
    size_t available = 0;  // clients connected when the round sampled
    size_t target = 0;     // results the round waits for (Note [Sampling clients])
    uint64_t sample_seed = 0;
    std::vector<std::string> sampled, participants, dropped, clipped;
    std::map<std::string, uint64_t> staleness;  // async: each participant's versions behind
    double train_loss = 0;
    double clip_norm = 0;          // the bound applied this round (0: none)
    double rejected_val_loss = 0;  // rolled back: the validation loss of the undone model
    bool rolled_back = false;
    std::string error;  // non-empty: the round was discarded
  };
  struct Snapshot {
    std::vector<at::Tensor> params, m, v;
  };
  Outcome run_round(uint64_t round);
  wire::Task fit_task(uint64_t round) const;
  void aggregate_plain(uint64_t round, std::map<std::string, wire::Result>& results, Outcome& outcome);
  void aggregate_secure(uint64_t round, const std::map<std::string, wire::Result>& results, Outcome& outcome);
  // server_stream.cpp: a round's mean summed as its results come (Note [Streaming the mean]).
  struct Stream {
    std::mutex mutex;
    uint64_t round = 0;
    std::vector<Structure> structures;
    std::vector<at::Tensor> sum;  // Σ examples·Δ
    double total = 0, loss = 0;   // Σ examples, Σ examples·loss
  };
  bool streams() const;
  void stream_result(Stream& stream, const std::string& id, wire::Result& r, Outcome& outcome);
  void aggregate_streamed(Stream& stream, Outcome& outcome);
  // server_async.cpp: one model version of an async federation (Note [Buffered asynchronous rounds]).
  Outcome run_async_version(uint64_t version);
  // Decodes the result of `id`, trained from the model of `round` (whose `structures` these are), into `updates`,
  // `weights` (its examples, at most what it declared) and `losses`, and names it a participant; a result that
  // does not decode is dropped. Frees the result's encoded update, so that a round never holds all its
  // results twice, encoded and decoded.
  void take_result(uint64_t round, const std::vector<Structure>& structures, const std::string& id, wire::Result& r,
                   std::vector<std::vector<at::Tensor>>& updates, std::vector<double>& weights,
                   std::vector<double>& losses, Outcome& outcome);
  // The updates after the bounds (Note [Client bounds]); weights: their examples (1 each under DP).
  void bound_updates(uint64_t round, std::vector<std::vector<at::Tensor>>& updates, std::vector<double>& weights,
                     std::vector<double>& losses, Outcome& outcome);
  // DP: one more round of client data, at its sampling rate and noise (Note [Differential privacy]).
  void account(const Outcome& outcome, double z);
  void apply_mean(const std::vector<at::Tensor>& mean);
  double evaluate();
  // server_state.cpp: the state on disk.
  Snapshot snapshot() const;
  void restore(const Snapshot& s);
  bool state_finite() const;
  void clear_states() const;
  // Why the round's model must be undone ("" when it stands).
  std::string regression(double val_loss) const;
  void save(uint64_t round) const;
  void keep_state(uint64_t round) const;
  void resume();
  void load_state(const std::string& path);
  void record(uint64_t round, const Outcome& outcome, double seconds, double val_loss);

  const FlConfig& config_;
  Coordinator& coordinator_;
  model::Gpt model_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  Strategy strategy_;
  std::unique_ptr<train::TokenFile> val_file_;
  std::unique_ptr<train::Sampler> val_;
  uint64_t next_round_ = 1;
  int64_t cumulative_up_ = 0, cumulative_down_ = 0;
  double good_val_loss_ = std::nan("");  // of the last model that stood
  std::set<std::string> overclaimed_;    // clients told once that their examples were capped
  PrivacyLedger privacy_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();  // metrics' elapsed_s
};

}  // namespace meshtrain::fl
