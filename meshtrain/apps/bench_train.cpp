// meshtrain bench train: tokens/s, MFU and communication overlap of training
// steps, as one JSON line (bench/train_vs_pytorch.py compares it with PyTorch).
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/comm/job_environment.h"

#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/train/op_profile.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/cpu_features.h"
#include "meshtrain/util/files.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace meshtrain::apps {

namespace {

double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1048576.0;
}

std::vector<double> gather(comm::Communicator& comm, double value) {
  at::Tensor everyone = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(everyone, at::full({1}, value, at::kDouble)).wait();
  return std::vector<double>(everyone.data_ptr<double>(), everyone.data_ptr<double>() + comm.size());
}

// Profiles `steps` steps on every rank; rank 0 writes what it saw to `dir`.
void profile_steps_into(train::Trainer& trainer, bool writer, const std::string& dir, int steps, bool cuda) {
  train::OpProfile profile(cuda);
  for (int s = 0; s < steps; ++s) trainer.step();
  if (writer) util::make_directories(dir);
  const std::vector<train::OpTime> ops = profile.stop(writer ? dir + "/trace.json" : "");
  if (!writer) return;
  std::ofstream(dir + "/ops.json") << train::op_times_json(ops, steps) << "\n";
  std::fprintf(stderr, "meshtrain: %d profiled steps; trace in %s/trace.json, all operators in %s/ops.json\n%s",
               steps, dir.c_str(), dir.c_str(), train::op_times_table(ops, steps, 25).c_str());
  if (!cuda) {
    const double peak = trainer.peak_flops_per_rank();
    std::ofstream(dir + "/products.json") << train::products_json(profile.products(), steps, peak) << "\n";
    std::fprintf(stderr, "meshtrain: the matrix products by operand sizes, against the matmul peak (all in %s/products.json)\n%s",
                 dir.c_str(), train::products_table(profile.products(), steps, 12, peak).c_str());
  }
  if (profile.kernels().empty()) return;
  std::ofstream(dir + "/kernels.json") << train::op_times_json(profile.kernels(), steps) << "\n";
  std::fprintf(stderr, "meshtrain: the GPU's kernels, copies and fills (all in %s/kernels.json)\n%s", dir.c_str(),
               train::op_times_table(profile.kernels(), steps, 25, "kernel", "time on the device").c_str());
}

}  // namespace

