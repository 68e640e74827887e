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
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true,
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

using Spans = std::map<uint64_t, std::vector<const profiler::KinetoEvent*>>;

// Each thread's CPU operators (timed, not async) whose names `keep` accepts, in
// order of start, an operator before those it calls (spans nest: a child lies
// within its parent).
template <typename Keep>
Spans cpu_spans_by_thread(const std::vector<profiler::KinetoEvent>& events, const Keep& keep) {
  Spans by_thread;
  for (const profiler::KinetoEvent& e : events) {
    if (e.deviceType() != c10::DeviceType::CPU || e.isAsync() || e.endNs() <= e.startNs()) continue;
    if (keep(e.name())) by_thread[e.startThreadId()].push_back(&e);
  }
  for (auto& [thread, list] : by_thread) {
    std::sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
      return a->startNs() != b->startNs() ? a->startNs() < b->startNs() : a->endNs() > b->endNs();
    });
  }
  return by_thread;
}

// Self time: an operator's duration less its direct children's on the same thread.
std::vector<OpTime> self_times(const std::vector<profiler::KinetoEvent>& events) {
  std::vector<OpTime> rows;
  std::unordered_map<std::string, size_t> row_of;
  for (auto& [thread, list] : cpu_spans_by_thread(events, [](const std::string&) { return true; })) {
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

// Whether product `name`'s first operand is the one it adds into (addmm's bias).
bool adds_into(const std::string& name) {
  return name == "aten::addmm" || name == "aten::addmm_" || name == "aten::baddbmm";
}

// Whether `name` is a product the table counts.
bool is_product(const std::string& name) { return name == "aten::mm" || name == "aten::bmm" || adds_into(name); }

// "[2048, 384] x [384, 1536]": the two multiplied operands' sizes, from sizes[first].
std::string operand_text(const std::vector<std::vector<int64_t>>& sizes, size_t first) {
  std::string out;
  for (size_t i = first; i < std::min(sizes.size(), first + 2); ++i) {
    if (!out.empty()) out += " x ";
    out += "[";
    for (size_t j = 0; j < sizes[i].size(); ++j) out += (j ? ", " : "") + std::to_string(sizes[i][j]);
    out += "]";
  }
  return out;
}

// The outermost products on each thread, summed by name and operand sizes.
std::vector<ProductTime> product_times(const std::vector<profiler::KinetoEvent>& events) {
  std::vector<ProductTime> rows;
  std::unordered_map<std::string, size_t> row_of;
  for (auto& [thread, list] : cpu_spans_by_thread(events, is_product)) {
    uint64_t open_until = 0;
    for (const profiler::KinetoEvent* e : list) {
      if (e->startNs() < open_until) continue;  // inside the product before it
      open_until = e->endNs();
      std::vector<std::vector<int64_t>> sizes;
      if (e->hasShapes()) sizes.assign(e->shapes().begin(), e->shapes().end());
      const std::string name = e->name();
      const std::string operands = operand_text(sizes, adds_into(name) ? 1 : 0);
      auto [it, added] = row_of.emplace(name + " " + operands, rows.size());
      if (added) rows.push_back({name, operands, 0, 0, 0});
      ProductTime& row = rows[it->second];
      row.calls += 1;
      row.seconds += static_cast<double>(e->endNs() - e->startNs()) * 1e-9;
      row.flops += product_flops(name, sizes);
    }
  }
  std::sort(rows.begin(), rows.end(), [](const ProductTime& a, const ProductTime& b) { return a.seconds > b.seconds; });
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
  if (!cuda_) products_ = product_times(result->events());  // a GPU product's CPU time is its launch
  return self_times(result->events());
}

double product_flops(const std::string& name, const std::vector<std::vector<int64_t>>& sizes) {
  if (!is_product(name)) return 0;
  const bool batched = name == "aten::bmm" || name == "aten::baddbmm";
  const size_t a = adds_into(name) ? 1 : 0, rank = batched ? 3 : 2;
  if (sizes.size() < a + 2 || sizes[a].size() != rank || sizes[a + 1].size() != rank) return 0;
  const std::vector<int64_t>& x = sizes[a];
  const double batch = batched ? static_cast<double>(x[0]) : 1.0;
  return 2.0 * batch * static_cast<double>(x[rank - 2]) * static_cast<double>(x[rank - 1]) *
         static_cast<double>(sizes[a + 1][rank - 1]);
}

std::string products_json(const std::vector<ProductTime>& products, int steps, double peak_flops) {
  nlohmann::json rows = nlohmann::json::array();
  for (const ProductTime& p : products) {
    const double rate = p.seconds > 0 ? p.flops / p.seconds : 0;
    rows.push_back({{"name", p.name},
                    {"operands", p.operands},
                    {"calls_per_step", static_cast<double>(p.calls) / steps},
                    {"ms_per_step", 1e3 * p.seconds / steps},
                    {"gflop_per_step", p.flops / steps / 1e9},
                    {"gflops", rate / 1e9},
                    {"share_of_peak", peak_flops > 0 ? nlohmann::json(rate / peak_flops) : nlohmann::json()}});
  }
  return rows.dump();
}

std::string products_table(const std::vector<ProductTime>& products, int steps, size_t top, double peak_flops) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-14s %-40s %6s %10s %8s %6s\n", "product", "operands", "calls", "ms/step",
                "GFLOP/s", "peak");
  out += line;
  double seconds = 0, flops = 0;
  for (const ProductTime& p : products) seconds += p.seconds, flops += p.flops;
  auto add_row = [&](const std::string& name, const std::string& operands, double calls, double s, double f) {
    const double rate = s > 0 ? f / s : 0;
    const std::string peak = peak_flops > 0 ? std::to_string(static_cast<int>(100 * rate / peak_flops + 0.5)) + "%" : "-";
    const std::string count = calls > 0 ? std::to_string(static_cast<int64_t>(calls + 0.5)) : "";
    std::snprintf(line, sizeof line, "%-14.14s %-40.40s %6s %10.2f %8.0f %6s\n", name.c_str(), operands.c_str(),
                  count.c_str(), 1e3 * s / steps, rate / 1e9, peak.c_str());
    out += line;
  };
  for (size_t i = 0; i < std::min(top, products.size()); ++i) {
    const ProductTime& p = products[i];
    add_row(p.name, p.operands, static_cast<double>(p.calls) / steps, p.seconds, p.flops);
  }
  add_row("all products", "", 0, seconds, flops);
  return out;
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
