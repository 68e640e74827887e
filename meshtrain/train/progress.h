// Progress: what a run tells a person and a program while it trains — the
// progress line on rank 0, metrics as JSON lines (<run.out>/metrics.jsonl),
// warnings and events, each printed once.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/moe.h"
#include "meshtrain/util/memory.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace meshtrain::train {

// Counted CPU tensor bytes of this rank during one step (util/memory.h).
struct StepMemory {
  int64_t model_states = 0;  // in use after the step: parameters, gradients, optimizer states
  std::array<int64_t, memory::kPhaseCount> phase_peak{};  // highest in use within each phase
  int64_t peak() const { return *std::max_element(phase_peak.begin(), phase_peak.end()); }
};

struct StepResult {
  int64_t step = 0;        // steps completed after this one
  double loss = 0;         // mean training loss over the global batch
  double grad_norm = 0;    // global norm before clipping
  bool skipped = false;    // not finite, so not applied (Note [Non-finite steps])
  double lr = 0;
  double seconds = 0;
  StepMemory memory;
  std::vector<model::MoeLayerMetrics> moe;  // mixture-of-experts layers, in block order
};

// "1h02m", "3m05s", "42s"
std::string human_duration(double seconds);
// This process's peak resident memory so far, in MiB.
double peak_rss_mib();

// A job `meshtrain run --max-restarts` launched again (Note [Restarts]): told
// on the relaunched command line, not in the environment.
struct Relaunch {
  int attempt = 0;        // 0: the first launch
  std::string cause;      // "rank 1 (host a) exited on signal 9"
  int ranks_before = 0;   // the ranks of the job before (0: as many as now)
};

class Progress {
 public:
  // Collective-free. Rank 0 opens <out_dir>/metrics.jsonl (appending when `append`).
  // `device`: where training runs (its allocator's peak goes into the metrics).
  Progress(std::shared_ptr<comm::Communicator> world, const std::string& out_dir, bool append,
           at::Device device = at::kCPU);

  bool leader() const { return world_->rank() == 0; }
  // Rank 0: "meshtrain: <text>" on stdout; "meshtrain: warning: <text>" on stderr.
  void say(const std::string& text) const;
  void warn(const std::string& text) const;
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Rank 0: one JSON object as a line of metrics.jsonl.
  void event(const std::string& json_object);
  // Rank 0: the "resumed" line, counting the rows of steps after `step` that
  // the run before wrote, which the rows below it now replace; returns that count.
  int64_t resumed(int64_t step, const std::string& checkpoint);
  // Rank 0: the "restart" line and its progress line, when `meshtrain run`
  // relaunched the job (relaunch.attempt > 0: Note [Restarts]).
  void restarted(int64_t step, int64_t steps_redone, int ranks, const Relaunch& relaunch);
  // Collective (every rank's memory and RSS): the step's metrics line, and the
  // progress line when `print`. `mfu` at `tokens_per_second`.
  void step(const StepResult& result, std::optional<double> val_loss, double tokens_per_second, double mfu,
            int64_t total_steps, double eta_seconds, bool print);

 private:
  std::shared_ptr<comm::Communicator> world_;
  at::Device device_;
  int metrics_fd_ = -1;  // rank 0: <out>/metrics.jsonl, appended a whole line per write (Note [Metrics lines])
  std::string metrics_path_;
  bool metrics_failed_ = false;  // a write failed: said once
};

}  // namespace meshtrain::train
