#include "meshtrain/plan/time_model.h"

#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/operator_time.h"
#include "meshtrain/plan/shared_cores.h"

#include <algorithm>
#include <optional>

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

// What every term of a step's time reads: the layout, the workload, the
// machine, and what the ranks hold (from estimate_memory).
struct StepInputs {
  const model::GptConfig& model;
  const Workload& w;
  const Layout& l;
  const Machine& machine;
  double m = 1;   // micro-batches per data rank per step
  double b = 1;   // sequences per micro-batch
  double t = 1;   // tp
  double cp = 1;  // context parallel: a rank computes a cp-th of each sequence
  double rate = 0;  // FLOP/s a device achieves
  double psi = 0, expert_psi = 0;  // the most parameters a rank reduces, and of those the experts
  int64_t most_layers = 0, most_moe_layers = 0;
  double activation = 0;  // bytes of one micro-batch's activation [b, s, h]
};

// Whether the machine's operators were measured in the plan's precision (Note [Operator time]).
bool measured_for(const StepInputs& in) {
  return in.machine.operators.measured_for(in.w.precision.activation);
}

// One micro-batch's work on one rank through `dense` plain and `moe`
// mixture-of-experts blocks, and the head where `head` says how its loss runs:
// the operators' measured times (Note [Operator time]), or without them the
// FLOPs at the calibrated rate (6 per weight per token, a third forward; what
// recompute repeats: selective, the attention core (4·seq·width per token) or
// op-level, the products not kept (Note [Op-level recompute]); full, every
// block's forward).
Work micro_batch_work(const StepInputs& in, double dense, double moe, std::optional<bool> head) {
  const model::GptConfig& model = in.model;
  const OperatorRates& rates = in.machine.operators;
  Work w;
  const bool measured = measured_for(in);
  auto add = [&](const Work& one, double times) {
    w.forward += times * one.forward, w.backward += times * one.backward, w.recompute += times * one.recompute;
  };
  if (measured) {
    if (dense > 0) add(block_work(model, false, in.l, in.w, rates), dense);
    if (moe > 0) add(block_work(model, true, in.l, in.w, rates), moe);
    if (head) add(head_work(model, in.l, in.w, *head, rates), 1);
    return {w.forward * rates.overhead, w.backward * rates.overhead, w.recompute * rates.overhead};
  }
  auto recomputed_products = [&](bool moe_block) {
    double per_token = 0;
    for (const BlockProduct& p : op_level_products(model, moe_block)) per_token += p.kept ? 0 : 2 * p.in * p.out * p.times;
    return per_token;
  };
  const double s = static_cast<double>(model.context), h = static_cast<double>(model.q_width());
  double flops = dense * model.block_training_flops() + (moe > 0 ? moe * model.block_training_flops(true) : 0);
  // The experts' products follow the rank's load (top_k per token is a load of 1).
  if (const double load = rank_moe_load(model, in.w, in.l.dims.ep); moe > 0 && load > 0) {
    double expert = 0;  // forward FLOPs per token
    for (const BlockProduct& p : op_level_products(model, true)) expert += p.expert ? 2 * p.in * p.out * p.times : 0;
    flops += moe * 3 * s * expert * (load - 1);
  }
  double repeated = 0;
  switch (in.l.activation_checkpoint) {
    case parallel::CheckpointMode::kNone: break;
    case parallel::CheckpointMode::kSelective:
      if (op_level_recompute(in.l, in.w)) {
        repeated = s * (dense * recomputed_products(false) + (moe > 0 ? moe * recomputed_products(true) : 0));
      } else {
        repeated = (dense + moe) * s * 4 * s * h;
      }
      break;
    case parallel::CheckpointMode::kFull: repeated = flops / 3; break;
  }
  // The head: three products over the vocabulary, a fourth where the loss makes them again.
  const double head_flops = head ? model.head_training_flops() * (*head ? 4.0 / 3 : 1.0) : 0;
  const double seconds_per_flop = in.b / in.t / in.cp / in.rate;
  w.forward = seconds_per_flop * (flops + head_flops) / 3;
  w.backward = seconds_per_flop * (2 * (flops + head_flops) / 3 + repeated);
  w.recompute = seconds_per_flop * repeated;
  return w;
}

