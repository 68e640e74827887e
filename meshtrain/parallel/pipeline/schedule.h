// Pipeline schedules as data: for every rank, the ordered list of what it
// does in one step. One executor (executor.h) runs any of them; validate()
// simulates one before it runs.
#pragma once

#include "meshtrain/mesh/parallel_dims.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::parallel::pipeline {

// A schedule that cannot run: names the rank, the action and what is wrong.
class ScheduleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class ActionKind {
  kForward,         // forward of `microbatch` through `stage`
  kBackward,        // its backward
  kSendActivation,  // `stage`'s output of `microbatch` to stage + 1
  kRecvActivation,  // `stage`'s input of `microbatch` from stage - 1
  kSendGradient,    // the gradient of `stage`'s input to stage - 1
  kRecvGradient,    // the gradient of `stage`'s output from stage + 1
};

struct Action {
  ActionKind kind;
  int stage;
  int microbatch;
  bool operator==(const Action& o) const { return kind == o.kind && stage == o.stage && microbatch == o.microbatch; }
  std::string str() const;  // "F3@s1", "recvA3@s1", ...
};

// Note [Pipeline schedules]
// The model is cut into p·v stages (v virtual stages per rank); stage s runs
// on rank s mod p, so with v > 1 each rank holds v non-adjacent pieces
// (interleaving). Stage 0 embeds, the last stage computes the loss. A step
// pushes m micro-batches through every stage forward and back. Sends are
// asynchronous (posted, never waited on before the step's end); a receive is
// posted where it stands and waited on by the computation that needs it.
// Messages between two ranks of one kind are matched in the order sent.
//   gpipe        every forward, then every backward: m micro-batches stashed
//   1f1b         p - r - 1 warm-up forwards on rank r, then one forward one
//                backward, then the remaining backwards: at most p stashed
//   interleaved  1f1b over v virtual stages per rank (Megatron's order; needs
//                m divisible by p): the bubble shrinks by v, at v times the
//                point-to-point messages
// The bubble (idle / step time) of gpipe and 1f1b is (p-1)/(m+p-1), and with
// interleaving (p-1)/(v·m+p-1), for backward taking any multiple of forward.
struct Schedule {
  std::string name;
  int ranks = 1;           // p
  int virtual_stages = 1;  // v
  int microbatches = 1;    // m
  bool backward = true;    // false: forward only (evaluation)
  std::vector<std::vector<Action>> actions;  // per rank, in order

  int stages() const { return ranks * virtual_stages; }
  int rank_of(int stage) const { return stage % ranks; }
};

// The most losses (the last stage's forwards) waiting for their backward at
// once: 1 under 1F1B, m under GPipe. Where more than one waits, the chunked
// loss makes its gradients in the backward (Note [Chunked loss]).
int losses_in_flight(const Schedule& schedule);

// Throws ScheduleError for sizes the layout rules refuse.
Schedule make_schedule(mesh::PipelineSchedule kind, int ranks, int virtual_stages, int microbatches);
// By name: "gpipe", "1f1b" or "interleaved" (mesh::pipeline_schedule_names());
// throws ScheduleError for another name too.
Schedule make_schedule(const std::string& name, int ranks, int virtual_stages, int microbatches);
Schedule gpipe(int ranks, int microbatches);
Schedule one_f_one_b(int ranks, int microbatches);
Schedule interleaved_1f1b(int ranks, int virtual_stages, int microbatches);
// Every forward in micro-batch order, nothing stashed (evaluation).
Schedule forward_only(int ranks, int virtual_stages, int microbatches);
// Per rank, the computations in order (kForward/kBackward only) made into a
// schedule: each receive placed just before the computation that needs it,
// each send just after the one that produced it.
Schedule with_communication(std::string name, int ranks, int virtual_stages, int microbatches, bool backward,
                            const std::vector<std::vector<Action>>& computations);

struct ScheduleReport {
  double step_time = 0;            // simulated makespan
  std::vector<double> busy;        // per rank: time computing
  std::vector<double> bubble;      // per rank: 1 - busy / step_time
  std::vector<int> peak_stashed;   // per rank: most forwards whose backward had not run
  double mean_bubble() const;
};

// Simulates the schedule with a forward taking `forward_cost` and a backward
// `backward_cost` per stage, communication free. Throws ScheduleError when a
// computation is missing, repeated or on the wrong rank, something is sent
// before it exists, a send has no receive (or the reverse), messages would
// match out of order, or the ranks would deadlock (naming what each waits for).
ScheduleReport validate(const Schedule& schedule, double forward_cost = 1.0, double backward_cost = 2.0);

// The closed form of the bubble: (p-1)/(v·m+p-1).
double theoretical_bubble(int ranks, int virtual_stages, int microbatches);

}  // namespace meshtrain::parallel::pipeline
