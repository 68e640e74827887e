// meshtrain plan --calibrate: this machine's profile, measured on the ranks of a job.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/train/matmul_peak.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/memory.h"
#include "meshtrain/util/cores.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <unistd.h>

namespace meshtrain::apps {

namespace {

using Clock = std::chrono::steady_clock;

// The median of five timings of `run`, each repeated until it lasts about
// 30 ms, every rank at once and timed until the last is done: the rate a rank
// gets while all of them work, as they share the machine when they train (a
// rank's own time, or a best-of, would count the moments its peers waited).
double timed(comm::Communicator& world, const std::function<void()>& run) {
  run();  // warm-up, and the first estimate of one run
  auto start = Clock::now();
  run();
  // The same repeats on every rank, so that they work side by side to the end.
  at::Tensor slowest = at::full({1}, std::max(1e-7, std::chrono::duration<double>(Clock::now() - start).count()), at::kDouble);
  world.all_reduce(slowest, comm::ReduceOp::kMax).wait();
  const double once = slowest.item<double>();
  const int repeats = static_cast<int>(std::clamp(0.03 / once, 1.0, 3000.0));
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    world.barrier().wait();
    start = Clock::now();
    for (int i = 0; i < repeats; ++i) run();
    world.barrier().wait();  // until every rank is done: its share of the machine, not a head start
    runs.push_back(std::chrono::duration<double>(Clock::now() - start).count() / repeats);
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

// `value` averaged over the ranks.
double averaged(comm::Communicator& world, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  world.all_reduce(t, comm::ReduceOp::kAvg).wait();
  return t.item<double>();
}

// Note [Operator time]: products, the attention kernel and an elementwise
// add, each timed at several sizes and fitted to call + work / rate.
plan::OperatorRates measure_operators(comm::Communicator& world, at::ScalarType dtype) {
  const memory::HostScope uncounted;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype);
  plan::OperatorRates r;
  std::vector<double> work, seconds;
  for (const int64_t m : {64, 256, 1024}) {
    for (const auto& [k, n] : {std::pair<int64_t, int64_t>{128, 128}, {256, 1024}, {1024, 256}, {768, 768}}) {
      const at::Tensor a = at::linspace(-1, 1, m * k, options).view({m, k}), b = at::linspace(-1, 1, k * n, options).view({k, n});
      at::Tensor c = at::empty({m, n}, options);
      work.push_back(2.0 * static_cast<double>(m * k * n));
      seconds.push_back(timed(world, [&] { at::mm_out(c, a, b); }));
    }
  }
  plan::Fit fit = plan::fit_rate(work, seconds);
  r.matmul_flops = averaged(world, fit.rate), r.matmul_call = averaged(world, fit.call);
  work.clear(), seconds.clear();
  const int64_t batch = 2, heads = 8, d = 64;
  for (const int64_t length : {64, 256, 512}) {  // a non-causal tile's forward and backward
    const at::Tensor q = at::linspace(-1, 1, batch * heads * length * d, options).view({batch, heads, length, d});
    const at::Tensor k = q.flip(2).contiguous(), v = q.flip(3).contiguous(), d_out = at::ones_like(q);
    const double scale = 1 / std::sqrt(static_cast<double>(d));
    work.push_back(3 * 4.0 * static_cast<double>(batch * heads * length * length * d));
    seconds.push_back(timed(world, [&] {
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, {}, scale);
      at::_scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, out, lse, 0.0, false, {}, scale);
    }));
  }
  fit = plan::fit_rate(work, seconds);
  r.attention_flops = averaged(world, fit.rate), r.attention_call = averaged(world, fit.call / 2);  // two calls a run
  work.clear(), seconds.clear();
  for (const int64_t n : {int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 21}) {
    const at::Tensor a = at::ones({n}, options), b = at::ones({n}, options);
    at::Tensor c = at::empty({n}, options);
    work.push_back(3.0 * static_cast<double>(n) * static_cast<double>(a.element_size()));
    seconds.push_back(timed(world, [&] { at::add_out(c, a, b); }));
  }
  fit = plan::fit_rate(work, seconds);
  r.elementwise_bytes = averaged(world, fit.rate), r.elementwise_call = averaged(world, fit.call);
  return r;
}

// What a blocking collective costs while the ranks compute between
// collectives, beyond `idle` (its time between idle ranks): a product of
// about a millisecond, then a one-element all-reduce, against the products
// alone. Where ranks share cores, a peer that is not running is waited for
// (Note [Shared cores]).
double sync_under_load(comm::Communicator& world, double idle) {
  const memory::HostScope uncounted;
  const int64_t n = 256, rounds = 40;
  const at::Tensor a = at::linspace(-1, 1, n * n).view({n, n}), one = at::ones({1});
  at::Tensor c = at::empty({n, n});
  auto loop = [&](bool collectives) {
    world.barrier().wait();
    const auto start = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      for (int k = 0; k < 4; ++k) at::mm_out(c, a, a);
      if (collectives) world.all_reduce(one).wait();
    }
    world.barrier().wait();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  loop(true);  // warm-up
  double with = 1e30, without = 1e30;
  for (int r = 0; r < 3; ++r) with = std::min(with, loop(true)), without = std::min(without, loop(false));
  return averaged(world, std::max(0.0, (with - without) / rounds - idle));
}

