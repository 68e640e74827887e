#include "meshtrain/train/op_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <unordered_map>

namespace meshtrain::train {

namespace profiler = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

OpProfile::OpProfile(bool cuda) : cuda_(cuda) {
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                    /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
                                    /*with_modules=*/false);
  std::set<impl::ActivityType> activities = {impl::ActivityType::CPU};
  if (cuda) activities.insert(impl::ActivityType::CUDA);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  running_ = true;
}

OpProfile::~OpProfile() {
  if (running_) profiler::disableProfiler();
}

namespace {

struct Span {
  uint64_t start, end;
  size_t row;
};

// Self time: an operator's duration less its direct children's on the same
// thread (spans nest: a child lies within its parent).
std::vector<OpTime> self_times(const std::vector<profiler::KinetoEvent>& events) {
  std::map<uint64_t, std::vector<const profiler::KinetoEvent*>> by_thread;
  for (const profiler::KinetoEvent& e : events) {
    if (e.deviceType() != c10::DeviceType::CPU || e.isAsync() || e.endNs() <= e.startNs()) continue;
    by_thread[e.startThreadId()].push_back(&e);
  }
  std::vector<OpTime> rows;
  std::unordered_map<std::string, size_t> row_of;
  for (auto& [thread, list] : by_thread) {
    std::sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
      return a->startNs() != b->startNs() ? a->startNs() < b->startNs() : a->endNs() > b->endNs();
    });
    std::vector<Span> open;
    for (const profiler::KinetoEvent* e : list) {
      while (!open.empty() && open.back().end <= e->startNs()) open.pop_back();
      const std::string name = e->name();
      auto [it, added] = row_of.emplace(name, rows.size());
      if (added) rows.push_back({name, 0, 0});
      OpTime& row = rows[it->second];
      const double seconds = static_cast<double>(e->endNs() - e->startNs()) * 1e-9;
      row.calls += 1;
      row.self_seconds += seconds;
      if (!open.empty()) rows[open.back().row].self_seconds -= seconds;
      open.push_back({e->startNs(), e->endNs(), it->second});
    }
  }
  std::sort(rows.begin(), rows.end(), [](const OpTime& a, const OpTime& b) { return a.self_seconds > b.self_seconds; });
  return rows;
}

// The device's events (kernels, copies, fills) summed by name: they do not
// nest, so an event's time is its own.
std::vector<OpTime> device_times(const std::vector<profiler::KinetoEvent>& events) {
  std::vector<OpTime> rows;
  std::unordered_map<std::string, size_t> row_of;
  for (const profiler::KinetoEvent& e : events) {
    if (e.deviceType() == c10::DeviceType::CPU || e.endNs() <= e.startNs()) continue;
    auto [it, added] = row_of.emplace(e.name(), rows.size());
    if (added) rows.push_back({e.name(), 0, 0});
    rows[it->second].calls += 1;
    rows[it->second].self_seconds += static_cast<double>(e.endNs() - e.startNs()) * 1e-9;
  }
  std::sort(rows.begin(), rows.end(), [](const OpTime& a, const OpTime& b) { return a.self_seconds > b.self_seconds; });
  return rows;
}

double total_seconds(const std::vector<OpTime>& ops) {
  double total = 0;
  for (const OpTime& op : ops) total += op.self_seconds;
  return total;
}

}  // namespace

std::vector<OpTime> OpProfile::stop(const std::string& trace_path) {
  running_ = false;
  if (cuda_) torch::cuda::synchronize();  // the last step's kernels finish inside the profile
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  if (!trace_path.empty()) result->save(trace_path);
  kernels_ = device_times(result->events());
  return self_times(result->events());
}

std::string op_times_json(const std::vector<OpTime>& ops, int steps) {
  const double total = total_seconds(ops);
  nlohmann::json rows = nlohmann::json::array();
  for (const OpTime& op : ops) {
    rows.push_back({{"name", op.name},
                    {"calls_per_step", static_cast<double>(op.calls) / steps},
                    {"self_ms_per_step", 1e3 * op.self_seconds / steps},
                    {"share", total > 0 ? op.self_seconds / total : 0.0}});
  }
  return rows.dump();
}

std::string op_times_table(const std::vector<OpTime>& ops, int steps, size_t top, const std::string& row,
                           const std::string& time) {
  const double total = total_seconds(ops);
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-64s %8s %12s %7s\n", (row + " (" + time + ")").c_str(), "calls", "ms/step", "share");
  out += line;
  for (size_t i = 0; i < std::min(top, ops.size()); ++i) {
    const OpTime& op = ops[i];
    std::snprintf(line, sizeof line, "%-64.64s %8.0f %12.2f %6.1f%%\n", op.name.c_str(),
                  static_cast<double>(op.calls) / steps, 1e3 * op.self_seconds / steps, 100 * op.self_seconds / total);
    out += line;
  }
  std::snprintf(line, sizeof line, "%-64s %8s %12.2f %6.1f%%\n", ("all " + row + "s").c_str(), "", 1e3 * total / steps, 100.0);
  out += line;
  return out;
}

}  // namespace meshtrain::train
