#include "meshtrain/parallel/pipeline/schedule.h"

#include "meshtrain/mesh/parallel_dims.h"

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

namespace meshtrain::parallel::pipeline {

namespace {

Action forward(int stage, int mb) { return {ActionKind::kForward, stage, mb}; }
Action backward(int stage, int mb) { return {ActionKind::kBackward, stage, mb}; }

void check_sizes(const std::string& name, int ranks, int virtual_stages, int microbatches) {
  auto fail = [&](const std::string& what) { throw ScheduleError("pipeline schedule '" + name + "': " + what); };
  if (ranks < 1) fail("needs at least 1 rank, got " + std::to_string(ranks));
  if (microbatches < 1) fail("needs at least 1 micro-batch, got " + std::to_string(microbatches));
  if (virtual_stages < 1) fail("needs at least 1 virtual stage per rank, got " + std::to_string(virtual_stages));
  if (virtual_stages > 1 && ranks < 2) fail("virtual stages need at least 2 ranks");
}

}  // namespace

std::string Action::str() const {
  static const char* const names[] = {"F", "B", "sendA", "recvA", "sendG", "recvG"};
  return names[static_cast<int>(kind)] + std::to_string(microbatch) + "@s" + std::to_string(stage);
}

Schedule make_schedule(const std::string& name, int ranks, int virtual_stages, int microbatches) {
  mesh::PipelineSchedule kind;
  try {
    kind = config::parse_name(mesh::pipeline_schedule_names(), "pp_schedule", name);
  } catch (const config::ConfigError& e) {
    throw ScheduleError("pipeline schedule '" + name + "': " + e.what());
  }
  return make_schedule(kind, ranks, virtual_stages, microbatches);
}

Schedule make_schedule(mesh::PipelineSchedule kind, int ranks, int virtual_stages, int microbatches) {
  // The layout rules (virtual stages, micro-batch counts) are ParallelDims'.
  mesh::ParallelDims dims;
  dims.pp = ranks;
  dims.dp = dims.fsdp = 1;
  dims.schedule = kind;
  dims.virtual_stages = virtual_stages;
  try {
    dims.check();
    dims.check_microbatches(microbatches);
  } catch (const mesh::LayoutError& e) {
    throw ScheduleError("pipeline schedule '" + mesh::schedule_name(kind) + "': " + e.what());
  }
  switch (kind) {
    case mesh::PipelineSchedule::kGpipe: return gpipe(ranks, microbatches);
    case mesh::PipelineSchedule::kOneFOneB: return one_f_one_b(ranks, microbatches);
    case mesh::PipelineSchedule::kInterleaved: break;
  }
  return interleaved_1f1b(ranks, virtual_stages, microbatches);
}

Schedule gpipe(int ranks, int microbatches) {
  check_sizes("gpipe", ranks, 1, microbatches);
  std::vector<std::vector<Action>> order(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < microbatches; ++i) order[r].push_back(forward(r, i));
    for (int i = 0; i < microbatches; ++i) order[r].push_back(backward(r, i));
  }
  return with_communication("gpipe", ranks, 1, microbatches, true, order);
}

Schedule one_f_one_b(int ranks, int microbatches) {
  check_sizes("1f1b", ranks, 1, microbatches);
  std::vector<std::vector<Action>> order(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - r - 1, microbatches);
    int next_forward = 0, next_backward = 0;
    for (; next_forward < warmup; ++next_forward) order[r].push_back(forward(r, next_forward));
    while (next_forward < microbatches) {
      order[r].push_back(forward(r, next_forward++));
      order[r].push_back(backward(r, next_backward++));
    }
    while (next_backward < microbatches) order[r].push_back(backward(r, next_backward++));
  }
  return with_communication("1f1b", ranks, 1, microbatches, true, order);
}

