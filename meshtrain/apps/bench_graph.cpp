// meshtrain bench graph: a training step on one GPU with its forward and
// backward captured once as a CUDA graph and replayed, against the same step
// run eagerly (kernel by kernel), as one JSON line.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/adamw.h"
#include "meshtrain/train/config.h"

#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#ifdef MESHTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

namespace meshtrain::apps {

#ifdef MESHTRAIN_WITH_CUDA
namespace {

// One model and its optimizer on cuda:0, training on one fixed batch.
struct GraphRun {
  GraphRun(const train::TrainConfig& config, const at::Tensor& tokens)
      : model(config.model, config.seed), bfloat16(config.bfloat16()) {
    model->to(at::Device(at::kCUDA, 0));
    std::vector<parallel::AdamWParameter> parameters;
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      parameters.push_back({p, parallel::decay_dims(item.key(), p)});
      // Gradients exist before any capture, so backward accumulates into fixed tensors.
      p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
    }
    optimizer = parallel::make_adamw(parameters, {config.lr, config.beta1, config.beta2, 1e-8, config.weight_decay});
    x = tokens.narrow(1, 0, config.model.context).contiguous().cuda();
    y = tokens.narrow(1, 1, config.model.context).contiguous().cuda();
    clip = config.grad_clip;
  }

  // Forward and backward: what the graph captures. Autocast keeps no cache of
  // casted weights (a captured cast must run on every replay).
  void forward_backward() {
    if (bfloat16) {
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_cache_enabled(false);
    }
    loss = model->loss(x, y);
    if (bfloat16) {
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::set_autocast_cache_enabled(true);
    }
    loss.backward();
  }

  // Clipping on the GPU (no read of the norm on the host) and fused AdamW.
  void update() {
    torch::NoGradGuard no_grad;
    const at::Tensor norm = at::stack(at::_foreach_norm(grads, 2)).pow(2).sum().sqrt();
    at::_foreach_mul_(grads, (clip / (norm + 1e-6)).clamp_max(1.0));
    parallel::adamw_step(*optimizer);
    at::_foreach_zero_(grads);
  }

  model::Gpt model;
  bool bfloat16;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::vector<at::Tensor> grads;
  at::Tensor x, y, loss;
  double clip;
};

// `warmup` untimed steps, their losses into `losses`, then `timed` steps: seconds
// per timed step, the GPU drained before and after.
double seconds_per_step(int warmup, int timed, const std::function<void()>& step, const GraphRun& run,
                        std::vector<double>& losses) {
  for (int s = 0; s < warmup; ++s) {
    step();
    losses.push_back(run.loss.item<double>());
  }
  torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < timed; ++s) step();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / timed;
}

}  // namespace

int run_bench_graph(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                    int timed_steps) {
  train::TrainConfig config = train::TrainConfig::load("", overrides);
  config.validate(1);
  if (runtime.size() != 1) throw train::ConfigError("bench graph runs on one rank (one GPU)");
  if (!torch::cuda::is_available()) throw train::ConfigError("bench graph needs a CUDA device; none is visible");
  if (config.model.dropout > 0) throw train::ConfigError("bench graph: set model.dropout = 0 (masks are not replayed)");
  const at::Tensor batch = at::randint(config.model.vocab_size, {config.micro_batch, config.model.context + 1}, at::kLong);
  c10::cuda::CUDAGuard on_gpu(0);

  // Eager: the step kernel by kernel.
  GraphRun eager(config, batch);
  std::vector<double> eager_losses;
  const double eager_seconds = seconds_per_step(warmup_steps, timed_steps, [&] {
    eager.forward_backward();
    eager.update();
  }, eager, eager_losses);

  // Graphed: warm up on a side stream, capture forward + backward there, replay.
  GraphRun graphed(config, batch);
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, 0);
  torch::cuda::synchronize();  // the side stream starts after the model's copies
  std::vector<double> graph_losses;
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    for (int s = 0; s < 2; ++s) graphed.forward_backward();  // lazy initialisations (cuBLAS, kernels)
    torch::NoGradGuard no_grad;
    at::_foreach_zero_(graphed.grads);
  }
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    graph.capture_begin();
    graphed.forward_backward();
    graph.capture_end();
  }
  torch::cuda::synchronize();
  const double graph_seconds = seconds_per_step(warmup_steps, timed_steps, [&] {
    graph.replay();
    graphed.update();
  }, graphed, graph_losses);

  double difference = 0;
  for (size_t i = 0; i < eager_losses.size(); ++i) {
    difference = std::max(difference, std::abs(eager_losses[i] - graph_losses[i]) / eager_losses[i]);
  }
  const double tokens = static_cast<double>(config.micro_batch * config.model.context);
  nlohmann::json line = {{"preset", config.preset},
                         {"parameters", config.model.parameter_count()},
                         {"batch", config.micro_batch},
                         {"dtype", config::name_of(parallel::state_dtype_names(), config.dtype)},
                         {"eager_tokens_per_s", tokens / eager_seconds},
                         {"graph_tokens_per_s", tokens / graph_seconds},
                         {"speedup", eager_seconds / graph_seconds},
                         {"eager_losses", eager_losses},
                         {"graph_losses", graph_losses},
                         {"largest_relative_loss_difference", difference}};
  std::printf("%s\n", line.dump().c_str());
  return 0;
}

#else

int run_bench_graph(comm::Runtime&, const std::vector<std::string>&, int, int) {
  throw train::ConfigError("bench graph needs a libtorch with CUDA; this build's has none");
}

#endif

CommandPtr add_bench_graph(CLI::App& bench) {
  return timed_bench_command(
      bench, "graph",
      "On one GPU: a training step whose forward and backward are captured once as a CUDA graph and replayed, against "
      "the same step run kernel by kernel; tokens/s of each, and the losses of both from the same start (the untimed "
      "steps), as one JSON line. Config overrides as for train (micro_batch sequences per step; model.dropout must be "
      "0).",
      TimedSteps{5, 20}, run_bench_graph);
}

}  // namespace meshtrain::apps
