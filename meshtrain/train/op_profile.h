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

// One matrix product's calls at one set of operand sizes (aten::mm, addmm,
// addmm_, bmm, baddbmm), timed whole: a product called inside another (addmm
// inside addmm) is the outer one's.
struct ProductTime {
  std::string name;      // aten::mm
  std::string operands;  // "[2048, 384] x [384, 1536]"
  int64_t calls = 0;
  double seconds = 0;  // summed over the profiled stretch
  double flops = 0;    // 2·m·k·n per call (times the batch for bmm), summed
};

// The FLOPs of a call of product `name` with operands of `sizes` as the
// profiler records them (addmm's and baddbmm's bias first); 0 for anything else.
double product_flops(const std::string& name, const std::vector<std::vector<int64_t>>& sizes);

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

  // The CPU's matrix products by operand sizes, longest first (operand sizes
  // are recorded for every operator, in the trace too); empty when profiled
  // with `cuda`, where an operator's CPU time is its launch. Filled by stop().
  const std::vector<ProductTime>& products() const { return products_; }

 private:
  bool cuda_ = false;
  bool running_ = false;
  std::vector<OpTime> kernels_;
  std::vector<ProductTime> products_;
};

// The rows as a JSON array (ms per step over `steps` steps, share of the total)
// and as a table of the `top` largest, whose rows are each a `row` timed by `time`.
std::string op_times_json(const std::vector<OpTime>& ops, int steps);
std::string op_times_table(const std::vector<OpTime>& ops, int steps, size_t top, const std::string& row = "operator",
                           const std::string& time = "self time");

// The products as a JSON array and as a table of the `top` longest, each with
// its GFLOP/s and, where peak_flops > 0 (the matmul peak of the run's dtype),
// its share of that peak.
std::string products_json(const std::vector<ProductTime>& products, int steps, double peak_flops);
std::string products_table(const std::vector<ProductTime>& products, int steps, size_t top, double peak_flops);

}  // namespace meshtrain::train
