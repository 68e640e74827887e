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

// Profiles the CPU operators of every thread from construction to stop(), and
// with `cuda` the GPU's kernels, copies and fills as well.
class OpProfile {
 public:
  explicit OpProfile(bool cuda = false);
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Stops; writes the Chrome trace (chrome://tracing, ui.perfetto.dev) to
  // `trace_path` unless empty; returns the operators by self time, largest first.
  std::vector<OpTime> stop(const std::string& trace_path);

  // The GPU's work by kernel name (time on the device; calls are launches),
  // largest first; empty unless profiled with `cuda`. Filled by stop().
  const std::vector<OpTime>& kernels() const { return kernels_; }

 private:
  bool cuda_ = false;
  bool running_ = false;
  std::vector<OpTime> kernels_;
};

// The rows as a JSON array (ms per step over `steps` steps, share of the total)
// and as a table of the `top` largest, whose rows are each a `row` timed by `time`.
std::string op_times_json(const std::vector<OpTime>& ops, int steps);
std::string op_times_table(const std::vector<OpTime>& ops, int steps, size_t top, const std::string& row = "operator",
                           const std::string& time = "self time");

}  // namespace meshtrain::train
