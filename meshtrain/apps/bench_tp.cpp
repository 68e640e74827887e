// meshtrain bench tp: tensor parallel (and sequence parallel) training steps
// for tp = 1, 2, 4, ... up to the world size, in one run: bytes each rank sends
// per transformer layer (counted by the communicator) against the formula,
// tokens/s against tp = 1, and counted memory. See Note [Tensor parallel bytes].
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/parallel/annotated_tensor_parallel.h"
#include "meshtrain/parallel/grad_norm.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/train/config.h"
#include "meshtrain/util/memory.h"
#include "meshtrain/util/cores.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

namespace meshtrain::apps {

namespace {

using Clock = std::chrono::steady_clock;

// Note [Tensor parallel bytes]
// A ring all-reduce of n bytes sends 2n(t-1)/t per rank; an all-gather or a
// reduce-scatter of n bytes (the full tensor) sends n(t-1)/t. One block's
// activation [b, s, h] in fp32 is n = 4bsh bytes.
// - Without sequence parallel: g after attention and after the MLP forward,
//   f before each of them backward: 4 all-reduces, 4 x 8bsh(t-1)/t =
//   32bsh(t-1)/t per layer and step (Megatron's 2 forward + 2 backward).
// - With sequence parallel each all-reduce becomes a pair: forward 2
//   all-gathers + 2 reduce-scatters, backward 2 all-gathers (row outputs) + 2
//   reduce-scatters (column inputs), 8 x 4bsh(t-1)/t = 32bsh(t-1)/t, plus the
//   2 re-gathers of the column inputs in backward (the price of not keeping
//   them): 40bsh(t-1)/t; and the all-reduces of the 6 gradients computed
//   from sequence chunks (2 norms' weight and bias, 2 row biases; h each):
//   48h(t-1)/t.
double bytes_per_layer(int64_t b, int64_t s, int64_t h, int t, bool sp) {
  const double share = double(t - 1) / t;
  return sp ? (40.0 * b * s * h + 48.0 * h) * share : 32.0 * b * s * h * share;
}

int64_t wire_bytes(const comm::Communicator& comm) {
  const comm::CommStats stats = comm.stats();
  int64_t total = 0;
  for (const auto& op : stats.per_op) total += op.wire_bytes;
  return total;
}

struct TensorParallelMeasured {
  double seconds = 0;        // median step
  double bytes_per_step = 0; // sent by this rank over the tp group, one step
  int64_t counted_peak = 0;
};

// Trains `config` on the ranks of `group` with tensor parallel over all of
// them: `warmup` + `steps` steps of AdamW on fixed random tokens.
// With `annotated`, tensor parallel from sharding annotations
// (parallel/annotated_tensor_parallel.h) as the trainer applies it: the
// optimizer and clipping on the local pieces.
TensorParallelMeasured train_steps(const model::GptConfig& config, int64_t batch, const parallel::CommPtr& group, bool sp, bool annotated,
                     int warmup, int steps) {
  model::Gpt gpt(config, 1);
  std::unique_ptr<parallel::TensorParallel> tp;
  std::unique_ptr<parallel::AnnotatedTensorParallel> annotations;
  const int t = group->size();
  if (annotated) {
    auto mesh = std::make_shared<mesh::DeviceMesh>(group, mesh::MeshLayout::from_degrees({{"tp", t}}, t));
    annotations = std::make_unique<parallel::AnnotatedTensorParallel>(gpt, std::move(mesh));
  } else if (t > 1) {
    tp = std::make_unique<parallel::TensorParallel>(gpt, group, parallel::gpt_tensor_parallel_plan(config, sp),
                                                    parallel::TensorParallelOptions{sp, 1});
  }
  torch::nn::Module& stepped = annotations ? *annotations->local_module() : *gpt;
  torch::optim::AdamW optimizer(stepped.parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(2);
  const at::Tensor tokens = at::randint(0, config.vocab_size, {batch, config.context + 1}, g, at::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, config.context), targets = tokens.narrow(1, 1, config.context);
  TensorParallelMeasured out;
  std::vector<double> seconds;
  const comm::Communicator& counted = annotations ? *annotations->comm() : *group;  // (annotations: the tp mesh's own)
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) memory::reset_peaks();
    const int64_t sent = wire_bytes(counted);
    const auto start = Clock::now();
    optimizer.zero_grad();
    gpt->loss(inputs, targets).backward();
    if (annotations) annotations->after_backward();
    parallel::ModelParallelNorm norm;
    if (tp || annotations) {
      norm.tensor = group;
      norm.split_over_tensor = [&](const std::string& name) {
        return tp ? tp->is_split(name) : annotations->is_split(name);
      };
    }
    parallel::clip_grad_norm(stepped, 1.0, norm);
    optimizer.step();
    if (step >= warmup) seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    out.bytes_per_step = double(wire_bytes(counted) - sent);
  }
  std::sort(seconds.begin(), seconds.end());
  out.seconds = seconds[seconds.size() / 2];
  out.counted_peak = memory::peak_bytes();
  return out;
}

}  // namespace

