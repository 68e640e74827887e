#include "meshtrain/plan/time_model.h"

#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/plan/memory_model.h"

#include <algorithm>

namespace meshtrain::plan {

namespace {

struct Link {
  double bandwidth, latency;
  // Ring collectives over n ranks: all-reduce moves 2(n-1)/n of the bytes in
  // 2(n-1) steps; all-gather and reduce-scatter half of each.
  double all_reduce(double bytes, double n) const {
    return n <= 1 ? 0 : 2 * (n - 1) / n * bytes / bandwidth + 2 * (n - 1) * latency;
  }
  double all_gather(double bytes, double n) const { return all_reduce(bytes, n) / 2; }
  double send(double bytes) const { return bytes / bandwidth + latency; }
};

// A group of `size` ranks, `stride` apart in the world, stays within a node
// when the ranks it spans do.
Link link(const Machine& machine, int64_t size, int64_t stride) {
  const bool inside = size * stride <= machine.devices_per_node;
  return {inside ? machine.intra_bandwidth : machine.inter_bandwidth, machine.latency};
}

}  // namespace

TimeBreakdown estimate_time(const ModelShape& model, const Workload& w, const Layout& l, const Machine& machine,
                            int64_t microbatches, const std::vector<RankMemory>& ranks) {
  TimeBreakdown time;
  const double m = static_cast<double>(microbatches), b = static_cast<double>(l.micro_batch);
  const double t = static_cast<double>(l.tp), rate = machine.peak_flops * machine.mfu;
  const Precision& p = w.precision;

  // The slowest pipeline rank (its blocks; embedding lookups are free, the
  // head is not) and the most parameters any rank reduces.
  double slowest = 0, slowest_recompute = 0, psi = 0;
  int64_t most_layers = 0;
  for (const RankMemory& rank : ranks) {
    const double layers = static_cast<double>(rank.layers);
    const double flops = layers * model.block_training_flops() +
                         (rank.pipeline_rank == l.pp - 1 ? model.head_training_flops() : 0);
    if (flops > slowest) slowest = flops, slowest_recompute = layers * model.block_recompute_flops(l.recompute);
    most_layers = std::max(most_layers, rank.layers);
    psi = std::max(psi, rank.parameter_count);
  }
  const double sequences = m * b;  // per data rank per step
  time.recompute = sequences * slowest_recompute / t / rate;
  time.compute = sequences * slowest / t / rate + time.recompute;
  if (l.pp > 1) {
    const double bubble = parallel::pipeline::theoretical_bubble(static_cast<int>(l.pp), static_cast<int>(l.virtual_stages),
                                                                 static_cast<int>(microbatches));
    time.bubble = time.compute * bubble / (1 - bubble);
  }

  const double activation = p.activation * static_cast<double>(model.seq) * b * static_cast<double>(model.width);
  if (l.tp > 1) {
    const Link tp = link(machine, l.tp, 1);
    const double per_layer = 4 + (l.recompute == "full" ? 2 : 0);
    const double collectives = m * (static_cast<double>(most_layers) * per_layer + 2);  // + embedding and head
    const double seconds = collectives * tp.all_reduce(activation, t);
    time.traffic.push_back({"tp", l.sp ? "all-gather + reduce-scatter activations" : "all-reduce activations",
                            collectives * activation, seconds});
    time.tensor_parallel = seconds;
  }

  const double shards = static_cast<double>(l.shards()), replicas = static_cast<double>(l.dp);
  const Link shard_link = link(machine, l.fsdp, l.tp), replica_link = link(machine, l.data_ranks(), l.tp);
  double hidden_behind = 2.0 / 3.0 * (time.compute - time.recompute);  // backward
  double dp_seconds = 0;
  auto add = [&](const char* group, const char* what, double bytes, double seconds) {
    if (bytes <= 0) return;
    time.traffic.push_back({group, what, bytes, seconds});
    dp_seconds += seconds;
  };
  if (l.zero_stage == 0) {
    add("dp", "all-reduce gradients", p.grad * psi, replica_link.all_reduce(p.grad * psi, replicas));
  } else {
    const double grads = p.grad * psi, params = p.param * psi;
    const double reductions = l.zero_stage == 1 ? 1 : m;  // ZeRO-2/3 reduce-scatter after every micro-batch
    add("dp", "reduce-scatter gradients", reductions * grads, reductions * shard_link.all_gather(grads, shards));
    if (l.dp > 1) add("dp", "all-reduce gradient shards across replicas", grads / shards,
                      link(machine, l.dp, l.tp * l.fsdp).all_reduce(grads / shards, replicas));
    if (l.zero_stage < 3) {
      add("dp", "all-gather parameters", params, shard_link.all_gather(params, shards));
    } else {
      add("dp", "all-gather parameters (forward and backward)", 2 * m * params,
          2 * m * shard_link.all_gather(params, shards));
      hidden_behind = time.compute;
    }
  }
  time.data_parallel = std::max(0.0, dp_seconds - hidden_behind);

  if (l.pp > 1) {
    const double boundary = l.sp ? activation / t : activation;
    const Link pp = link(machine, 2, l.data_ranks() * l.tp);
    const double messages = 2 * m * static_cast<double>(l.virtual_stages);  // activation forward, gradient back
    time.pipeline = messages * pp.send(boundary);
    time.traffic.push_back({"pp", "send activations and gradients", messages * boundary, time.pipeline});
  }

  if (l.offload != "none") {
    const double shard = psi / shards;
    double bytes = (p.grad + p.param) * shard;                                  // gradients down, parameters up
    bytes += (2 * p.optimizer + p.grad + p.param) * shard;                      // the host optimizer's pass
    if (l.offload == "parameters") bytes += 2 * m * p.param * psi / shards;     // parameters fetched per micro-batch
    time.offload = bytes / machine.host_bandwidth;
    time.traffic.push_back({"host", "offload traffic", bytes, time.offload});
  }

  const double tokens = m * b * static_cast<double>(l.data_ranks()) * static_cast<double>(model.seq);
  time.tokens_per_second = tokens / time.step();
  const double devices = static_cast<double>(l.world());
  time.mfu = tokens / static_cast<double>(model.seq) * model.training_flops_per_sequence() /
             (time.step() * devices * machine.peak_flops);
  return time;
}

}  // namespace meshtrain::plan
