#include "meshtrain/train/progress.h"

#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace meshtrain::train {

// The high-water mark of this process image (VmHWM). Not getrusage's
// ru_maxrss: Linux carries that across exec, so a process started by a large
// parent (a Python script that imported torch) reported the parent's size,
// 280 MiB for a 180 MiB prepare.
double peak_rss_mib() {
  if (std::FILE* status = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long long kib = -1;
    while (std::fgets(line, sizeof line, status)) {
      if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) break;
    }
    std::fclose(status);
    if (kib >= 0) return static_cast<double>(kib) / 1024.0;
  }
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

std::string human_duration(double seconds) {
  char text[32];
  const auto s = static_cast<long long>(seconds + 0.5);
  if (s >= 3600) std::snprintf(text, sizeof text, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else if (s >= 60) std::snprintf(text, sizeof text, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(text, sizeof text, "%llds", s);
  return text;
}

// Note [Metrics lines]
// metrics.jsonl is read while it grows (tail -f, dashboards) and after a
// crash, so each line goes out in one write(2) on a descriptor opened with
// O_APPEND: a reader sees whole lines, and a process killed mid-run leaves
// at most one torn last line. Reopening the file to append (a resumed run)
// cuts such a tail off, with a warning, so the next line starts clean. A
// line that cannot be written (a full disk) is taken back to the last whole
// line and said once; training goes on (the checkpoints are what resume
// needs). A resume writes a "resumed" line: the rows of later steps above it
// came from the run that was interrupted, and the rows below replace them.

namespace {

// Cuts `fd`'s content after its last newline; returns the bytes cut.
int64_t cut_torn_tail(int fd) {
  struct stat info {};
  if (fstat(fd, &info) != 0 || info.st_size == 0) return 0;
  int64_t end = info.st_size;
  char c = 0;
  while (end > 0 && pread(fd, &c, 1, end - 1) == 1 && c != '\n') --end;
  if (end == info.st_size || ftruncate(fd, end) != 0) return 0;
  return info.st_size - end;
}

}  // namespace

Progress::Progress(std::shared_ptr<comm::Communicator> world, const std::string& out_dir, bool append,
                   at::Device device)
    : world_(std::move(world)), device_(device) {
  if (!leader()) return;
  util::make_directories(out_dir);
  metrics_path_ = out_dir + "/metrics.jsonl";
  metrics_fd_ = ::open(metrics_path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC | (append ? 0 : O_TRUNC), 0644);
  if (metrics_fd_ < 0) throw std::runtime_error("cannot open " + metrics_path_ + ": " + std::strerror(errno));
  if (const int64_t cut = append ? cut_torn_tail(metrics_fd_) : 0; cut > 0) {
    warn(metrics_path_ + " ended in a torn line (" + std::to_string(cut) + " bytes, from a run stopped mid-write); "
         "removed it");
  }
}

Progress::~Progress() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
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
  if (!leader() || metrics_fd_ < 0) return;
  const std::string line = json_object + "\n";
  struct stat info {};
  const off_t before = fstat(metrics_fd_, &info) == 0 ? info.st_size : -1;
  size_t written = 0;
  errno = 0;
  while (written < line.size()) {  // one write, unless the disk takes only part of it
    const ssize_t n = ::write(metrics_fd_, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  if (written == line.size()) return;
  const std::string why = written < line.size() && errno != 0 ? std::strerror(errno) : "nothing was written";
  if (written > 0 && before >= 0) (void)!ftruncate(metrics_fd_, before);  // no half line
  if (!metrics_failed_) warn("cannot write " + metrics_path_ + " (" + why + "); metrics lines are lost until it can");
  metrics_failed_ = true;
}

int64_t Progress::resumed(int64_t step, const std::string& checkpoint) {
  if (!leader()) return 0;
  int64_t superseded = 0;
  try {
    const std::string text = util::read_text_file(metrics_path_);
    for (size_t start = 0, end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
      const nlohmann::json row = nlohmann::json::parse(text.begin() + start, text.begin() + end, nullptr, false);
      if (row.is_object() && !row.contains("event") && row.value("step", int64_t{0}) > step) ++superseded;
    }
  } catch (const std::runtime_error&) {
    // No metrics from the run before: nothing is superseded.
  }
  event(nlohmann::json{{"event", "resumed"}, {"step", step}, {"checkpoint", checkpoint}, {"superseded_rows", superseded}}
            .dump());
  if (superseded > 0) {
    warn("the run before logged " + std::to_string(superseded) + " step(s) after step " + std::to_string(step) +
         " that no checkpoint kept: they are lost and trained again (in " + metrics_path_ + ", " +
         std::to_string(superseded) + " rows after step " + std::to_string(step) +
         " are from the run before this resume; the rows after its \"resumed\" line replace them)");
  }
  return superseded;
}

void Progress::restarted(int64_t step, int64_t steps_redone, int ranks, const Relaunch& relaunch) {
  if (!leader() || relaunch.attempt <= 0) return;
  const int ranks_before = relaunch.ranks_before > 0 ? relaunch.ranks_before : ranks;
  event(nlohmann::json{{"event", "restart"}, {"attempt", relaunch.attempt}, {"cause", relaunch.cause},
                       {"step", step}, {"steps_redone", steps_redone}, {"ranks", ranks},
                       {"ranks_before", ranks_before}}.dump());
  say("restart " + std::to_string(relaunch.attempt) + ": resumed at step " + std::to_string(step) + ", " +
      std::to_string(steps_redone) + " logged step(s) to redo" +
      (ranks_before != ranks ? ", on " + std::to_string(ranks) + " ranks (" + std::to_string(ranks_before) + " before)"
                             : ""));
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
    nlohmann::json by_ep = nlohmann::json::object();
    for (const auto& [ep, at_ep] : m.rank_load_by_ep) by_ep[std::to_string(ep)] = at_ep;
    line["moe"].push_back({{"block", m.block}, {"aux_loss", m.aux_loss}, {"z_loss", m.z_loss}, {"dropped", m.dropped},
                           {"load_max_over_mean", m.load_max_over_mean}, {"rank_load", m.rank_load},
                           {"ep", m.ep}, {"rank_load_by_ep", by_ep}});
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
