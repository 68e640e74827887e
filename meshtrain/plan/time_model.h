// Time of one training step for any layout on a machine profile. See Note [Time model].
#pragma once

#include "meshtrain/plan/layout.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/model/gpt_config.h"

#include <string>
#include <vector>

namespace meshtrain::plan {

// Note [Time model]
// compute    the slowest pipeline rank's operators at the machine's
//            measured rates (Note [Operator time]); without them its FLOPs
//            (6 per weight per token forward + backward, the attention's
//            12·s·h per token and layer, and what recompute repeats;
//            Narayanan et al. 2021, Eq. 3) at peak x MFU, tensor and context
//            parallel dividing them by tp and cp.
// bubble     compute x b / (1 - b) with b = (p-1)/(v·m+p-1); where ranks
//            share a CPU's cores, the schedule walked under the sharing
//            (Note [Shared cores]).
// traffic    bytes per collective per step, each timed as a ring:
//            all-reduce 2(n-1)/n·bytes/bandwidth + 2(n-1)·latency, all-gather
//            and reduce-scatter half of that. Tensor parallel: 4 all-reduces
//            of a micro-batch's b·s·h activations per layer (2 forward, 2
//            backward; sequence parallel turns each into an all-gather plus a
//            reduce-scatter of the same volume), 2 more per layer under full
//            recompute, exposed. Data parallel: gradients all-reduced once
//            per step (ZeRO-1 the same volume); ZeRO-2 reduce-scatters each
//            micro-batch's gradients and all-gathers the updated parameters;
//            ZeRO-3 also all-gathers the parameters for every micro-batch's
//            forward and backward — hidden behind compute up to its length
//            (backward for gradients, the whole step for ZeRO-3 gathers; on
//            a CPU, whose cores compute, not at all),
//            the excess exposed. Pipeline: each micro-batch's activation and
//            gradient at every stage boundary. Expert parallel: per MoE
//            layer and micro-batch, all-to-alls of the layer's assignments
//            (tokens · top_k · hidden) to the experts' ranks and back,
//            forward and backward, exposed; expert gradients all-reduced
//            over dp x fsdp only (the ranks holding the same experts).
//            Context parallel: compute and every token count divided by cp;
//            the ring's fp32 key/value hops per layer hidden behind the
//            attention products up to their length, its gradient hops and
//            the all-to-all's exchanges exposed; cp ranks join the gradient
//            reduction as replicas. Every blocking collective of tp, ep, cp
//            and pp also costs the machine's `sync` (measured under load; it
//            is what a peer that shares a core keeps the others waiting).
//            Offload: gradients down and
//            parameters up over the host link, and the host-side optimizer
//            streaming its states.
// optimizer  with measured operators, AdamW's pass over the slowest rank's
//            parameters (its shard under ZeRO; offloaded, on the host above).
// A group stays inside a node when its ranks do (the mesh is pp x dp x fsdp
// x ep x cp x tp with tp innermost); otherwise it runs at the inter-node bandwidth.

struct Traffic {
  std::string group;   // "tp", "ep", "cp", "dp", "pp", "host"
  std::string what;    // "all-reduce activations", ...
  double bytes = 0;    // per rank per step
  double seconds = 0;  // before overlap
};

struct TimeBreakdown {
  double compute = 0;         // including recompute
  double recompute = 0;       // the part of compute that repeats forwards
  double bubble = 0;
  double tensor_parallel = 0;  // exposed communication, by group
  double data_parallel = 0;
  double pipeline = 0;
  double expert_parallel = 0;
  double context_parallel = 0;
  double offload = 0;
  double optimizer = 0;       // AdamW's pass over the rank's parameters, with measured operators (Note [Operator time])
  double tokens_per_second = 0;
  double mfu = 0;             // model FLOPs (no recompute) / (step x devices x peak)
  std::vector<Traffic> traffic;

  double step() const {
    return compute + bubble + tensor_parallel + data_parallel + pipeline + expert_parallel + context_parallel + offload +
           optimizer;
  }
};

// `microbatches` per data rank per step; `ranks` from estimate_memory() of
// the same layout (which pipeline rank holds how many layers and parameters).
TimeBreakdown estimate_time(const model::GptConfig& model, const Workload& workload, const Layout& layout,
                            const Machine& machine, int64_t microbatches, const std::vector<RankMemory>& ranks);

}  // namespace meshtrain::plan