// The slowest pipeline rank's compute (its blocks; embedding lookups are
// free, the head is not; with measured operators, AdamW's pass), what
// recompute adds, and the pipeline bubble.
void add_compute(TimeBreakdown& time, StepInputs& in, const std::vector<RankMemory>& ranks) {
  const model::GptConfig& model = in.model;
  const OperatorRates& rates = in.machine.operators;
  double slowest = -1;
  Work per_step;
  for (const RankMemory& rank : ranks) {
    const double layers = static_cast<double>(rank.layers), moe_layers = static_cast<double>(rank.moe_layers);
    const bool last = rank.pipeline_rank == in.l.dims.pp - 1;
    const Work w = micro_batch_work(in, layers - moe_layers, moe_layers,
                                    last ? std::optional<bool>(rank.loss_in_backward) : std::nullopt);
    // AdamW over the rank's parameters, a shard of them under ZeRO; offloaded, on the host (add_pipeline_and_offload).
    const double update = measured_for(in) && !in.l.offloaded() ? rates.overhead * optimizer_seconds(
        rank.parameter_count / static_cast<double>(in.l.dims.zero_stage > 0 ? in.l.shards() : 1), in.w, rates) : 0;
    // The slowest rank by its whole step's work (without measured operators: its FLOPs, recompute included).
    const double seconds = in.m * (w.forward + w.backward) + update;
    if (seconds > slowest) {
      slowest = seconds, time.optimizer = update;
      per_step = {in.m * w.forward, in.m * w.backward, in.m * w.recompute};
    }
    in.most_layers = std::max(in.most_layers, rank.layers);
    in.most_moe_layers = std::max(in.most_moe_layers, rank.moe_layers);
    if (rank.parameter_count > in.psi) in.psi = rank.parameter_count, in.expert_psi = rank.expert_parameter_count;
  }
  time.recompute = per_step.recompute;
  time.compute = per_step.forward + per_step.backward;
  if (in.l.dims.pp == 1) return;
  const SharedCores cores{static_cast<double>(std::min(in.machine.devices_per_node, in.l.world())),
                          static_cast<double>(in.machine.cores_per_node), static_cast<double>(in.l.dims.pp)};
  if (!cores.shared()) {
    const double bubble = parallel::pipeline::theoretical_bubble(
        static_cast<int>(in.l.dims.pp), static_cast<int>(in.l.dims.virtual_stages), static_cast<int>(in.m));
    time.bubble = time.compute * bubble / (1 - bubble);
    return;
  }
  // Each chunk's forward and backward (with what recompute repeats) per micro-batch, walked under the sharing.
  const std::vector<int64_t> blocks = stage_blocks(model, in.l.dims.pp * in.l.dims.virtual_stages);
  std::vector<double> forward, backward;
  for (size_t k = 0, first = 0; k < blocks.size(); first += static_cast<size_t>(blocks[k]), ++k) {
    double moe_layers = 0;
    for (size_t i = first; i < first + static_cast<size_t>(blocks[k]); ++i) {
      moe_layers += model.is_moe_block(static_cast<int64_t>(i)) ? 1 : 0;
    }
    const bool last = k + 1 == blocks.size();
    const Work w = micro_batch_work(in, static_cast<double>(blocks[k]) - moe_layers, moe_layers,
                                    last ? std::optional<bool>(ranks.back().loss_in_backward) : std::nullopt);
    forward.push_back(w.forward);
    backward.push_back(w.backward);
  }
  const parallel::pipeline::Schedule schedule = parallel::pipeline::make_schedule(
      in.l.dims.schedule, static_cast<int>(in.l.dims.pp), static_cast<int>(in.l.dims.virtual_stages), static_cast<int>(in.m));
  // The walk includes the slowest stage's work, sped up while others wait.
  const double walked = pipeline_makespan(schedule, forward, backward, cores);
  if (walked >= time.compute) {
    time.bubble = walked - time.compute;
  } else {
    time.recompute *= walked / time.compute;
    time.compute = walked;
  }
}

