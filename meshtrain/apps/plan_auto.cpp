// meshtrain plan --auto FILE: the fastest layout that fits, written as a
// config `train` takes as it is, with the runners-up and why they lost.
#include "meshtrain/apps/plan_auto.h"

#include "meshtrain/plan/layout.h"
#include "meshtrain/util/files.h"

#include <cstdio>
#include <stdexcept>
#include <utility>

namespace meshtrain::apps {

namespace {

std::string format(const char* pattern, double a, double b = 0, double c = 0) {
  char text[160];
  std::snprintf(text, sizeof text, pattern, a, b, c);
  return text;
}

// The term of `other`'s predicted step that exceeds the chosen one's most, in words.
std::string why_slower(const plan::TimeBreakdown& chosen, const plan::TimeBreakdown& other) {
  const std::pair<const char*, double> terms[] = {
      {"compute (recompute included)", other.compute - chosen.compute},
      {"pipeline bubble", other.bubble - chosen.bubble},
      {"tensor-parallel communication", other.tensor_parallel - chosen.tensor_parallel},
      {"data-parallel communication", other.data_parallel - chosen.data_parallel},
      {"pipeline transfers", other.pipeline - chosen.pipeline},
      {"expert-parallel communication", other.expert_parallel - chosen.expert_parallel},
      {"context-parallel communication", other.context_parallel - chosen.context_parallel},
      {"offload transfers", other.offload - chosen.offload},
      {"optimizer pass", other.optimizer - chosen.optimizer}};
  const auto* most = &terms[0];
  for (const auto& t : terms) {
    if (t.second > most->second) most = &t;
  }
  if (most->second <= 0) return "no slower term (a tie)";
  return std::string("more ") + most->first + format(" (+%.3g s)", most->second);
}

std::string peak(const plan::Candidate& c, const plan::Machine& machine) {
  return plan::format_bytes(c.worst.memory.total()) + " of " + plan::format_bytes(machine.device_memory);
}

}  // namespace

std::string auto_plan(const AutoPlanInput& in, int64_t world, const std::string& path) {
  const plan::SearchResult& r = in.result;
  if (r.fitting.empty()) {
    std::string closest = r.rejected.empty() ? "" : "; the closest, " + r.rejected.front().layout.str() + ", " +
                                                        r.rejected.front().why_not;
    throw std::invalid_argument("plan --auto: no layout of " + std::to_string(world) + " ranks fits " +
                                plan::format_bytes(in.machine.device_memory) + " per device" + closest +
                                "; give more ranks or memory, or a shorter --seq");
  }
  const plan::Candidate& best = r.fitting.front();
  train::TrainConfig c = in.source ? *in.source : train::TrainConfig{};
  if (!in.source && in.preset) c.preset = in.name;
  c.model = in.model;
  c.batch = in.workload.global_batch;
  c.micro_batch = best.layout.micro_batch;
  c.parallel = static_cast<const parallel::ParallelSpec&>(best.layout);
  if (in.workload.precision.bf16()) c.dtype = at::kBFloat16;
  // What train reads must be what was planned: a layout train refuses is the planner's error, said here.
  train::TrainConfig check = c;
  check.validate(static_cast<int>(world));

  std::string text = "# meshtrain plan --auto: " + in.name + " on " + std::to_string(world) + " rank(s) of " +
                     in.machine.name + ", " + std::to_string(c.batch) + " sequences of " +
                     std::to_string(c.model.context) + " tokens per step, " + in.workload.precision.name + "\n";
  text += "# chosen: " + best.layout.str() + format(": predicted %.4g s per step, %.4g tokens/s, MFU %.1f%%", best.time.step(),
                                                     best.time.tokens_per_second, 100 * best.time.mfu) +
          ", peak " + peak(best, in.machine) + " per rank\n";
  if (r.fitting.size() > 1) text += "# runners-up (predicted; what makes each slower):\n";
  for (size_t i = 1; i < r.fitting.size() && i < 5; ++i) {
    const plan::Candidate& other = r.fitting[i];
    text += "#   " + other.layout.str() + format(": %+.1f%% step time, ", 100 * (other.time.step() / best.time.step() - 1)) +
            why_slower(best.time, other.time) + "\n";
  }
  if (!r.rejected.empty()) text += "# closest that do not fit:\n";
  for (size_t i = 0; i < r.rejected.size() && i < 3; ++i) {
    text += "#   " + r.rejected[i].layout.str() + ": " + r.rejected[i].why_not + "\n";
  }
  text += "# Run it: meshtrain run -n " + std::to_string(world) + " train " + path + "\n\n" + c.to_toml();
  util::write_text_file(path, text);
  return text;
}

}  // namespace meshtrain::apps