int run_bench_tp(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps, int timed_steps) {
  // The small model with 8 heads of 48 (6 of 64 do not split 4 ways): same parameters.
  std::vector<std::string> settings = {"model.preset=small", "model.heads=8", "training.micro_batch=4"};
  settings.insert(settings.end(), overrides.begin(), overrides.end());
  const train::TrainConfig config = train::TrainConfig::load("", settings);
  const model::GptConfig& shape = config.model;
  const int64_t b = config.micro_batch, s = shape.context, h = shape.width;
  memory::install();
  const auto& world = runtime.world();
  const int cores = util::node_cores();
  const int default_threads = at::get_num_threads();

  struct Row {
    int t;
    bool sp;
    bool annotated;
    TensorParallelMeasured deep, shallow;
  };
  std::vector<Row> rows;
  for (int t = 1; t <= world->size(); t *= 2) {
    parallel::check_tensor_parallel(shape, t, true);
    // The first t ranks train; the others wait. Threads: the machine's cores
    // shared by the t working ranks, so every row uses the same cores.
    const bool member = world->rank() < t;
    const parallel::CommPtr group = world->split(member ? 0 : -1, world->rank(), "bench:tp" + std::to_string(t));
    // plan, plan with sequence parallel, annotations (no sequence parallel there)
    for (int variant = 0; variant < 3; ++variant) {
      const bool sp = variant == 1, annotated = variant == 2;
      if (t == 1 && variant > 0) continue;
      Row row{t, sp, annotated, {}, {}};
      if (member) {
        at::set_num_threads(std::max(1, cores / t));
        // Bytes per layer from two depths: the difference is the blocks' alone.
        model::GptConfig one_layer = shape;
        one_layer.layers = 1;
        row.deep = train_steps(shape, b, group, sp, annotated, warmup_steps, timed_steps);
        row.shallow = train_steps(one_layer, b, group, sp, annotated, 0, 1);
        at::set_num_threads(default_threads);
      }
      world->barrier().wait();
      rows.push_back(row);
    }
  }

  if (world->rank() == 0) {
    const double tokens = double(b) * s;
    const double baseline = tokens / rows.front().deep.seconds;
    std::printf("meshtrain bench tp: %s with %lld heads (%.2fM parameters), micro-batch %lld x %lld tokens, fp32, "
                "%d cores\n",
                config.preset.c_str(), (long long)shape.heads, shape.parameter_count() / 1e6, (long long)b, (long long)s,
                cores);
    std::printf("%-4s %-3s %-11s %14s %14s %7s %11s %8s %12s\n", "tp", "sp", "impl", "bytes/layer", "formula", "ratio",
                "tokens/s", "vs tp=1", "counted MiB");
    for (const Row& row : rows) {
      const double per_layer = (row.deep.bytes_per_step - row.shallow.bytes_per_step) / (shape.layers - 1);
      const double formula = bytes_per_layer(b, s, h, row.t, row.sp);
      const double tokens_per_second = tokens / row.deep.seconds;
      nlohmann::json line = {{"tp", row.t},
                             {"sequence_parallel", row.sp},
                             {"tp_impl", row.annotated ? "annotations" : "plan"},
                             {"bytes_per_layer_per_rank", per_layer},
                             {"formula_bytes_per_layer", formula},
                             {"tokens_per_s", tokens_per_second},
                             {"speedup_vs_tp1", tokens_per_second / baseline},
                             {"counted_peak_mib_rank0", row.deep.counted_peak / 1048576.0},
                             {"step_seconds", row.deep.seconds},
                             {"threads_per_rank", std::max(1, cores / row.t)}};
      std::printf("%-4d %-3s %-11s %14.0f %14.0f %7.4f %11.0f %8.3f %12.1f\n", row.t, row.sp ? "on" : "off",
                  row.annotated ? "annotations" : "plan", per_layer, formula, formula > 0 ? per_layer / formula : 1.0,
                  tokens_per_second, tokens_per_second / baseline, row.deep.counted_peak / 1048576.0);
      std::printf("%s\n", line.dump().c_str());
    }
    // Annotations against the plan at the same tp (sequence parallel off), measured in this run.
    for (const Row& a : rows) {
      if (!a.annotated) continue;
      for (const Row& p : rows) {
        if (p.t != a.t || p.sp || p.annotated) continue;
        const double bytes = (a.deep.bytes_per_step - a.shallow.bytes_per_step) / (p.deep.bytes_per_step - p.shallow.bytes_per_step);
        std::printf("tp %d: annotations / plan: bytes per layer %.4f, step time %.3f (target <= 1.10)\n", a.t, bytes,
                    a.deep.seconds / p.deep.seconds);
        nlohmann::json line = {{"tp", a.t}, {"annotations_over_plan_bytes_per_layer", bytes},
                               {"annotations_over_plan_step_time", a.deep.seconds / p.deep.seconds}};
        std::printf("%s\n", line.dump().c_str());
      }
    }
  }
  return 0;
}

CommandPtr add_bench_tp(CLI::App& bench) {
  return timed_bench_command(
      bench, "tp",
      "Tensor parallel with and without sequence parallel for tp = 1, 2, 4, ... up to the rank count, in one run, and "
      "from sharding annotations (tp_impl = annotations): bytes each rank sends per layer (counted by the "
      "communicator) against the formula, tokens/s against tp = 1, and annotations against the plan. Default model: "
      "small with 8 heads; config overrides as for train.",
      TimedSteps{1, 5}, run_bench_tp);
}

}  // namespace meshtrain::apps