// Tensor parallel: four collectives per layer (six with full recompute) and
// the embedding's and head's, exposed.
void add_tensor_parallel(TimeBreakdown& time, const StepInputs& in) {
  const Layout& l = in.l;
  if (l.dims.tp == 1) return;
  const Link tp = link(in.machine, l.dims.tp, 1);
  // Op-level recompute keeps reduce-scatters but not all-gathers: sequence parallel's two run again.
  const bool op_level = op_level_recompute(l, in.w);
  const double per_layer =
      4 + (l.activation_checkpoint == parallel::CheckpointMode::kFull ? 2 : 0) + (op_level && l.dims.sequence_parallel ? 2 : 0);
  const double collectives = in.m * (static_cast<double>(in.most_layers) * per_layer + 2);  // + embedding and head
  // Sequence parallel's all-gather and reduce-scatter are two blocking collectives where an all-reduce is one.
  const double syncs = l.dims.sequence_parallel ? 2 : 1;
  const double seconds = collectives * (tp.all_reduce(in.activation, in.t) + syncs * in.machine.sync);
  time.traffic.push_back({"tp", l.dims.sequence_parallel ? "all-gather + reduce-scatter activations" : "all-reduce activations",
                          collectives * in.activation, seconds});
  time.tensor_parallel = seconds;
}

// Expert parallel, dispatch and combine: an all-to-all each way per MoE layer
// and micro-batch, forward and backward (and the recomputed forward), each
// sending (ep-1)/ep of the layer's assignments off the rank, plus the
// forward's exchange of token counts.
void add_expert_parallel(TimeBreakdown& time, const StepInputs& in) {
  const Layout& l = in.l;
  if (l.dims.ep == 1 || in.most_moe_layers == 0) return;
  const Link ep_link = link(in.machine, l.dims.ep, l.dims.tp);
  const double n = static_cast<double>(l.dims.ep), forwards = l.activation_checkpoint == parallel::CheckpointMode::kFull ? 2 : 1;
  const double load = rank_moe_load(in.model, in.w, l.dims.ep);
  const double exchange = assignments(in.model, static_cast<double>(in.model.context) * in.b / in.cp, load) / in.t *
                          static_cast<double>(in.model.width) * in.w.precision.activation * (n - 1) / n;  // a tp rank sends its share
  const double per_layer = (2 * forwards + 2) * exchange;
  const double seconds_per_layer =
      per_layer / ep_link.bandwidth + (3 * forwards + 2) * ((n - 1) * ep_link.latency + in.machine.sync);
  const double layers = in.m * static_cast<double>(in.most_moe_layers);
  time.expert_parallel = layers * seconds_per_layer;
  time.traffic.push_back({"ep", "all-to-all tokens to and from experts", layers * per_layer, time.expert_parallel});
}

