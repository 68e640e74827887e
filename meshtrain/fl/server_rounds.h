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
#pragma once

#include "meshtrain/fl/config.h"
#include "meshtrain/fl/coordinator.h"
#include "meshtrain/fl/strategy.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/train/data.h"

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::fl {

class Rounds {
 public:
  Rounds(const FlConfig& config, Coordinator& coordinator);
  int run();  // the rounds that failed
  std::vector<at::Tensor> weights() const;

 private:
  struct Outcome {
    std::vector<std::string> sampled, participants, dropped;
    double train_loss = 0;
    std::string error;  // non-empty: the round was discarded
  };
  Outcome run_round(uint64_t round);
  wire::Task fit_task(uint64_t round) const;
  void aggregate_plain(uint64_t round, const std::map<std::string, wire::Result>& results, Outcome& outcome);
  void aggregate_secure(uint64_t round, const std::map<std::string, wire::Result>& results, Outcome& outcome);
  void apply_mean(const std::vector<at::Tensor>& mean);
  double evaluate();
  void save(uint64_t round) const;
  void resume();
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
};

}  // namespace meshtrain::fl
