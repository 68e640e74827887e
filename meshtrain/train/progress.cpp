#include "meshtrain/train/progress.h"

#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <cmath>
#include <cstdio>
#include <cstring>

namespace meshtrain::train {

namespace {

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

}  // namespace

std::string human_duration(double seconds) {
  char text[32];
  const auto s = static_cast<long long>(seconds + 0.5);
  if (s >= 3600) std::snprintf(text, sizeof text, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else if (s >= 60) std::snprintf(text, sizeof text, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(text, sizeof text, "%llds", s);
  return text;
}

Progress::Progress(std::shared_ptr<comm::Communicator> world, const std::string& out_dir, bool append,
                   at::Device device)
    : world_(std::move(world)), device_(device) {
  if (!leader()) return;
  util::make_directories(out_dir);
  metrics_.open(out_dir + "/metrics.jsonl", append ? std::ios::app : std::ios::trunc);
}

void Progress::say(const std::string& text) const {
  if (!leader()) return;
  std::printf("meshtrain: %s\n", text.c_str());
  std::fflush(stdout);
}

void Progress::warn(const std::string& text) const {
  if (!leader()) return;
  std::fprintf(stderr, "meshtrain: warning: %s\n", text.c_str());
  std::fflush(stderr);
}

void Progress::event(const std::string& json_object) {
  if (!leader()) return;
  metrics_ << json_object << "\n";
  metrics_.flush();
}

void Progress::step(const StepResult& result, std::optional<double> val_loss, double tokens_per_second, double mfu,
                    int64_t total_steps, double eta_seconds, bool print) {
  // Per rank, in MiB: peak RSS, then the counted tensor memory of the step.
  constexpr double kMiB = 1048576.0;
  const memory::DeviceStats device = memory::device_stats(device_);
  const std::vector<double> mine = {peak_rss_mib(),
                                    result.memory.model_states / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kForward)] / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kBackward)] / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kOptimizer)] / kMiB,
                                    device.peak / kMiB};
  const int64_t fields = static_cast<int64_t>(mine.size());
  at::Tensor all = at::empty({world_->size() * fields}, at::kDouble);
  world_->all_gather(all, at::tensor(mine, at::kDouble)).wait();
  if (!leader()) return;
  auto column = [&](int64_t field) {
    std::vector<double> values;
    for (int r = 0; r < world_->size(); ++r) values.push_back(std::round(all[r * fields + field].item<double>() * 100) / 100);
    return values;
  };
  nlohmann::json line = {{"step", result.step},
                         {"loss", result.loss},
                         {"lr", result.lr},
                         {"grad_norm", result.grad_norm},
                         {"tokens_per_s", tokens_per_second},
                         {"mfu", mfu},
                         {"step_seconds", result.seconds},
                         {"peak_rss_mib", column(0)},
                         {"memory_mib", {{"model_states", column(1)},
                                         {"forward_peak", column(2)},
                                         {"backward_peak", column(3)},
                                         {"optimizer_peak", column(4)}}}};
  if (device.peak > 0) line["memory_mib"]["device_peak"] = column(5);
  if (val_loss) line["val_loss"] = *val_loss;
  if (result.skipped) line["skipped"] = "non-finite loss or gradient norm: not applied";
  // Mixture of experts: per layer, and the means over layers for the progress line.
  double aux = 0, dropped = 0, load = 0;
  for (const model::MoeLayerMetrics& m : result.moe) {
    line["moe"].push_back({{"block", m.block}, {"aux_loss", m.aux_loss}, {"z_loss", m.z_loss}, {"dropped", m.dropped},
                           {"load_max_over_mean", m.load_max_over_mean}, {"rank_load", m.rank_load}});
    aux += (m.aux_loss + m.z_loss) / result.moe.size();
    dropped += m.dropped / result.moe.size();
    load = std::max(load, m.load_max_over_mean);
  }
  event(line.dump());
  if (!print) return;
  char val[32] = "", experts[96] = "";
  if (val_loss) std::snprintf(val, sizeof val, " | val %.4f", *val_loss);
  if (!result.moe.empty()) {
    std::snprintf(experts, sizeof experts, " | aux %.4f | dropped %.1f%% | load %.2f", aux, 100 * dropped, load);
  }
  if (result.skipped) std::snprintf(val + std::strlen(val), sizeof val - std::strlen(val), " | SKIPPED");
  std::printf("step %5lld/%lld | loss %.4f%s%s | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.1f%% | mem %s | ETA %s\n",
              (long long)result.step, (long long)total_steps, result.loss, val, experts, result.lr, result.grad_norm,
              tokens_per_second, 100 * mfu,
              device.peak > 0 ? ("GPU " + memory::format_mib(device.peak)).c_str()
                              : memory::format_mib(result.memory.peak()).c_str(),
              human_duration(eta_seconds).c_str());
  std::fflush(stdout);
}

}  // namespace meshtrain::train
