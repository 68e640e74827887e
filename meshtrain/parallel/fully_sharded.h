// FullySharded: ZeRO stages 1, 2 and 3 (fully sharded data parallel) for any
// torch::nn::Module, with hybrid sharding on a 2-D mesh and mixed precision.
// See Note [Fully sharded]; the pieces live in parallel/fsdp/.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/offload/tier.h"
#include "meshtrain/parallel/adamw.h"
#include "meshtrain/parallel/data_parallelism.h"

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// Which submodules are units, each with one flat parameter; the parameters
// of no unit form the root unit. A unit's submodules are part of it.
struct UnitPolicy {
  std::function<bool(const std::string& name, const torch::nn::Module& module)> is_unit;

  static UnitPolicy whole_model();                                   // one unit
  static UnitPolicy submodules(std::vector<std::string> names);      // these, by dotted name
  static UnitPolicy blocks(const std::string& list = "blocks");      // every child of a ModuleList ("blocks.N")
};

struct FullyShardedOptions {
  int stage = 3;  // 1: optimizer states sharded; 2: + gradients; 3: + parameters
  UnitPolicy units = UnitPolicy::blocks();
  bool prefetch = true;               // stage 3: gather the next unit while this one computes
  bool reshard_after_forward = true;  // stage 3: free a unit's parameters after its forward
  at::ScalarType param_dtype = at::kFloat;   // what forward/backward compute in
  at::ScalarType reduce_dtype = at::kFloat;  // what gradients are reduced in
  // Stage 1 reduces full gradients by all-reduce (then each rank reads its
  // shard) by default; true reduce-scatters into a separate shard buffer.
  bool stage1_reduce_scatter = false;
  AdamWSettings adamw;
  // With tensor parallel (ShardingGroups::tensor): which parameters, by name,
  // are split over it. Their gradient norms add up over the group; the other
  // parameters are copies there and count once.
  std::function<bool(const std::string&)> split_over_tensor;
  // With pipeline stages (ShardingGroups::pipeline): parameters placed in a
  // unit of their own (a tied embedding on the first and last stage: both
  // shard it alike, so their shard gradients can be summed), and those whose
  // norm another stage counts.
  std::function<bool(const std::string&)> own_unit;
  std::function<bool(const std::string&)> counted_elsewhere;
  // With expert parallel (ShardingGroups::expert_*): expert tensors, each in
  // a unit of its own, sharded over `shard` like the rest but replicated over
  // expert_replicate only, their gradients multiplied by expert_scale before
  // the average (ep ranks hold different experts). Stage 3 gathers and frees
  // them with the unit holding their module (their block).
  std::function<bool(const std::string&)> expert;
  double expert_scale = 1.0;
  // ZeRO-Offload / ZeRO-Infinity (Note [Offloaded optimizer]): the fp32
  // masters and AdamW moments in host memory or an NVMe file, the step on
  // the CPU; at stage 3 the parameter shards too (params needs optimizer).
  offload::Tier offload_optimizer = offload::Tier::kDevice;
  offload::Tier offload_params = offload::Tier::kDevice;
  std::string nvme_dir = "/tmp";
};

// Communicators of a sharded layout. `shard` (the fsdp axis) holds one shard
// each; `replicate` (the dp axis) holds copies of the same shard; `all` is both
// (the data-parallel group). Without hybrid sharding `replicate` has one rank.
// `tensor` (optional) is the tensor-parallel group the model is split over:
// each of its ranks shards a different part of the model.
// `pipeline` (optional) joins the ranks holding the other stages of the model
// (gradient norms add up over it). Stages 1 and 2 only: the model may then
// hold only some blocks, or no embedding or head.
struct ShardingGroups {
  std::shared_ptr<comm::Communicator> shard, replicate, all;
  std::shared_ptr<comm::Communicator> tensor;
  std::shared_ptr<comm::Communicator> pipeline;
  // Expert parallel: the ranks holding copies of this rank's experts
  // (expert_all = shard x expert_replicate), and the ep group holding the others.
  std::shared_ptr<comm::Communicator> expert_replicate, expert_all, expert;
};

struct ShardedState;  // parallel/fsdp/sharded_state.h