Schedule interleaved_1f1b(int ranks, int virtual_stages, int microbatches) {
  check_sizes("interleaved", ranks, virtual_stages, microbatches);
  if (microbatches % ranks != 0) {
    throw ScheduleError("pipeline schedule 'interleaved': micro-batches (" + std::to_string(microbatches) +
                        ") must be a multiple of the pipeline ranks (" + std::to_string(ranks) + ")");
  }
  const int p = ranks, v = virtual_stages, total = microbatches * v;
  // The k-th forward (backward) of a rank: micro-batches go round in groups
  // of p through chunk 0, 1, ... (backward: v-1, v-2, ...).
  auto chunk = [&](int k, bool is_forward) {
    const int c = (k % (p * v)) / p;
    return is_forward ? c : v - 1 - c;
  };
  auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(total, (p - r - 1) * 2 + (v - 1) * p);
    auto f = [&](int k) { return forward(chunk(k, true) * p + r, microbatch(k)); };
    auto b = [&](int k) { return backward(chunk(k, false) * p + r, microbatch(k)); };
    for (int k = 0; k < warmup; ++k) order[r].push_back(f(k));
    for (int k = 0; k < total - warmup; ++k) {
      order[r].push_back(f(warmup + k));
      order[r].push_back(b(k));
    }
    for (int k = total - warmup; k < total; ++k) order[r].push_back(b(k));
  }
  return with_communication("interleaved", p, v, microbatches, true, order);
}

Schedule forward_only(int ranks, int virtual_stages, int microbatches) {
  check_sizes("forward", ranks, virtual_stages, microbatches);
  std::vector<std::vector<Action>> order(ranks);
  for (int i = 0; i < microbatches; ++i) {
    for (int s = 0; s < ranks * virtual_stages; ++s) order[s % ranks].push_back(forward(s, i));
  }
  return with_communication("forward", ranks, virtual_stages, microbatches, false, order);
}

Schedule with_communication(std::string name, int ranks, int virtual_stages, int microbatches, bool has_backward,
                            const std::vector<std::vector<Action>>& computations) {
  Schedule s;
  s.name = std::move(name);
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.microbatches = microbatches;
  s.backward = has_backward;
  s.actions.resize(ranks);
  const int last = s.stages() - 1;
  for (int r = 0; r < ranks; ++r) {
    for (const Action& a : computations.at(r)) {
      std::vector<Action>& out = s.actions[r];
      if (a.kind == ActionKind::kForward) {
        if (a.stage > 0) out.push_back({ActionKind::kRecvActivation, a.stage, a.microbatch});
        out.push_back(a);
        if (a.stage < last) out.push_back({ActionKind::kSendActivation, a.stage, a.microbatch});
      } else {
        if (a.stage < last) out.push_back({ActionKind::kRecvGradient, a.stage, a.microbatch});
        out.push_back(a);
        if (a.stage > 0) out.push_back({ActionKind::kSendGradient, a.stage, a.microbatch});
      }
    }
  }
  return s;
}

double ScheduleReport::mean_bubble() const {
  return bubble.empty() ? 0.0 : std::accumulate(bubble.begin(), bubble.end(), 0.0) / bubble.size();
}

double theoretical_bubble(int ranks, int virtual_stages, int microbatches) {
  return double(ranks - 1) / (double(virtual_stages) * microbatches + ranks - 1);
}

