// meshtrain bench pp: every pipeline schedule for pp = 2 and 4 and 4, 8, 16
// micro-batches, in one run: the bubble measured from the executor's spans
// against the theory, point-to-point cost, tokens/s, and the peak activation
// memory per stage for gpipe, 1f1b and 1f1b with activation checkpointing.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/apps/bench_util.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/pipeline/trace.h"
#include "meshtrain/train/prepare.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/cores.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cstdio>
#include <thread>

namespace meshtrain::apps {

namespace {

namespace pipe = parallel::pipeline;

// One-way time of one activation between pipeline ranks 0 and 1 (ping-pong, median of 20).
double message_seconds(comm::Communicator& group, const std::vector<int64_t>& shape) {
  at::Tensor buffer = at::zeros(shape, at::kFloat);
  std::vector<double> times;
  for (int i = 0; i < 21; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (group.rank() == 0) {
      group.send(buffer, 1).wait();
      group.recv(buffer, 1).wait();
    } else if (group.rank() == 1) {
      group.recv(buffer, 0).wait();
      group.send(buffer, 0).wait();
    }
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  group.barrier().wait();
  return median(times);
}

struct ScheduleMeasured {
  double step_seconds = 0;
  double bubble = 0;            // measured, mean over ranks, median over steps
  double simulated = 0;         // the schedule simulated with the measured forward/backward times
  double recv_wait = 0;         // share of the step spent waiting to receive, mean over ranks
  std::vector<double> activation_mib;  // per stage (pipeline rank): peak in use in forward/backward above model states
};

ScheduleMeasured measure(const train::TrainConfig& config, const std::shared_ptr<comm::Communicator>& group, int warmup,
                 int steps, std::vector<std::vector<pipe::Span>>* trace) {
  train::Trainer trainer(config, group);
  ScheduleMeasured out;
  std::vector<double> seconds, bubbles, simulated, waits;
  at::Tensor activation = at::zeros({group->size()}, at::kDouble);
  for (int s = 0; s < warmup + steps; ++s) {
    const train::StepResult result = trainer.step();
    const auto ranks = pipe::gather_spans(*group, trainer.parts().pipeline->executor().spans(), 0);
    const int64_t peak = std::max(result.memory.phase_peak[int(memory::Phase::kForward)],
                                  result.memory.phase_peak[int(memory::Phase::kBackward)]);
    at::Tensor mine = at::zeros({group->size()}, at::kDouble);
    mine[group->rank()] = double(peak - result.memory.model_states) / 1048576.0;
    group->all_reduce(mine).wait();
    if (s < warmup || group->rank() != 0) continue;
    activation = at::maximum(activation, mine);
    seconds.push_back(result.seconds);
    const std::vector<double> b = pipe::measured_bubble(ranks);
    bubbles.push_back(std::accumulate(b.begin(), b.end(), 0.0) / b.size());
    double forward = 0, backward = 0, wait = 0, total = 0;
    int64_t forwards = 0, backwards = 0;
    for (const auto& spans : ranks) {
      double first = 1e300, last = -1e300;
      for (const pipe::Span& x : spans) {
        first = std::min(first, x.start);
        last = std::max(last, x.end);
        if (x.kind == pipe::SpanKind::kForward) forward += x.end - x.start, ++forwards;
        if (x.kind == pipe::SpanKind::kBackward) backward += x.end - x.start, ++backwards;
        if (x.kind == pipe::SpanKind::kRecv) wait += x.end - x.start;
      }
      total += last - first;
    }
    waits.push_back(wait / total);
    const pipe::Schedule schedule = pipe::make_schedule(config.parallel.dims.schedule, int(config.parallel.dims.pp), int(config.parallel.dims.virtual_stages),
                                                        int(config.grad_accum));
    simulated.push_back(pipe::validate(schedule, forward / forwards, backward / backwards).mean_bubble());
    if (trace && s == warmup + steps - 1) *trace = ranks;
  }
  out.step_seconds = median(seconds);
  out.bubble = median(bubbles);
  out.simulated = median(simulated);
  out.recv_wait = median(waits);
  out.activation_mib.assign(activation.data_ptr<double>(), activation.data_ptr<double>() + activation.numel());
  return out;
}

// Peak activation memory per stage of pp = p: gpipe vs 1f1b vs 1f1b + full
// checkpointing, 8 micro-batches of 2 (rows on the group's rank 0).
void memory_rows(const std::vector<std::string>& base, const std::shared_ptr<comm::Communicator>& group, int p,
                 std::vector<nlohmann::json>& rows) {
  const int64_t micro = 2;
  for (const std::string variant : {"gpipe", "1f1b", "1f1b+full checkpointing"}) {
    std::vector<std::string> settings = base;
    for (const std::string& s : {"parallel.pp=" + std::to_string(p),
                                  "parallel.pp_schedule=" + variant.substr(0, variant.find('+')),
                                  std::string("parallel.microbatches=8"), "training.batch=" + std::to_string(8 * micro),
                                  std::string("parallel.activation_checkpoint=") +
                                      (variant.find("full") != std::string::npos ? "full" : "none")}) {
      settings.push_back(s);
    }
    train::TrainConfig config = train::TrainConfig::load("", settings);
    config.validate(p);
    const ScheduleMeasured r = measure(config, group, 1, 1, nullptr);
    if (group->rank() != 0) continue;
    std::string stages;
    for (double mib : r.activation_mib) {
      char cell[32];
      std::snprintf(cell, sizeof cell, " %7.2f", mib);
      stages += cell;
    }
    std::printf("pp %d m 8 %-24s peak activation MiB per stage:%s\n", p, variant.c_str(), stages.c_str());
    rows.push_back({{"pp", p}, {"memory", variant}, {"microbatches", 8}, {"activation_mib_per_stage", r.activation_mib}});
    std::fflush(stdout);
  }
}

}  // namespace

int run_bench_pp(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps, int timed_steps,
                 const std::string& out_dir) {
  const auto& world = runtime.world();
  const int cores = util::node_cores();
  const int default_threads = at::get_num_threads();
  const int64_t micro = 2;
  std::vector<std::string> base = {"model.preset=tiny", "model.layers=8", "training.micro_batch=2",
                                   "training.steps=1000", "training.warmup=2", "checkpoint.resume=false",
                                   "run.out=" + out_dir + "/run"};
  base.insert(base.end(), overrides.begin(), overrides.end());
  // The token files once, for every configuration.
  const std::string data = out_dir + "/data";
  comm::on_root_or_all_fail(*world, 0, [&] {
    util::make_directories(out_dir);
    const train::TrainConfig text = train::TrainConfig::load("", base);
    train::prepare(text.text, data, text.val_fraction);
  });
  base.push_back("data.train_file=" + data + "/train.bin");
  base.push_back("data.val_file=" + data + "/val.bin");
  std::vector<nlohmann::json> rows;
  for (int p : {2, 4}) {
    if (p > world->size()) continue;
    const bool member = world->rank() < p;
    const auto group = world->split(member ? 0 : -1, world->rank(), "bench:pp" + std::to_string(p));
    if (member) {
      at::set_num_threads(std::max(1, cores / p));
      const train::TrainConfig shape = train::TrainConfig::load("", base);
      const double message = message_seconds(*group, {micro, shape.model.context, shape.model.width});
      for (const std::string schedule : {"gpipe", "1f1b", "interleaved"}) {
        for (int m : {4, 8, 16}) {
          const int v = schedule == "interleaved" ? 2 : 1;
          std::vector<std::string> settings = base;
          for (const std::string& s : {"parallel.pp=" + std::to_string(p), "parallel.pp_schedule=" + schedule,
                                        "parallel.virtual_stages=" + std::to_string(v),
                                        "parallel.microbatches=" + std::to_string(m),
                                        "training.batch=" + std::to_string(m * micro)}) {
            settings.push_back(s);
          }
          train::TrainConfig config = train::TrainConfig::load("", settings);
          config.validate(p);
          std::vector<std::vector<pipe::Span>> trace;
          const bool picture = schedule == "1f1b" && m == 8;
          const ScheduleMeasured r = measure(config, group, warmup_steps, timed_steps, picture ? &trace : nullptr);
          if (group->rank() != 0) continue;
          const double theory = pipe::theoretical_bubble(p, v, m);
          // Point-to-point on the critical path: a message per stage boundary each way, per virtual stage.
          const double comm = 2.0 * (p * v - 1) * message / r.step_seconds;
          nlohmann::json row = {{"pp", p}, {"schedule", schedule}, {"virtual_stages", v}, {"microbatches", m},
                                {"bubble_measured", r.bubble}, {"bubble_theory", theory},
                                {"bubble_simulated", r.simulated}, {"p2p_share", comm},
                                {"recv_wait_share", r.recv_wait},
                                {"within_10pct_of_theory_plus_p2p", std::abs(r.bubble - (theory + comm)) <= 0.1 * (theory + comm)},
                                {"tokens_per_s", double(m * micro * config.model.context) / r.step_seconds},
                                {"step_seconds", r.step_seconds}};
          rows.push_back(row);
          std::printf("pp %d %-11s v %d m %2d | bubble measured %5.1f%%  theory %5.1f%%  simulated %5.1f%%  p2p %4.1f%% | "
                      "%7.0f tok/s\n",
                      p, schedule.c_str(), v, m, 100 * r.bubble, 100 * theory, 100 * r.simulated, 100 * comm,
                      double(m * micro * config.model.context) / r.step_seconds);
          std::fflush(stdout);
          if (picture) {
            const std::string stem = out_dir + "/pp" + std::to_string(p) + "-1f1b-m8";
            util::write_text_file(stem + ".json", pipe::chrome_trace(trace));
            util::write_text_file(stem + ".svg", pipe::timeline_svg(trace, "1f1b, pp=" + std::to_string(p) +
                                                                              ", 8 micro-batches (meshtrain bench pp)"));
          }
        }
      }
      memory_rows(base, group, p, rows);
      at::set_num_threads(default_threads);
    }
    world->barrier().wait();
  }
  if (world->rank() == 0) {
    for (const auto& row : rows) std::printf("%s\n", row.dump().c_str());
  }
  return 0;
}

CommandPtr add_bench_pp(CLI::App& bench) {
  struct Args {
    TimedSteps steps{1, 3};
    std::string out = "bench/pipeline";
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = add_timed_bench(
      bench, "pp",
      "Pipeline schedules (gpipe, 1f1b, interleaved with 2 virtual stages) for pp = 2 and 4 (up to the rank count) and "
      "4, 8, 16 micro-batches, in one run: the measured bubble (idle / step time per rank, from the executor's spans) "
      "against the theory, point-to-point time, tokens/s, and the peak activation memory of every stage for gpipe, "
      "1f1b and 1f1b with full activation checkpointing. Writes a trace and a timeline picture of 1f1b with 8 "
      "micro-batches per pp to --out. Default model: tiny with 8 blocks; config overrides as for train.",
      a->steps);
  sub->add_option("--out", a->out, "Where traces and pictures go")->capture_default_str();
  return command(sub, [a, sub](comm::Runtime& runtime) {
    return run_bench_pp(runtime, config_overrides(*sub), a->steps.warmup, a->steps.steps, a->out);
  });
}

}  // namespace meshtrain::apps
