#include "meshtrain/plan/search.h"

#include <algorithm>
#include <stdexcept>

namespace meshtrain::plan {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

// The term of a breakdown that is largest, for "why it does not fit".
std::string largest_term(const MemoryBreakdown& m) {
  const std::vector<std::pair<const char*, double>> terms = {
      {"parameters", m.parameters}, {"gradients", m.gradients}, {"optimizer states", m.optimizer},
      {"activations", m.activations}, {"logits/loss", m.outputs}, {"buffers", m.buffers}, {"work space", m.workspace}};
  const auto it = std::max_element(terms.begin(), terms.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  return std::string(it->first) + " " + format_bytes(it->second);
}

// The context-parallel splits a model allows on `ranks` ranks: cp 1, and
// each cp that divides them and whose zigzag split the context allows, by
// the ring, and by all-to-all where the heads per tp rank split over cp.
std::vector<std::pair<int64_t, mesh::ContextParallelImpl>> cp_choices(const model::GptConfig& model, int64_t ranks,
                                                                       int64_t tp) {
  std::vector<std::pair<int64_t, mesh::ContextParallelImpl>> out = {{1, mesh::ContextParallelImpl::kRing}};
  for (int64_t cp : divisors(ranks)) {
    if (cp == 1 || model.context % (2 * cp) != 0) continue;
    out.push_back({cp, mesh::ContextParallelImpl::kRing});
    if ((model.heads / tp) % cp == 0 && (model.key_value_heads() / tp) % cp == 0) {
      out.push_back({cp, mesh::ContextParallelImpl::kAllToAll});
    }
  }
  return out;
}

// The mesh shapes of `world` ranks: tp (within a node) x cp x pp x data
// ranks, of them ep (a MoE model) and ZeRO shards over all replicas or
// within a node.
std::vector<Layout> mesh_shapes(const model::GptConfig& model, const Machine& machine, int64_t world) {
  std::vector<Layout> shapes;
  for (int64_t tp : divisors(world)) {
    if (tp > machine.devices_per_node) continue;  // tensor parallel stays inside a node
    for (const auto& [cp, cp_impl] : cp_choices(model, world / tp, tp)) {
      for (int64_t pp : divisors(world / (tp * cp))) {
        if (pp > model.layers) continue;
        const int64_t data = world / (tp * cp * pp);
        for (int64_t ep : divisors(data)) {
          if (ep > 1 && (!model.moe() || model.moe_experts % ep != 0)) continue;
          const int64_t replicated = data / ep;
          for (int zero = 0; zero <= 3; ++zero) {
            std::vector<int64_t> shard_counts = {zero == 0 ? 1 : replicated};
            const int64_t node_local = machine.devices_per_node / (tp * cp * ep);
            if (zero > 0 && node_local > 1 && node_local < replicated && replicated % node_local == 0) {
              shard_counts.push_back(node_local);
            }
            for (int64_t fsdp : shard_counts) {
              Layout l;
              l.dims.tp = tp;
              l.dims.cp = cp;
              l.dims.cp_impl = cp_impl;
              l.dims.sequence_parallel = tp > 1 && (model.context / cp) % tp == 0;
              l.dims.pp = pp;
              l.dims.ep = ep;
              l.dims.fsdp = fsdp;
              l.dims.dp = replicated / fsdp;
              l.dims.zero_stage = zero;
              shapes.push_back(l);
            }
          }
        }
      }
    }
  }
  return shapes;
}

}  // namespace

int64_t default_global_batch(const model::GptConfig& model, int64_t world) {
  const int64_t sequences = std::max<int64_t>(1, (int64_t{1} << 20) / model.context);
  return std::max<int64_t>(world, (sequences + world - 1) / world * world);
}

Candidate evaluate(const model::GptConfig& model, const Workload& workload, const Layout& layout, const Machine& machine) {
  Candidate c;
  c.layout = layout;
  const int64_t per_step = layout.micro_batch * layout.data_ranks();
  if (workload.global_batch % per_step != 0) {
    throw std::invalid_argument("layout " + layout.str() + ": the global batch (" + std::to_string(workload.global_batch) +
                                ") is not divisible by mb (" + std::to_string(layout.micro_batch) + ") x dp x fsdp (" +
                                std::to_string(layout.data_ranks()) + ")");
  }
  c.microbatches = workload.global_batch / per_step;
  c.ranks = estimate_memory(model, workload, layout, c.microbatches);
  c.worst = *std::max_element(c.ranks.begin(), c.ranks.end(), [](const RankMemory& a, const RankMemory& b) {
    return a.memory.total() < b.memory.total();
  });
  c.time = estimate_time(model, workload, layout, machine, c.microbatches, c.ranks);
  c.fits = c.worst.memory.total() <= machine.device_memory;
  if (!c.fits) {
    c.why_not = "needs " + format_bytes(c.worst.memory.total()) + " > " + format_bytes(machine.device_memory) +
                " on pipeline rank " + std::to_string(c.worst.pipeline_rank) + " (largest: " +
                largest_term(c.worst.memory) + ", peak at " + c.worst.memory.moment + ")";
  }
  return c;
}

SearchResult search(const model::GptConfig& model, const Workload& workload, const Machine& machine, int64_t world) {
  if (world < 1) throw std::invalid_argument("world size must be >= 1");
  SearchResult result;
  for (const Layout& shape : mesh_shapes(model, machine, world)) {
    const int64_t data = shape.data_ranks();
    std::vector<std::pair<mesh::PipelineSchedule, int64_t>> schedules = {{mesh::PipelineSchedule::kOneFOneB, 1}};
    if (shape.dims.pp > 1) schedules.push_back({mesh::PipelineSchedule::kInterleaved, 2});
    for (const auto& [schedule, v] : schedules) {
      for (int64_t mb = 1; mb <= workload.global_batch / data; mb *= 2) {
        if (workload.global_batch % (mb * data) != 0) continue;
        using parallel::CheckpointMode;
        for (CheckpointMode recompute : {CheckpointMode::kNone, CheckpointMode::kSelective, CheckpointMode::kFull}) {
          // Offload: nothing, the optimizer states, or the parameters too (to host memory).
          for (int offloaded = 0; offloaded < 3; ++offloaded) {
            Layout l = shape;
            l.dims.schedule = schedule;
            l.dims.virtual_stages = v;
            l.micro_batch = mb;
            l.activation_checkpoint = recompute;
            l.offload_optimizer = offloaded >= 1 ? offload::Tier::kHost : offload::Tier::kDevice;
            l.offload_params = offloaded >= 2 ? offload::Tier::kHost : offload::Tier::kDevice;
            try {
              Candidate c = evaluate(model, workload, l, machine);
              ++result.examined;
              (c.fits ? result.fitting : result.rejected).push_back(std::move(c));
            } catch (const std::invalid_argument&) {
              // A layout this model cannot take (divisibility, ZeRO-3 in a pipeline, ...): not a candidate.
            }
          }
        }
      }
    }
  }
  std::sort(result.fitting.begin(), result.fitting.end(), [](const Candidate& a, const Candidate& b) {
    if (a.time.step() != b.time.step()) return a.time.step() < b.time.step();
    return a.worst.memory.total() < b.worst.memory.total();
  });
  std::sort(result.rejected.begin(), result.rejected.end(), [](const Candidate& a, const Candidate& b) {
    return a.worst.memory.total() < b.worst.memory.total();
  });
  return result;
}

}  // namespace meshtrain::plan