namespace {

[[noreturn]] void fail_at(const Schedule& s, int rank, const Action* a, const std::string& what) {
  throw ScheduleError("pipeline schedule '" + s.name + "': rank " + std::to_string(rank) +
                      (a ? ", action " + a->str() : std::string()) + ": " + what);
}

// Each computation once, on its stage's rank, in range, every one present;
// communication only towards a neighbouring stage.
void check_actions(const Schedule& s) {
  const int p = s.ranks, stages = s.stages(), m = s.microbatches, last = stages - 1;
  if (static_cast<int>(s.actions.size()) != p) {
    throw ScheduleError("pipeline schedule '" + s.name + "': has action lists for " + std::to_string(s.actions.size()) +
                        " ranks, not " + std::to_string(p));
  }
  std::set<std::tuple<int, int, int>> seen;  // (kind, stage, mb)
  for (int r = 0; r < p; ++r) {
    for (const Action& a : s.actions[r]) {
      if (a.stage < 0 || a.stage >= stages || a.microbatch < 0 || a.microbatch >= m) fail_at(s, r, &a, "stage or micro-batch out of range");
      if (s.rank_of(a.stage) != r) fail_at(s, r, &a, "stage " + std::to_string(a.stage) + " runs on rank " + std::to_string(s.rank_of(a.stage)));
      if (a.kind == ActionKind::kBackward && !s.backward) fail_at(s, r, &a, "a backward in a forward-only schedule");
      if ((a.kind == ActionKind::kSendActivation && a.stage == last) || (a.kind == ActionKind::kRecvActivation && a.stage == 0) ||
          (a.kind == ActionKind::kSendGradient && a.stage == 0) || (a.kind == ActionKind::kRecvGradient && a.stage == last)) {
        fail_at(s, r, &a, "has no neighbouring stage to talk to");
      }
      if (!seen.insert({static_cast<int>(a.kind), a.stage, a.microbatch}).second) fail_at(s, r, &a, "appears twice");
    }
  }
  for (int st = 0; st < stages; ++st) {
    for (int i = 0; i < m; ++i) {
      if (!seen.count({static_cast<int>(ActionKind::kForward), st, i})) fail_at(s, s.rank_of(st), nullptr, "no forward of micro-batch " + std::to_string(i) + " through stage " + std::to_string(st));
      if (s.backward && !seen.count({static_cast<int>(ActionKind::kBackward), st, i})) fail_at(s, s.rank_of(st), nullptr, "no backward of micro-batch " + std::to_string(i) + " through stage " + std::to_string(st));
    }
  }
}

// Every rank runs its actions in order; a receive waits for the matching
// send, messages between two ranks of one kind arriving in send order.
// Computations take their cost on the rank's clock, a receive waits for the
// sender's clock at the send.
class Simulation {
 public:
  Simulation(const Schedule& s, double forward_cost, double backward_cost)
      : s_(s), forward_cost_(forward_cost), backward_cost_(backward_cost), pc_(s.ranks, 0), clock_(s.ranks, 0.0),
        stashed_(s.ranks, 0), got_input_(s.ranks), got_grad_(s.ranks), forwarded_(s.ranks), backwarded_(s.ranks) {
    report_.busy.assign(s.ranks, 0.0);
    report_.peak_stashed.assign(s.ranks, 0);
  }

  ScheduleReport run() {
    while (!done()) {
      bool progressed = false;
      for (int r = 0; r < s_.ranks; ++r) {
        while (pc_[r] < s_.actions[r].size() && step(r, s_.actions[r][pc_[r]])) {
          ++pc_[r];
          progressed = true;
        }
      }
      if (!progressed) deadlock();
    }
    check_drained();
    report_.step_time = *std::max_element(clock_.begin(), clock_.end());
    for (int r = 0; r < s_.ranks; ++r) {
      report_.bubble.push_back(report_.step_time > 0 ? 1.0 - report_.busy[r] / report_.step_time : 0.0);
    }
    return report_;
  }

 private:
  using Channel = std::tuple<int, int, bool>;     // (source rank, destination rank, gradient?)
  using Message = std::tuple<int, int, double>;  // (stage it is for, micro-batch, time sent)

  bool done() const {
    for (int r = 0; r < s_.ranks; ++r) {
      if (pc_[r] < s_.actions[r].size()) return false;
    }
    return true;
  }

