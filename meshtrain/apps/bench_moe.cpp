// meshtrain bench moe: what a mixture-of-experts layer costs, in one run.
// (1) One MoE layer, top-1 and top-2, with its experts split over every rank
// (ep = the rank count when it divides the experts): bytes each rank sends
// per step (counted by the communicator) against the formula computed from
// the routing, and the forward's time split into router + dispatch + combine,
// the all-to-all exchange and the experts' compute. (2) Training steps of
// the dense model and of MoE models (top-1, top-2) with the same active
// parameters and global batch: tokens/s against the dense model. See Note
// [Expert parallel bytes].
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/apps/bench_util.h"

#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/train/trainer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>

namespace meshtrain::apps {

namespace {

using Clock = BenchClock;

// Note [Expert parallel bytes]
// Per MoE layer and step a rank sends, to the other ranks of its ep group:
// its token counts for their experts, (ep - 1) · experts/ep int64, in the
// forward; the rows it dispatches to their experts (S) and the results of
// the rows it received from them (R), forward; and backward, the gradients
// of the results it got back (S) and of the rows it received (R): counts +
// 2 · (S + R) · width · 4 bytes in fp32. Balanced, S = R = tokens · top_k ·
// (ep - 1) / ep.
struct Routing {
  double sent_rows = 0, received_rows = 0;  // to and from other ranks, summed over forwards
  double exchange_seconds = 0, expert_seconds = 0;
  int64_t forwards = 0;
};

// Wraps a layer's exchange: times the experts' compute and the exchange
// around it, and counts the rows that cross ranks.
class TimedExchange final : public model::ExpertExchange {
 public:
  TimedExchange(std::shared_ptr<model::ExpertExchange> inner, int64_t first, int64_t local)
      : inner_(std::move(inner)), first_(first), local_(local) {}

  at::Tensor run(const at::Tensor& tokens, const std::vector<int64_t>& counts,
                 const model::ExpertCompute& compute) override {
    const auto start = Clock::now();
    double inside = 0;
    int64_t computed = 0;
    at::Tensor out = inner_->run(tokens, counts, [&](const at::Tensor& t, const std::vector<int64_t>& c, int64_t f) {
      const auto begin = Clock::now();
      at::Tensor result = compute(t, c, f);
      inside += seconds_since(begin);
      computed += t.size(0);
      return result;
    });
    const int64_t kept = std::accumulate(counts.begin() + first_, counts.begin() + first_ + local_, int64_t{0});
    routing.sent_rows += static_cast<double>(tokens.size(0) - kept);
    routing.received_rows += static_cast<double>(computed - kept);
    routing.exchange_seconds += seconds_since(start) - inside;
    routing.expert_seconds += inside;
    routing.forwards += 1;
    return out;
  }

  Routing routing;