// Note [Fully sharded]
// Parameters are grouped into units; each unit has one flat buffer, padded to
// a multiple of the shard count N, and rank r owns elements [r·S, (r+1)·S),
// S = padded / N. Module parameters become views of the unit's `full` buffer.
// - Optimizer: AdamW over this rank's slices, in fp32 ("master" shards); the
//   optimizer state is 8 bytes per owned element. Weight decay follows the
//   parameter each slice came from. (fsdp/sharded_adamw.cpp)
// - Stage 1: full parameters and full gradients stay (gradients are views of a
//   flat per-unit buffer, as in data parallel); on the step's last backward each
//   unit is all-reduced as soon as its gradients are ready; each rank updates
//   its slice and the parameters are all-gathered in place.
// - Stage 2: gradients are reduce-scattered unit by unit from the gradient-ready
//   hooks during every backward (copied into a transient buffer, the autograd
//   gradient dropped at once) and summed into a persistent fp32 shard.
//   (fsdp/reducer.cpp)
// - Stage 3: as stage 2, and `full` is only allocated while a unit is in use:
//   gathered before its forward, freed after it (with reshard_after_forward),
//   gathered again before its backward, freed once its gradients are reduced.
//   The next unit's gather is issued before this one computes (prefetch).
//   Freeing swaps the storage's data pointer, so the parameter views and
//   autograd's saved tensors stay valid across a re-gather.
//   (fsdp/residency.cpp) What says "before its forward" (fsdp/triggers.cpp):
//   a model with named call sites (model::Gpt, Note [Forward hooks]) gets
//   hooks around each unit and the gradient of its output; any other module is
//   observed op by op (a RecordFunction callback sees every operator's inputs
//   and gathers the unit whose parameter storage one of them is), and the
//   order units are used in during the first step is the prefetch order.
//   The root unit stays gathered from its first use to its reduction.
// - Hybrid: shards over `shard`; the reduced shard gradients are then averaged
//   over `replicate`.
// - Mixed precision: `full` (and so the computation and the gradients) is in
//   param_dtype; master shards, optimizer states and the shard gradients are
//   fp32; reductions run in reduce_dtype.
// - Gathers and reductions run on two communicators (split from `shard`), so
//   neither waits behind the other and each keeps the same order on every rank.
// Call after_backward() after every backward, then step().
class FullySharded : public DataParallelism {
 public:
  // Collective over groups.all: rank 0's parameters are the starting point.
  // `module` stays alive as long as this object (it is shared).
  FullySharded(std::shared_ptr<torch::nn::Module> module, ShardingGroups groups, FullyShardedOptions options);
  ~FullySharded() override;
  FullySharded(const FullySharded&) = delete;
  FullySharded& operator=(const FullySharded&) = delete;

  // Stage 1: whether the coming backward ends the step (reduce) or accumulates.
  // Stages 2 and 3 reduce after every backward and ignore it.
  void set_sync(bool sync) override;
  // After every backward: completes this backward's reductions.
  void after_backward() override;
  void zero_grad() override;
  // The reduced shard gradient of parameter `name`, which has a unit of its
  // own (FullyShardedOptions::own_unit), after the step's last after_backward().
  at::Tensor reduced_gradient(const std::string& name) override;
  // Global gradient norm over all shards, and clipping to `max_norm` (<= 0: none).
  double clip_grad_norm(double max_norm) override;
  // AdamW on this rank's shards, then (stages 1, 2) the parameters all-gathered.
  void step(double lr) override;
  // Master slices and their AdamW moments, each with the flat range of its
  // parameter it holds; each slice is saved by one replica (bytes balanced).
  placement::TrainingState state(const ParameterLayouts& layouts = whole_parameter) override;
  placement::TrainingState frozen_state(const ParameterLayouts& layouts = whole_parameter) override;
  void after_load(int64_t optimizer_steps) override;
  // Every parameter, unsharded, in fp32, by name, on `root` of groups.all
  // (empty elsewhere; root -1: on every rank). Collective.
  std::map<std::string, at::Tensor> full_parameters(int root = 0) override;
  std::string describe() const override;

  // Loads a full state dict given on `root` of groups.all (ignored elsewhere);
  // optimizer states are left as they are. Collective.
  void load_full_state_dict(const std::map<std::string, at::Tensor>& state, int root = 0);

  int stage() const;
  int64_t unit_count() const;
  // Elements of the largest gather (a unit with the expert units gathered
  // with it, padded), and the total this rank owns.
  int64_t largest_unit_numel() const;
  int64_t shard_numel() const;
  int64_t padded_numel() const;  // sum over units of the padded size
  int64_t gathered_numel() const;  // elements of the units whose full parameters exist now (gathered or gathering)
  // Seconds spent waiting for gathers/reductions that were not hidden behind
  // computation, since construction.
  double exposed_gather_seconds() const;
  double exposed_reduce_seconds() const;

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ShardedState> state_;
};

}  // namespace meshtrain::parallel