int run_bench_train(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                    int timed_steps, const std::string& profile_dir, int profile_steps) {
  train::TrainConfig config = train::TrainConfig::load("", overrides);
  config.steps = warmup_steps + timed_steps + (profile_dir.empty() ? 0 : profile_steps);
  config.resume = false;
  config.validate(runtime.size());
  const double baseline_rss = rss_mib();
  // A benchmark measures the matmul peak afresh (Note [Matmul peak]); the trainer then quotes MFU against it.
  const bool bf16 = config.bfloat16() || config.parallel.param_dtype == at::kBFloat16;
  train::measure_matmul_peak(config.torch_device(comm::node_local_rank()), bf16 ? at::kBFloat16 : at::kFloat, true);
  train::Trainer trainer(config, runtime.world());
  for (int s = 0; s < warmup_steps; ++s) trainer.step();
  parallel::FullySharded* sharded = trainer.sharded();
  const double gather_before = sharded ? sharded->exposed_gather_seconds() : 0;
  const double reduce_before = sharded ? sharded->exposed_reduce_seconds() : 0;
  // After backward a rank waits for its all-reduces, and those cannot finish
  // before the slowest rank's backward does. That wait for the slowest rank is
  // skew, not communication: subtract it (all ranks share CLOCK_MONOTONIC).
  std::vector<double> seconds;
  double exposed_total = 0, skew_total = 0;
  int64_t model_states = 0, peak = 0;
  for (int s = 0; s < timed_steps; ++s) {
    const train::StepResult result = trainer.step();
    seconds.push_back(result.seconds);
    model_states = result.memory.model_states;
    peak = std::max(peak, result.memory.peak());
    if (sharded) continue;
    const auto [entered, returned] = trainer.parts().data_parallel()->last_finish_times();
    const std::vector<double> everyone = gather(*runtime.world(), entered);
    const double last_arrival = *std::max_element(everyone.begin(), everyone.end());
    const double skew = last_arrival - entered;
    skew_total += skew;
    exposed_total += std::max(0.0, returned - last_arrival);
  }
  const double exposed_per_step = exposed_total / timed_steps;
  const double skew_per_step = skew_total / timed_steps;
  const double reduce_per_step =
      runtime.size() > 1 && !sharded ? trainer.parts().data_parallel()->standalone_reduce_seconds(5) : 0.0;
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double tokens_per_second = config.batch * config.model.context / median;
  if (!profile_dir.empty()) profile_steps_into(trainer, runtime.rank() == 0, profile_dir, profile_steps, config.torch_device(0).is_cuda());
  const std::vector<double> peak_rss = gather(*runtime.world(), train::peak_rss_mib());
  const std::vector<double> rss_growth = gather(*runtime.world(), train::peak_rss_mib() - baseline_rss);
  const std::vector<double> counted_peak = gather(*runtime.world(), peak / 1048576.0);
  const std::vector<double> counted_states = gather(*runtime.world(), model_states / 1048576.0);
  // A GPU's caching allocator over the last timed step (the trainer resets it each step).
  const std::vector<double> device_peak =
      gather(*runtime.world(), memory::device_stats(trainer.device()).peak / 1048576.0);
  // What the planner predicts for this rank's peak (its memory model, meshtrain/plan/memory_model.h).
  double planned = 0;
  try {
    const plan::PlannedRun run = plan::planned_run(config);
    planned = plan::estimate_memory(run.model, run.workload, run.layout, run.microbatches)
                  [trainer.mesh().coordinate("pp")].memory.total() / 1048576.0;
  } catch (const std::exception&) {
    planned = 0;  // a layout the planner does not model
  }
  const std::vector<double> planned_peak = gather(*runtime.world(), planned);
  if (runtime.rank() == 0) {
    nlohmann::json line = {{"side", "meshtrain"},
                           {"preset", config.preset},
                           {"ranks", runtime.size()},
                           {"zero_stage", config.parallel.dims.zero_stage},
                           {"parameters", config.model.parameter_count()},
                           {"batch", config.batch},
                           {"micro_batch", config.micro_batch},
                           {"context", config.model.context},
                           {"threads", at::get_num_threads()},
                           {"tokens_per_s", tokens_per_second},
                           {"mfu", trainer.mfu(tokens_per_second)},
                           {"matmul_peak_gflops_per_rank", trainer.peak_flops_per_rank() / 1e9},
                           {"peak_rss_mib", peak_rss},
                           {"rss_growth_mib", rss_growth},
                           {"counted_peak_mib", counted_peak},
                           {"counted_model_states_mib", counted_states},
                           {"device", trainer.device().str()},
                           {"cpu_kernels", util::cpu_kernels_name()},  // Note [Kernel copies]
                           {"dtype", config::name_of(parallel::state_dtype_names(), config.dtype)},
                           {"device_peak_mib", device_peak},
                           {"planned_peak_mib", planned_peak}};
    if (sharded) {
      line["exposed_gather_s_per_step"] = (sharded->exposed_gather_seconds() - gather_before) / timed_steps;
      line["exposed_reduce_s_per_step"] = (sharded->exposed_reduce_seconds() - reduce_before) / timed_steps;
      line["largest_unit_numel"] = sharded->largest_unit_numel();
      line["shards"] = config.parallel.dims.fsdp;
    } else {
      line["allreduce_s_per_step"] = reduce_per_step;
      line["exposed_wait_s_per_step"] = exposed_per_step;
      line["skew_wait_s_per_step"] = skew_per_step;
      line["hidden_fraction"] = reduce_per_step > 0 ? 1.0 - std::min(1.0, exposed_per_step / reduce_per_step) : 0.0;
    }
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

CommandPtr add_bench_train(CLI::App& bench) {
  struct Args {
    TimedSteps steps{2, 12};
    std::string profile;
    int profile_steps = 3;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = add_timed_bench(
      bench, "train",
      "Time training steps (config overrides as for train) and print tokens/s, MFU against the measured matmul peak, "
      "and the share of all-reduce time hidden behind backward, as one JSON line. bench/train_vs_pytorch.py runs it "
      "beside the PyTorch reference.",
      a->steps);
  sub->add_option("--profile", a->profile,
                  "After the timed steps, profile more steps with libtorch's profiler (rank 0): write DIR/trace.json "
                  "(Chrome trace), DIR/ops.json (each operator's self time per step), on the CPU DIR/products.json (the "
                  "matrix products by operand sizes, with GFLOP/s against the matmul peak) and print the largest")
      ->type_name("DIR");
  sub->add_option("--profile-steps", a->profile_steps, "Steps to profile")->check(CLI::PositiveNumber)->capture_default_str();
  return command(sub, [a, sub](comm::Runtime& runtime) {
    return run_bench_train(runtime, config_overrides(*sub), a->steps.warmup, a->steps.steps, a->profile,
                           a->profile_steps);
  });
}

}  // namespace meshtrain::apps
