// meshtrain bench train: tokens/s, MFU and communication overlap of training
// steps, as one JSON line (bench/train_vs_pytorch.py compares it with PyTorch).
#include "meshtrain/apps/commands.h"

#include "meshtrain/train/trainer.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>

namespace meshtrain::apps {

int run_bench_train(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                    int timed_steps) {
  train::TrainConfig config = train::TrainConfig::load("", overrides);
  config.steps = warmup_steps + timed_steps;
  config.resume = false;
  config.validate(runtime.size());
  train::Trainer trainer(config, runtime.world());
  for (int s = 0; s < warmup_steps; ++s) trainer.step();
  // After backward a rank waits for its all-reduces, and those cannot finish
  // before the slowest rank's backward does. That wait for the slowest rank is
  // skew, not communication: subtract it (all ranks share CLOCK_MONOTONIC).
  std::vector<double> seconds;
  double exposed_total = 0, skew_total = 0;
  for (int s = 0; s < timed_steps; ++s) {
    seconds.push_back(trainer.step().seconds);
    const auto [entered, returned] = trainer.data_parallel().last_finish_times();
    at::Tensor everyone = at::empty({runtime.size()}, at::kDouble);
    runtime.world()->all_gather(everyone, at::full({1}, entered, at::kDouble)).wait();
    const double last_arrival = everyone.max().item<double>();
    const double skew = last_arrival - entered;
    skew_total += skew;
    exposed_total += std::max(0.0, returned - last_arrival);
  }
  const double exposed_per_step = exposed_total / timed_steps;
  const double skew_per_step = skew_total / timed_steps;
  const double reduce_per_step = runtime.size() > 1 ? trainer.data_parallel().standalone_reduce_seconds(5) : 0.0;
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double tokens_per_second = config.batch * config.model.context / median;
  if (runtime.rank() == 0) {
    nlohmann::json line = {{"side", "meshtrain"},
                           {"preset", config.preset},
                           {"ranks", runtime.size()},
                           {"batch", config.batch},
                           {"micro_batch", config.micro_batch},
                           {"threads", at::get_num_threads()},
                           {"tokens_per_s", tokens_per_second},
                           {"mfu", trainer.mfu(tokens_per_second)},
                           {"matmul_peak_gflops_per_rank", trainer.peak_flops_per_rank() / 1e9},
                           {"allreduce_s_per_step", reduce_per_step},
                           {"exposed_wait_s_per_step", exposed_per_step},
                           {"skew_wait_s_per_step", skew_per_step},
                           {"hidden_fraction", reduce_per_step > 0 ? 1.0 - std::min(1.0, exposed_per_step / reduce_per_step) : 0.0}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

}  // namespace meshtrain::apps
