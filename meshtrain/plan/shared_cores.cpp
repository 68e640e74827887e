#include "meshtrain/plan/shared_cores.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace meshtrain::plan {

namespace pipeline = parallel::pipeline;

double SharedCores::speed(int busy) const {
  if (!shared() || busy <= 0) return 1.0;
  const double ranks_busy = std::max(1.0, busy * ranks_per_node / stages);
  return std::min(1.0, cores / ranks_busy) * ranks_per_node / cores;
}

double pipeline_makespan(const pipeline::Schedule& schedule, const std::vector<double>& forward,
                         const std::vector<double>& backward, const SharedCores& cores) {
  const int ranks = schedule.ranks, stages = schedule.stages(), m = schedule.microbatches;
  std::vector<std::vector<pipeline::Action>> work(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    for (const pipeline::Action& a : schedule.actions[static_cast<size_t>(r)]) {
      if (a.kind == pipeline::ActionKind::kForward || a.kind == pipeline::ActionKind::kBackward) work[r].push_back(a);
    }
  }
  // done[kind][stage * m + microbatch]
  std::vector<std::vector<char>> done(2, std::vector<char>(static_cast<size_t>(stages * m), 0));
  auto finished = [&](pipeline::ActionKind kind, int stage, int mb) {
    return done[kind == pipeline::ActionKind::kBackward][static_cast<size_t>(stage * m + mb)] != 0;
  };
  auto ready = [&](const pipeline::Action& a) {
    if (a.kind == pipeline::ActionKind::kForward) return a.stage == 0 || finished(a.kind, a.stage - 1, a.microbatch);
    return (a.stage == stages - 1 || finished(a.kind, a.stage + 1, a.microbatch)) &&
           finished(pipeline::ActionKind::kForward, a.stage, a.microbatch);
  };
  std::vector<size_t> next(static_cast<size_t>(ranks), 0);
  std::vector<double> left(static_cast<size_t>(ranks), -1);  // seconds of work left at full share; -1: not started
  double now = 0;
  for (;;) {
    int busy = 0, pending = 0;
    for (int r = 0; r < ranks; ++r) {
      if (next[r] >= work[r].size()) continue;
      ++pending;
      const pipeline::Action& a = work[r][next[r]];
      if (left[r] < 0 && ready(a)) left[r] = (a.kind == pipeline::ActionKind::kForward ? forward : backward)[a.stage];
      if (left[r] >= 0) ++busy;
    }
    if (pending == 0) return now;
    if (busy == 0) throw std::logic_error("pipeline_makespan: the schedule " + schedule.name + " waits forever");
    const double speed = cores.speed(busy);
    double step = std::numeric_limits<double>::infinity();
    for (int r = 0; r < ranks; ++r) {
      if (next[r] < work[r].size() && left[r] >= 0) step = std::min(step, left[r] / speed);
    }
    now += step;
    for (int r = 0; r < ranks; ++r) {
      if (next[r] >= work[r].size() || left[r] < 0) continue;
      left[r] -= step * speed;
      if (left[r] > 1e-12 * (1 + step)) continue;
      const pipeline::Action& a = work[r][next[r]];
      done[a.kind == pipeline::ActionKind::kBackward][static_cast<size_t>(a.stage * m + a.microbatch)] = 1;
      left[r] = -1;
      ++next[r];
    }
  }
}

}  // namespace meshtrain::plan