// Data parallel or ZeRO: gradient reductions (and ZeRO's parameter gathers),
// the part not hidden behind backward (ZeRO-3: behind the whole compute).
void add_data_parallel(TimeBreakdown& time, const StepInputs& in) {
  const Layout& l = in.l;
  const Machine& machine = in.machine;
  const Precision& p = in.w.precision;
  const double psi = in.psi, expert_psi = in.expert_psi, m = in.m;
  // Context-parallel peers average gradients like replicas (Note [Context parallel]).
  const double shards = static_cast<double>(l.shards()), replicas = static_cast<double>(l.dims.dp * l.dims.cp);
  const Link shard_link = link(machine, l.dims.fsdp, l.dims.ep * l.dims.cp * l.dims.tp),
             replica_link = link(machine, l.dims.gradient_ranks(), l.dims.tp);
  // Behind backward; on a CPU's cores, busy computing, nothing (Note [Shared cores]).
  const bool cpu = machine.cores_per_node > 0;
  double hidden_behind = cpu ? 0.0 : 2.0 / 3.0 * (time.compute - time.recompute);
  double dp_seconds = 0;
  auto add = [&](const char* group, const char* what, double bytes, double seconds) {
    if (bytes <= 0) return;
    time.traffic.push_back({group, what, bytes, seconds});
    dp_seconds += seconds;
  };
  if (l.dims.zero_stage == 0) {
    // Expert gradients are reduced only among the ranks holding the same experts.
    const double shared = psi - expert_psi, data = static_cast<double>(l.dims.gradient_ranks());
    add("dp", "all-reduce gradients", p.grad * shared, replica_link.all_reduce(p.grad * shared, data));
    if (expert_psi > 0) {
      add("dp", "all-reduce expert gradients", p.grad * expert_psi,
          link(machine, l.expert_data_ranks() * l.dims.cp, l.dims.ep * l.dims.tp).all_reduce(p.grad * expert_psi, replicas));
    }
  } else {
    const double grads = p.grad * psi, params = p.param * psi;
    const double reductions = l.dims.zero_stage == 1 ? 1 : m;  // ZeRO-2/3 reduce-scatter after every micro-batch
    add("dp", "reduce-scatter gradients", reductions * grads, reductions * shard_link.all_gather(grads, shards));
    // Shards are copies over dp x ep x cp (an expert's over dp x cp only).
    const double shared = p.grad * (psi - expert_psi) / shards, experts = p.grad * expert_psi / shards;
    const double copies = static_cast<double>(l.dims.dp * l.dims.ep * l.dims.cp);
    if (copies > 1) add("dp", "all-reduce gradient shards across replicas", shared,
                        link(machine, l.dims.dp * l.dims.ep * l.dims.cp, l.dims.tp).all_reduce(shared, copies));
    if (replicas > 1 && experts > 0) add("dp", "all-reduce expert gradient shards across replicas", experts,
                                         link(machine, l.dims.dp * l.dims.cp, l.dims.tp * l.dims.fsdp * l.dims.ep)
                                             .all_reduce(experts, replicas));
    if (l.dims.zero_stage < 3) {
      add("dp", "all-gather parameters", params, shard_link.all_gather(params, shards));
    } else {
      add("dp", "all-gather parameters (forward and backward)", 2 * m * params,
          2 * m * shard_link.all_gather(params, shards));
      if (!cpu) hidden_behind = time.compute;
    }
  }
  time.data_parallel = std::max(0.0, dp_seconds - hidden_behind);
}

// Context parallel, per layer and micro-batch (Note [Ring attention], [All-to-all attention]):
// the ring's key/value hops (fp32, forward and backward), hidden behind the
// attention's products up to their length, and the key/value gradients'
// hops home, exposed; the all-to-all's four exchanges each way, exposed;
// hybrid both, the ring over cp / cp_a2a groups.
void add_context_parallel(TimeBreakdown& time, const StepInputs& in) {
  const Layout& l = in.l;
  if (l.dims.cp == 1) return;
  const model::GptConfig& model = in.model;
  const double s = static_cast<double>(model.context), rows = in.b * s / in.cp;
  const double qw = static_cast<double>(model.q_width()) / in.t, kv = static_cast<double>(model.kv_width()) / in.t;
  const double forwards = l.activation_checkpoint == parallel::CheckpointMode::kFull ? 2 : 1;
  const double layers = in.m * static_cast<double>(in.most_layers);
  const int64_t a2a = all_to_all_group(model, l);
  const double ring = static_cast<double>(l.dims.cp / a2a);
  double exposed = 0, bytes = 0;
  if (a2a > 1) {  // q, k, v there and the output back, forward and backward
    const Link group = link(in.machine, a2a, l.dims.tp);
    const double n = static_cast<double>(a2a), exchange = 4 * rows * (2 * qw + 2 * kv) * (n - 1) / n;
    bytes += (forwards + 1) * exchange;
    exposed += (forwards + 1) * (exchange / group.bandwidth + 4 * ((n - 1) * group.latency + in.machine.sync));
  }
  if (ring > 1) {
    const Link hop = link(in.machine, l.dims.cp, l.dims.tp);
    const double block = 2 * 4 * rows * kv;  // k and v of a rank's rows (a hybrid group's rows over its share of heads)
    const double kv_hops = (forwards + 1) * (ring - 1) * block, grad_hops = ring * block;
    // The products the hops hide behind: causal, half of 12·s·qw FLOPs per row forward and backward (a third
    // forward, the backward recomputing the scores once more), those of the ring's last step hiding nothing.
    const double products = (forwards + 3) / 3 * 6 * s * qw * rows / in.rate * (ring - 1) / ring;
    bytes += kv_hops + grad_hops;
    exposed += std::max(0.0, kv_hops / hop.bandwidth - products) + grad_hops / hop.bandwidth +
               (forwards + 2) * (ring - 1) * (hop.latency + in.machine.sync);
  }
  time.context_parallel = layers * exposed;
  time.traffic.push_back({"cp", a2a == l.dims.cp ? "all-to-all heads and sequence"
                                : a2a > 1 ? "all-to-all in groups, ring of key/value blocks across"
                                          : "ring of key/value blocks and their gradients",
                          layers * bytes, time.context_parallel});
}