  // Runs rank r's action `a`; false when it waits for a message not sent yet.
  bool step(int r, const Action& a) {
    const std::pair<int, int> key{a.stage, a.microbatch};
    const int last = s_.stages() - 1;
    switch (a.kind) {
      case ActionKind::kForward:
        if (a.stage > 0 && !got_input_[r].count(key)) fail_at(s_, r, &a, "its input was never received (no recvA before it)");
        compute(r, forward_cost_);
        forwarded_[r].insert(key);
        if (s_.backward) report_.peak_stashed[r] = std::max(report_.peak_stashed[r], ++stashed_[r]);
        return true;
      case ActionKind::kBackward:
        if (!forwarded_[r].count(key)) fail_at(s_, r, &a, "runs before its forward");
        if (a.stage < last && !got_grad_[r].count(key)) fail_at(s_, r, &a, "its output gradient was never received (no recvG before it)");
        compute(r, backward_cost_);
        backwarded_[r].insert(key);
        --stashed_[r];
        return true;
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient: {
        const bool grad = a.kind == ActionKind::kSendGradient;
        if (!(grad ? backwarded_[r] : forwarded_[r]).count(key)) fail_at(s_, r, &a, "sends what was not computed yet");
        const int to = grad ? a.stage - 1 : a.stage + 1;
        channels_[{r, s_.rank_of(to), grad}].emplace_back(to, a.microbatch, clock_[r]);
        return true;
      }
      case ActionKind::kRecvActivation:
      case ActionKind::kRecvGradient:
        break;
    }
    return receive(r, a);
  }

  void compute(int r, double cost) {
    clock_[r] += cost;
    report_.busy[r] += cost;
  }

  bool receive(int r, const Action& a) {
    const bool grad = a.kind == ActionKind::kRecvGradient;
    const int from = grad ? a.stage + 1 : a.stage - 1;
    auto& channel = channels_[{s_.rank_of(from), r, grad}];
    if (channel.empty()) return false;
    const auto [stage, mb, sent] = channel.front();
    if (stage != a.stage || mb != a.microbatch) {
      fail_at(s_, r, &a, "would match rank " + std::to_string(s_.rank_of(from)) + "'s earlier message for micro-batch " +
                             std::to_string(mb) + " of stage " + std::to_string(stage) + " (messages arrive in send order)");
    }
    channel.pop_front();
    clock_[r] = std::max(clock_[r], sent);
    (grad ? got_grad_[r] : got_input_[r]).insert({a.stage, a.microbatch});
    return true;
  }

  [[noreturn]] void deadlock() const {
    std::string waits;
    for (int r = 0; r < s_.ranks; ++r) {
      if (pc_[r] < s_.actions[r].size()) waits += (waits.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " at " + s_.actions[r][pc_[r]].str();
    }
    throw ScheduleError("pipeline schedule '" + s_.name + "': deadlock: every rank waits for a message no rank will send (" + waits + ")");
  }

  // Every message sent is received.
  void check_drained() const {
    for (const auto& [channel, messages] : channels_) {
      if (messages.empty()) continue;
      const auto& [stage, mb, sent] = messages.front();
      (void)sent;
      fail_at(s_, std::get<0>(channel), nullptr, "sends " + std::string(std::get<2>(channel) ? "a gradient" : "an activation") +
                                                     " of micro-batch " + std::to_string(mb) + " for stage " + std::to_string(stage) +
                                                     " that rank " + std::to_string(std::get<1>(channel)) + " never receives");
    }
  }

  const Schedule& s_;
  const double forward_cost_, backward_cost_;
  std::map<Channel, std::deque<Message>> channels_;  // messages in flight, in send order
  std::vector<size_t> pc_;
  std::vector<double> clock_;
  std::vector<int> stashed_;
  // Per rank: what has been received / computed, by (stage, mb).
  std::vector<std::set<std::pair<int, int>>> got_input_, got_grad_, forwarded_, backwarded_;
  ScheduleReport report_;
};

}  // namespace

int losses_in_flight(const Schedule& schedule) {
  const int last = schedule.stages() - 1;
  int waiting = 0, most = 0;
  for (const Action& a : schedule.actions[schedule.rank_of(last)]) {
    if (a.stage != last) continue;
    if (a.kind == ActionKind::kForward) most = std::max(most, ++waiting);
    if (a.kind == ActionKind::kBackward) --waiting;
  }
  return most;
}

ScheduleReport validate(const Schedule& s, double forward_cost, double backward_cost) {
  check_actions(s);
  return Simulation(s, forward_cost, backward_cost).run();
}

}  // namespace meshtrain::parallel::pipeline