// Collective bandwidth and latency (a ring all-reduce's alpha and beta) between the ranks, and `sync`.
void measure_collectives(comm::Communicator& world, plan::Machine& m) {
  const int n = world.size();
  auto all_reduce = [&](int64_t elements) {
    at::Tensor buffer = at::ones({elements});
    world.all_reduce(buffer).wait();
    std::vector<double> runs;
    for (int i = 0; i < 5; ++i) {
      world.barrier().wait();
      const auto start = Clock::now();
      world.all_reduce(buffer).wait();
      runs.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::sort(runs.begin(), runs.end());
    return runs[2];
  };
  const double small = all_reduce(1), large_bytes = 64.0 * (1 << 20), large = all_reduce(static_cast<int64_t>(large_bytes / 4));
  m.latency = small / (2.0 * (n - 1));
  m.intra_bandwidth = m.inter_bandwidth = 2.0 * (n - 1) / n * large_bytes / std::max(large - small, 1e-9);
  m.sync = sync_under_load(world, small);
}

// A short training run: the `small` preset, data parallel over every rank.
// Sets the machine's MFU from it, and the operators' overhead: what its step
// takes beyond its communication, over the compute its operators predict.
void calibration_run(const std::shared_ptr<comm::Communicator>& world, plan::Machine& m, bool bf16) {
  const bool leader = world->rank() == 0;
  std::string dir, failure;
  if (leader) {
    try {
      dir = util::make_temp_directory("meshtrain-calibrate-");
    } catch (const std::exception& e) {  // said on every rank, so that none waits for the others
      failure = e.what();
    }
  }
  dir = comm::all_gather_strings(*world, dir)[0];  // rank 0's
  if (dir.empty()) throw std::runtime_error("plan --calibrate: rank 0 could not make a temporary folder " + failure);
  train::TrainConfig config = train::TrainConfig::load(
      "", {"run.out=" + dir, "checkpoint.resume=false", "training.sample_tokens=0",
           std::string("training.dtype=") + (bf16 ? "bfloat16" : "float32")});
  config.batch = config.micro_batch * world->size();
  config.validate(world->size());
  {
    train::Trainer trainer(config, world);
    std::vector<double> seconds;
    for (int s = 0; s < 6; ++s) seconds.push_back(trainer.step().seconds);
    std::sort(seconds.begin() + 1, seconds.end());
    const double step = averaged(*world, seconds[3]);  // the median of the five after the first
    m.mfu = std::min(1.0, trainer.mfu(static_cast<double>(config.batch * config.model.context) / step));
    const plan::PlannedRun run = plan::planned_run(config);  // bf16: autocast, as the run trains
    plan::Machine predicted = m;
    predicted.operators.overhead = 1;
    const auto ranks = plan::estimate_memory(run.model, run.workload, run.layout, run.microbatches);
    const plan::TimeBreakdown t = plan::estimate_time(run.model, run.workload, run.layout, predicted, run.microbatches, ranks);
    const double operators = t.compute + t.optimizer;
    m.operators.overhead = std::max(0.05, (step - (t.step() - operators)) / operators);
  }
  world->barrier().wait();
  if (leader) util::remove_tree(dir);
}

}  // namespace

int run_plan_calibrate(comm::Runtime& runtime, const PlanOptions& o) {
  auto world = runtime.world();
  const bool leader = world->rank() == 0;
  const int n = world->size();
  const bool bf16 = o.precision == "bf16-mixed" || o.precision == "bf16-autocast";
  if (!o.precision.empty() && !bf16 && o.precision != "fp32") {
    throw UsageError("--precision " + o.precision + ": --calibrate measures fp32 or bfloat16 (bf16-mixed or bf16-autocast)");
  }
  plan::Machine m;
  m.name = "calibrated";
  // Matmul peak of one rank with its threads, averaged over ranks.
  m.peak_flops = averaged(*world, train::measure_matmul_peak(at::kCPU, bf16 ? at::kBFloat16 : at::kFloat, /*afresh=*/true));
  if (n > 1) measure_collectives(*world, m);
  m.devices_per_node = n;
  m.cores_per_node = util::node_cores();
  m.host_bandwidth = m.intra_bandwidth;
  m.device_memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE)) / n;
  m.operators = measure_operators(*world, bf16 ? at::kBFloat16 : at::kFloat);
  m.operators.precision = bf16 ? "bf16-mixed" : "fp32";
  calibration_run(world, m, bf16);
  if (leader) {
    std::printf("%s", m.to_json().c_str());
    if (!o.save.empty()) {
      util::write_text_file(o.save, m.to_json());
      std::printf("meshtrain: machine profile written to %s (use: meshtrain plan --machine %s ...)\n", o.save.c_str(),
                  o.save.c_str());
    }
  }
  return 0;
}

}  // namespace meshtrain::apps