// The pipeline's sends between stages, and offload's traffic with the host.
void add_pipeline_and_offload(TimeBreakdown& time, const StepInputs& in) {
  const Layout& l = in.l;
  const Precision& p = in.w.precision;
  if (l.dims.pp > 1) {
    // A stage sends the residual stream (fp32 under autocast).
    const double sent = in.activation * p.residual / p.activation;
    const double boundary = l.dims.sequence_parallel ? sent / in.t : sent;
    const Link pp = link(in.machine, 2, l.data_ranks() * l.dims.tp);
    const double messages = 2 * in.m * static_cast<double>(l.dims.virtual_stages);  // activation forward, gradient back
    time.pipeline = messages * (pp.send(boundary) + in.machine.sync);
    time.traffic.push_back({"pp", "send activations and gradients", messages * boundary, time.pipeline});
  }
  if (l.offloaded()) {
    const double shards = static_cast<double>(l.shards()), shard = in.psi / shards;
    double bytes = (p.grad + p.param) * shard;              // gradients down, parameters up
    bytes += (2 * p.optimizer + p.grad + p.param) * shard;  // the host optimizer's pass
    if (l.offload_params != offload::Tier::kDevice) bytes += 2 * in.m * p.param * shard;  // parameters fetched per micro-batch
    time.offload = bytes / in.machine.host_bandwidth;
    time.traffic.push_back({"host", "offload traffic", bytes, time.offload});
  }
}

}  // namespace

TimeBreakdown estimate_time(const model::GptConfig& model, const Workload& w, const Layout& l, const Machine& machine,
                            int64_t microbatches, const std::vector<RankMemory>& ranks) {
  StepInputs in{model, w, l, machine};
  in.m = static_cast<double>(microbatches);
  in.b = static_cast<double>(l.micro_batch);
  in.t = static_cast<double>(l.dims.tp);
  in.cp = static_cast<double>(l.dims.cp);
  // The rate the ring's hops hide behind: the attention kernel's where measured.
  in.rate = measured_for(in) ? machine.operators.attention_flops / machine.operators.overhead
                             : machine.peak_flops * machine.mfu;
  in.activation = w.precision.activation * static_cast<double>(model.context) / in.cp * in.b * static_cast<double>(model.width);
  TimeBreakdown time;
  add_compute(time, in, ranks);
  add_tensor_parallel(time, in);
  add_expert_parallel(time, in);
  add_context_parallel(time, in);
  add_data_parallel(time, in);
  add_pipeline_and_offload(time, in);
  const double tokens = in.m * in.b * static_cast<double>(l.data_ranks()) * static_cast<double>(model.context);
  time.tokens_per_second = tokens / time.step();
  const double devices = static_cast<double>(l.world());
  time.mfu = tokens / static_cast<double>(model.context) * model.training_flops_per_sequence() /
             (time.step() * devices * machine.peak_flops);
  return time;
}

}  // namespace meshtrain::plan
