// Expert parallel: the experts of every mixture-of-experts layer split over the
// ranks of an `ep` communicator, tokens sent to their experts' ranks and back
// with all-to-all.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/placement/placement.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// The first of the E / ep consecutive experts rank `rank` of the ep group keeps.
inline int64_t first_expert(int64_t rank, int64_t experts, int64_t ep) { return rank * (experts / ep); }

// The busiest rank's load at degree `ep` (dividing the E experts), from the
// assignments capacity kept per expert out of `routed` tokens x top_k: ep x
// the largest share one rank's experts keep. 1 for a balanced router without
// drops; 0 where ep does not divide E or nothing was routed.
double busiest_rank_load(const std::vector<double>& kept, double routed, int64_t ep);

// The load the all-to-alls at degree `ep` wait for, from token sources: a
// stream of micro-batches (a rank's tokens, with its tensor and context
// parallel peers') in one forward, `kept[s]` per expert out of `routed[s]`,
// given forward by forward, `streams` to a forward. Ep streams exchange one
// micro-batch's tokens: streams [g·ep, (g+1)·ep) form group g in each
// forward, and the step waits for its slowest group, so the result is the
// largest over the groups of their mean over the forwards of each forward's
// busiest_rank_load. With fewer streams than ep (a small run planned for a
// large degree), or a count ep does not divide, consecutive sources form the
// groups across forwards and the result is their mean; sources past the last
// whole group are left out. Sources that routed nothing (a pipeline stage
// without the layer) are skipped. 0 where ep does not divide the experts or
// nothing was routed. Pooling every source first would hide a group whose
// tokens all went to one rank's experts behind another's that went elsewhere.
double grouped_rank_load(const std::vector<std::vector<double>>& kept, const std::vector<double>& routed, int64_t ep,
                         int64_t streams);

// Note [Expert parallel]
// Rank r of the ep group keeps experts [r·E/ep, (r+1)·E/ep) of every MoE layer
// (the expert tensors sliced along dim 0: Shard(0) over "ep"); the router and
// everything else stay whole. In a layer's forward each rank routes its own
// tokens, then: (1) the token counts per expert go to the experts' ranks (an
// all-to-all of [ep, E/ep] counts), (2) the tokens follow (all-to-all with
// those uneven splits: dropless needs no padding), (3) each rank regroups what
// it received by local expert, computes, and undoes the regrouping, (4) the
// outputs go back with the reverse all-to-all. Backward runs the two
// all-to-alls the other way. A rank whose experts get no tokens still joins
// every all-to-all, and its experts get zero gradients.
// Gradients: an expert's gradient sums the contributions of the tokens of
// every rank in its ep group, each already divided by its rank's token count,
// so the data-parallel average over dp x fsdp x ep must count it once per ep
// group: expert gradients are averaged over dp x fsdp only and divided by ep
// (DataParallelOptions::expert_*). The gradient norm sums expert parts over ep.
class ExpertParallel {
 public:
  // Collective over `ep`: keeps this rank's experts and installs the exchange.
  ExpertParallel(model::Gpt& model, std::shared_ptr<comm::Communicator> ep);

  // Shard(0) over ep for an expert tensor (model::is_expert_tensor), else Replicate.
  placement::Placement placement_of(const std::string& name) const;
  const std::shared_ptr<comm::Communicator>& comm() const { return comm_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }
  // `local` with every expert tensor gathered whole along dim 0. Collective over comm().
  std::map<std::string, at::Tensor> gather_all(std::map<std::string, at::Tensor> local) const;

 private:
  std::shared_ptr<comm::Communicator> comm_;
  int64_t experts_per_rank_ = 0;
};

}  // namespace meshtrain::parallel
