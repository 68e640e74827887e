// meshtrain bench cp: context-parallel attention (Note [Ring attention],
// Note [All-to-all attention]) for every cp in 2, 4, 8 the world allows and
// each --seq, in one run: per rank, the (query, key) scores computed and the
// seconds in block products under the zigzag and contiguous splits (the
// causal load balance, measured); the bytes each rank sent (counted by the
// communicator) against the formula; the share of the ring's key/value
// transfers hidden behind the products; and tokens/s (forward and backward)
// against one rank's on the whole sequence, scaled by cp.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/apps/bench_util.h"
#include "meshtrain/parallel/ring_attention.h"
#include "meshtrain/parallel/ulysses_attention.h"
#include "meshtrain/util/cores.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

namespace meshtrain::apps {
namespace {

using CommPtr = std::shared_ptr<comm::Communicator>;

struct Shape {
  int64_t batch = 1, heads = 8, kv_heads = 4, head_dim = 64;
};

int64_t sent_bytes(const comm::Communicator& c) {
  const comm::CommStats s = c.stats();
  int64_t total = 0;
  for (comm::OpKind k : {comm::OpKind::kSend, comm::OpKind::kAllToAll, comm::OpKind::kAllGather})
    total += s.per_op[static_cast<size_t>(k)].wire_bytes;
  return total;
}

// Hybrid's all-to-all groups: pairs of ranks (8 and 4 heads split in two), the ring across them.
constexpr int64_t kHybridGroup = 2;

// Note [Ring attention] / [All-to-all attention], bytes one rank sends per forward and backward.
double formula_bytes(const std::string& impl, const Shape& s, int64_t local, int64_t cp) {
  const double kv = 4.0 * s.batch * s.kv_heads * local * s.head_dim, q = 4.0 * s.batch * s.heads * local * s.head_dim,
               pos = 8.0 * local;
  // The ring over n ranks of `rows` local rows: k, v, positions each way; dk, dv home (k and v of heads / a
  // over a times the rows weigh what k and v of every head over the rows do).
  auto ring = [&](double n, double rows) { return (n - 1) * (2 * kv + 8.0 * rows) * 2 + n * 2 * kv; };
  // The all-to-all over n ranks: q, k, v, o and back; positions.
  auto all_to_all = [&](double n) { return 2.0 * (n - 1) / n * (2 * q + 2 * kv) + (n - 1) * pos; };
  if (impl == "all_to_all") return all_to_all(static_cast<double>(cp));
  if (impl == "hybrid") {
    const double a = static_cast<double>(kHybridGroup);
    return all_to_all(a) + ring(static_cast<double>(cp) / a, static_cast<double>(local) * a);
  }
  return ring(static_cast<double>(cp), static_cast<double>(local));
}

struct AttentionRun {
  double seconds = 0;  // median forward + backward
  parallel::RingProfile profile;
  int64_t bytes = 0;
};

AttentionRun measure(const std::string& impl, const CommPtr& group, const Shape& s, int64_t length, int steps) {
  const int64_t cp = group->size(), r = group->rank(), local = length / cp;
  const at::Tensor pos = impl == "ring_contiguous" ? parallel::contiguous_positions(length, cp, r)
                                                    : parallel::zigzag_positions(length, cp, r);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(17 + r);
  const at::Tensor q = at::randn({s.batch, s.heads, local, s.head_dim}, g).requires_grad_();
  const at::Tensor k = at::randn({s.batch, s.kv_heads, local, s.head_dim}, g).requires_grad_();
  const at::Tensor v = at::randn({s.batch, s.kv_heads, local, s.head_dim}, g).requires_grad_();
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  CommPtr a2a, ring;  // hybrid's groups; their bytes are the rank's
  if (impl == "hybrid") {
    a2a = group->split(static_cast<int>(r / kHybridGroup), static_cast<int>(r), group->name() + ":a2a");
    ring = group->split(static_cast<int>(r % kHybridGroup), static_cast<int>(r), group->name() + ":ring");
  }
  auto sent = [&] { return a2a ? sent_bytes(*a2a) + sent_bytes(*ring) : sent_bytes(*group); };
  AttentionRun run;
  std::vector<double> times;
  for (int i = 0; i <= steps; ++i) {  // the first is a warm-up
    parallel::RingProfile profile;
    const int64_t before = sent();
    group->barrier().wait();
    const auto start = BenchClock::now();
    {
      parallel::RingProfileScope scope(profile);
      const model::AttentionSpec rule{scale, true};
      const at::Tensor out = impl == "all_to_all" ? parallel::all_to_all_attention(q, k, v, pos, group, rule)
                             : impl == "hybrid"   ? parallel::hybrid_attention(q, k, v, pos, a2a, ring, rule)
                                                  : parallel::ring_attention(q, k, v, pos, group, rule);
      out.sum().backward();
    }
    group->barrier().wait();
    if (i == 0) continue;
    times.push_back(seconds_since(start));
    run.profile = profile;
    run.bytes = sent() - before;
  }
  run.seconds = median(times);
  return run;
}

// Every rank's numbers at rank 0 of `group`: [ranks, 4] (scores, compute s, wait s, bytes).
at::Tensor gather_rows(const CommPtr& group, const AttentionRun& run) {
  const at::Tensor mine = at::tensor({static_cast<double>(run.profile.scores), run.profile.compute_s,
                                      run.profile.wait_s, static_cast<double>(run.bytes)},
                                     at::kDouble);
  const at::Tensor all = at::empty({group->size(), 4}, at::kDouble);
  group->all_gather(all, mine.unsqueeze(0)).wait();
  return all;
}

// Seconds of the ring's forward key/value hops alone (no products in between), for the hidden share.
double transfer_seconds(const CommPtr& group, const Shape& s, int64_t local) {
  const at::Tensor kv = at::zeros({2, s.batch, s.kv_heads, local, s.head_dim});
  const int n = group->size(), r = group->rank();
  std::vector<double> times;
  for (int i = 0; i < 4; ++i) {
    group->barrier().wait();
    const auto start = BenchClock::now();
    for (int step = 0; step + 1 < n; ++step) {
      at::Tensor in = at::empty_like(kv);
      comm::wait_all({group->recv(in, (r + n - 1) % n, 5), group->send(kv, (r + 1) % n, 5)});
    }
    if (i > 0) times.push_back(seconds_since(start));
  }
  return median(times);
}

int run_bench_cp(comm::Runtime& runtime, const std::vector<int64_t>& lengths, int steps) {
  const CommPtr world = runtime.world();
  const Shape shape;
  const int cores = util::node_cores();
  std::vector<nlohmann::json> rows;
  for (int64_t length : lengths) {
    // Every rank is busy in every measurement (groups of cp side by side; rank 0's
    // group reports), so no rank idles in a collective and the cores are shared alike.
    at::set_num_threads(std::max(1, cores / world->size()));
    // The peer: one rank on the whole sequence.
    const CommPtr alone = world->split(world->rank(), 0, "bench:cp1");
    const double single = measure("ring_zigzag", alone, shape, length, steps).seconds;
    for (int cp : {2, 4, 8}) {
      if (world->size() % cp != 0 || length % (2 * cp) != 0) continue;
      const CommPtr group = world->split(world->rank() / cp, world->rank(), "bench:cp" + std::to_string(cp));
      {
        const double transfer = transfer_seconds(group, shape, length / cp);
        for (const std::string impl : {"ring_zigzag", "ring_contiguous", "all_to_all", "hybrid"}) {
          if (impl == "all_to_all" && (shape.heads % cp != 0 || shape.kv_heads % cp != 0)) continue;
          if (impl == "hybrid" && cp < 2 * kHybridGroup) continue;  // a ring of one group is all-to-all
          const AttentionRun run = measure(impl, group, shape, length, steps);
          const at::Tensor all = gather_rows(group, run);
          if (world->rank() != 0) continue;  // rank 0's group reports
          const at::Tensor scores = all.select(1, 0), compute = all.select(1, 1), wait = all.select(1, 2);
          const double formula = formula_bytes(impl, shape, length / cp, cp);
          const double bytes = all.select(1, 3).max().item<double>();
          // The hops alone were timed over the whole group: the ring's hidden share, not hybrid's.
          const bool whole_ring = impl.rfind("ring", 0) == 0;
          const double hidden = whole_ring ? std::max(0.0, 1.0 - wait.max().item<double>() / (2 * transfer)) : 0.0;
          const double tokens = static_cast<double>(length * shape.batch) / run.seconds;
          const double ideal = static_cast<double>(length * shape.batch) / single * cp;
          const bool ring = impl != "all_to_all";  // the profile covers the ring's block products
          const double score_spread = ring ? (scores.max() / scores.min()).item<double>() : 1.0;
          const double compute_spread = ring ? (compute.max() / compute.min()).item<double>() : 1.0;
          nlohmann::json row = {{"seq", length}, {"cp", cp}, {"impl", impl},
                                {"scores_max_over_min", ring ? nlohmann::json(score_spread) : nlohmann::json(nullptr)},
                                {"compute_s_max_over_min", ring ? nlohmann::json(compute_spread) : nlohmann::json(nullptr)},
                                {"bytes_per_rank", bytes}, {"bytes_formula", formula},
                                {"ring_hidden_share", hidden}, {"tokens_per_s", tokens},
                                {"vs_one_rank_times_cp", tokens / ideal}, {"step_seconds", run.seconds}};
          rows.push_back(row);
          std::printf("seq %6lld cp %d %-15s | scores max/min %5.2f  compute max/min %5.2f | bytes %10.0f "
                      "(formula %10.0f) | hidden %5.1f%% | %8.0f tok/s, %.2fx one rank x cp\n",
                      static_cast<long long>(length), cp, impl.c_str(), score_spread, compute_spread, bytes, formula,
                      100 * hidden, tokens, tokens / ideal);
          std::fflush(stdout);
        }
      }
      world->barrier().wait();
    }
  }
  if (world->rank() == 0)
    for (const auto& row : rows) std::printf("%s\n", row.dump().c_str());
  return 0;
}

}  // namespace

CommandPtr add_bench_cp(CLI::App& bench) {
  struct Args {
    std::vector<int64_t> lengths{4096, 8192};
    int steps = 3;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = bench.add_subcommand(
      "cp",
      "Context-parallel attention (ring with the zigzag and contiguous splits, all-to-all, and from cp 4 hybrid: "
      "all-to-all in pairs, the ring across) for cp = 2, 4, 8 up to the "
      "rank count, causal, 8 query and 4 key/value heads of 64, batch 1: per-rank scores and product seconds (the load "
      "balance), bytes per rank against the formula, the share of the ring's transfers hidden behind products, and "
      "tokens/s (forward + backward) against one rank on the whole sequence times cp. One JSON line per row.");
  sub->add_option("--seq", a->lengths, "Sequence lengths, comma-separated")->delimiter(',')->capture_default_str();
  sub->add_option("--steps", a->steps, "Timed steps (after one warm-up); the median is reported")->capture_default_str();
  return command(sub, [a](comm::Runtime& runtime) { return run_bench_cp(runtime, a->lengths, a->steps); });
}

}  // namespace meshtrain::apps
