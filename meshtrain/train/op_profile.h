// Where a training step's time goes, operator by operator: libtorch's profiler
// around a stretch of steps, a Chrome trace of it, and each operator's self
// time (its own time, less the operators it called) summed over the stretch.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

struct OpTime {
  std::string name;         // aten::mm, autograd::engine::evaluate_function: MmBackward0, meshtrain::fused_norm, ...
  int64_t calls = 0;
  double self_seconds = 0;  // summed over the profiled stretch
};

// Profiles the CPU operators of every thread from construction to stop().
class OpProfile {
 public:
  OpProfile();
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Stops; writes the Chrome trace (chrome://tracing, ui.perfetto.dev) to
  // `trace_path` unless empty; returns the operators by self time, largest first.
  std::vector<OpTime> stop(const std::string& trace_path);

 private:
  bool running_ = false;
};

// The rows as a JSON array (ms per step over `steps` steps, share of the total)
// and as a table of the `top` largest.
std::string op_times_json(const std::vector<OpTime>& ops, int steps);
std::string op_times_table(const std::vector<OpTime>& ops, int steps, size_t top);

}  // namespace meshtrain::train
