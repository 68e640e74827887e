// A pipeline's step on ranks that share a CPU's cores (Note [Shared cores]).
#pragma once

#include "meshtrain/parallel/pipeline/schedule.h"

#include <vector>

namespace meshtrain::plan {

// Note [Shared cores]
// On a CPU whose ranks outnumber its cores (4 ranks of one thread on 2
// cores), a rank's speed depends on how many ranks compute at once. The
// calibrated rate (Machine::peak_flops x mfu) is a rank's share with every
// rank busy: C/R cores for R ranks on C cores. With a of them busy, each runs
// min(1, C/a) cores, one thread using at most one core: R/C times the share
// while a <= C. A pipeline's bubble then costs less than on devices of their
// own: while a stage waits, the busy ones speed up. The time model walks the
// schedule action by action under that sharing (every pipeline of the node
// in step: a busy stage stands for R/pp busy ranks) and takes the bubble as
// what the walk adds to the busy time. Where ranks do not outnumber cores, or
// on devices (cores_per_node 0), the bubble is the schedule's theoretical one.
struct SharedCores {
  double ranks_per_node = 1;  // R
  double cores = 0;           // C; 0: every rank computes on its own device
  double stages = 1;          // pp: the ranks of one pipeline

  bool shared() const { return cores > 0 && ranks_per_node > cores; }
  // A busy rank's speed against its calibrated share, with `busy` of its pipeline's stages computing.
  double speed(int busy) const;
};

// The time one pipeline takes for `schedule`'s forwards and backwards, each
// of `forward`/`backward` seconds (per chunk, at the calibrated share), its
// stages waiting for their inputs and gradients and sharing the cores.
double pipeline_makespan(const parallel::pipeline::Schedule& schedule, const std::vector<double>& forward,
                         const std::vector<double>& backward, const SharedCores& cores);

}  // namespace meshtrain::plan
