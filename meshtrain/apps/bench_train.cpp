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
  const double exposed_before = trainer.data_parallel().exposed_wait_seconds();
  std::vector<double> seconds;
  for (int s = 0; s < timed_steps; ++s) seconds.push_back(trainer.step().seconds);
  const double exposed_per_step = (trainer.data_parallel().exposed_wait_seconds() - exposed_before) / timed_steps;
  const double reduce_per_step = runtime.size() > 1 ? trainer.data_parallel().standalone_reduce_seconds(5) : 0.0;
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double tokens_per_second = config.batch * config.model.context / median;
  const double mfu = config.model.flops_per_token() * tokens_per_second / (trainer.peak_flops_per_rank() * runtime.size());
  if (runtime.rank() == 0) {
    nlohmann::json line = {{"side", "meshtrain"},
                           {"preset", config.preset},
                           {"ranks", runtime.size()},
                           {"batch", config.batch},
                           {"micro_batch", config.micro_batch},
                           {"threads", at::get_num_threads()},
                           {"tokens_per_s", tokens_per_second},
                           {"mfu", mfu},
                           {"matmul_peak_gflops_per_rank", trainer.peak_flops_per_rank() / 1e9},
                           {"allreduce_s_per_step", reduce_per_step},
                           {"exposed_wait_s_per_step", exposed_per_step},
                           {"hidden_fraction", reduce_per_step > 0 ? 1.0 - std::min(1.0, exposed_per_step / reduce_per_step) : 0.0}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

}  // namespace meshtrain::apps