 private:
  std::shared_ptr<model::ExpertExchange> inner_;
  int64_t first_, local_;
};

int64_t all_to_all_bytes(const comm::Communicator& comm) { return comm.stats()[comm::OpKind::kAllToAll].wire_bytes; }

// Part (1): one MoE layer forward and backward on [micro_batch, context, width] inputs.
nlohmann::json layer_row(comm::Runtime& runtime, const model::GptConfig& config, int64_t micro_batch, int warmup,
                         int steps) {
  const int n = runtime.size();
  const int ep = config.moe_experts % n == 0 ? n : 1;
  model::Gpt gpt(config, 1);
  std::unique_ptr<parallel::ExpertParallel> expert_parallel;
  if (ep > 1) expert_parallel = std::make_unique<parallel::ExpertParallel>(gpt, runtime.world());
  model::Moe layer = gpt->moe_layers().front();
  auto timed = std::make_shared<TimedExchange>(layer->exchange(), layer->first_expert(), layer->local_experts());
  layer->set_exchange(timed);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(100 + runtime.rank());
  const at::Tensor x = at::randn({micro_batch, config.context, config.width}, g).requires_grad_(true);
  const at::Tensor grad = at::randn({micro_batch, config.context, config.width}, g);
  std::vector<double> forward, backward, overhead, exchange, experts;
  int64_t bytes = 0;
  Routing counted;
  for (int step = 0; step < warmup + steps; ++step) {
    runtime.world()->barrier().wait();
    const Routing before = timed->routing;
    const int64_t sent_before = all_to_all_bytes(*runtime.world());
    auto start = Clock::now();
    const at::Tensor out = layer->forward(x);
    const double f = seconds_since(start);
    start = Clock::now();
    out.backward(grad);
    const double b = seconds_since(start);
    if (step < warmup) continue;
    const Routing& now = timed->routing;
    const double ex = now.exchange_seconds - before.exchange_seconds, exp = now.expert_seconds - before.expert_seconds;
    forward.push_back(f), backward.push_back(b), exchange.push_back(ex), experts.push_back(exp);
    overhead.push_back(f - ex - exp);
    bytes += all_to_all_bytes(*runtime.world()) - sent_before;
    counted.sent_rows += now.sent_rows - before.sent_rows;
    counted.received_rows += now.received_rows - before.received_rows;
  }
  const double local = static_cast<double>(config.moe_experts / ep);
  const double formula = (ep > 1 ? (ep - 1) * local * 8 * steps : 0) +
                         2 * (counted.sent_rows + counted.received_rows) * static_cast<double>(config.width) * 4;
  const double tokens = static_cast<double>(micro_batch * config.context);
  const double balanced = 4 * tokens * config.moe_top_k * (ep - 1.0) / ep * static_cast<double>(config.width) * 4 +
                          (ep > 1 ? (ep - 1) * local * 8 : 0);
  return {{"part", "layer"},
          {"top_k", config.moe_top_k},
          {"experts", config.moe_experts},
          {"ep", ep},
          {"tokens_per_rank", tokens},
          {"bytes_per_step", static_cast<double>(bytes) / steps},
          {"bytes_formula", formula / steps},
          {"bytes_balanced", balanced},
          {"forward_ms", 1e3 * median(forward)},
          {"router_dispatch_combine_ms", 1e3 * median(overhead)},
          {"all_to_all_ms", 1e3 * median(exchange)},
          {"experts_ms", 1e3 * median(experts)},
          {"backward_ms", 1e3 * median(backward)}};
}

// Part (2): training steps of `overrides` (+ the variant's), tokens/s.
nlohmann::json training_row(comm::Runtime& runtime, std::vector<std::string> overrides, const std::string& name,
                            int warmup, int steps) {
  train::TrainConfig config = train::TrainConfig::load("", overrides);
  config.steps = warmup + steps;
  config.resume = false;
  config.validate(runtime.size());
  train::Trainer trainer(config, runtime.world());
  for (int s = 0; s < warmup; ++s) trainer.step();
  std::vector<double> seconds;
  double loss = 0;
  for (int s = 0; s < steps; ++s) {
    const train::StepResult result = trainer.step();
    seconds.push_back(result.seconds);
    loss = result.loss;
  }
  return {{"part", "training"},
          {"model", name},
          {"ep", config.parallel.dims.ep},
          {"parameters", config.model.parameter_count()},
          {"active_parameters", config.model.active_parameter_count()},
          {"tokens_per_s", static_cast<double>(config.batch * config.model.context) / median(seconds)},
          {"loss", loss}};
}

}  // namespace

int run_bench_moe(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                  int timed_steps) {
  // Defaults first, so that the command line's overrides win.
  std::vector<std::string> base = {"model.preset=small", "model.moe_experts=8", "model.moe_every=1",
                                   "model.moe_capacity_factor=0", "model.moe_second_expert=always",
                                   "training.batch=16", "training.micro_batch=4", "run.out=runs/bench-moe"};
  base.insert(base.end(), overrides.begin(), overrides.end());
  const train::TrainConfig config = train::TrainConfig::load("", base);
  const int n = runtime.size();
  const bool root = runtime.rank() == 0;
  std::vector<nlohmann::json> rows;
  for (int64_t k : {1, 2}) {
    model::GptConfig c = config.model;
    c.moe_top_k = k;
    rows.push_back(layer_row(runtime, c, config.micro_batch, warmup_steps, timed_steps));
    if (root) std::printf("%s\n", rows.back().dump().c_str()), std::fflush(stdout);
  }
  // The same active parameters: top-k experts of width ffn / k in every block.
  const int64_t ffn = config.model.mlp_hidden(), experts = config.model.moe_experts;
  const std::string ep = "parallel.ep=" + std::to_string(experts % n == 0 ? n : 1);
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"dense", {"model.moe_experts=0"}},
      {"moe top-1", {"model.moe_top_k=1", "model.moe_hidden=" + std::to_string(ffn), ep}},
      {"moe top-2", {"model.moe_top_k=2", "model.moe_hidden=" + std::to_string(ffn / 2), ep}}};
  for (const auto& [name, extra] : variants) {
    std::vector<std::string> o = base;
    o.insert(o.end(), extra.begin(), extra.end());
    rows.push_back(training_row(runtime, o, name, warmup_steps, timed_steps));
    if (root) std::printf("%s\n", rows.back().dump().c_str()), std::fflush(stdout);
  }
  if (!root) return 0;
  std::printf("\none MoE layer (%lld experts, h %lld, expert hidden %lld), %lld tokens per rank, %d rank(s); "
              "medians of %d steps\n",
              (long long)experts, (long long)config.model.width, (long long)config.model.expert_hidden(),
              (long long)(config.micro_batch * config.model.context), n, timed_steps);
  std::printf("%5s %3s %14s %14s %6s %10s %12s %10s %10s %11s %9s\n", "top-k", "ep", "bytes/step", "formula", "ratio",
              "fwd ms", "route+comb", "all2all", "experts", "route/exp", "bwd ms");
  for (const auto& r : rows) {
    if (r["part"] != "layer") continue;
    const double formula = r["bytes_formula"].get<double>(), bytes = r["bytes_per_step"].get<double>();
    std::printf("%5lld %3lld %14.0f %14.0f %6.3f %10.2f %12.2f %10.2f %10.2f %11.2f %9.2f\n",
                (long long)r["top_k"].get<int64_t>(), (long long)r["ep"].get<int64_t>(), bytes, formula,
                formula > 0 ? bytes / formula : 1.0, r["forward_ms"].get<double>(),
                r["router_dispatch_combine_ms"].get<double>(), r["all_to_all_ms"].get<double>(),
                r["experts_ms"].get<double>(),
                r["router_dispatch_combine_ms"].get<double>() / std::max(1e-9, r["experts_ms"].get<double>()),
                r["backward_ms"].get<double>());
  }
  double dense = 0;
  std::printf("\ntraining, global batch %lld x %lld tokens, medians of %d steps\n", (long long)config.batch,
              (long long)config.model.context, timed_steps);
  std::printf("%-10s %3s %12s %12s %12s %8s\n", "model", "ep", "parameters", "active", "tokens/s", "vs dense");
  for (const auto& r : rows) {
    if (r["part"] != "training") continue;
    const double tps = r["tokens_per_s"].get<double>();
    if (r["model"] == "dense") dense = tps;
    std::printf("%-10s %3lld %12lld %12lld %12.0f %8.3f\n", r["model"].get<std::string>().c_str(),
                (long long)r["ep"].get<int64_t>(), (long long)r["parameters"].get<int64_t>(),
                (long long)r["active_parameters"].get<int64_t>(), tps, tps / dense);
  }
  return 0;
}

CommandPtr add_bench_moe(CLI::App& bench) {
  return timed_bench_command(
      bench, "moe",
      "Mixture of experts in one run: one MoE layer (top-1 and top-2, experts split over the ranks) with the bytes "
      "each rank sends per step against the formula and its forward split into router + dispatch + combine, "
      "all-to-all and expert compute; then training tokens/s of MoE models against the dense model with the same "
      "active parameters and global batch. Default: small, 8 experts in every block, dropless; config overrides as "
      "for train.",
      TimedSteps{2, 8}, run_bench_moe);
}

}  // namespace meshtrain::apps
