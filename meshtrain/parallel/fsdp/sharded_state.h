// The state of one FullySharded, shared by its parts: units and their flat
// buffers (units.cpp), residency of the full parameters (residency.cpp), what
// triggers a gather (triggers.cpp), gradient reduction (reducer.cpp) and the
// optimizer over shards (sharded_adamw.cpp). See Note [Fully sharded].
#pragma once

#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/fsdp/offloaded_adamw.h"
#include "meshtrain/parallel/fully_sharded.h"

#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace meshtrain::parallel {

enum class Residency { kFreed, kGathering, kGathered };

struct Unit {
  std::string module;  // "" for the root unit, "parameter NAME" for a unit of one parameter
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0, padded = 0, shard = 0;
  at::Tensor full;          // [padded] param_dtype; the parameters are views of it
  at::Tensor master;        // [shard] fp32, this rank's elements
  at::Tensor grad;          // stage 1: [padded] flat gradient (the .grad views)
  at::Tensor shard_grad;    // [shard] fp32
  at::Tensor gather_input;  // a cast of `master` while a gather reads it
  at::Tensor reduce_in, reduce_out;  // while a reduction runs
  comm::Work gather_work, reduce_work;
  Residency residency = Residency::kGathered;
  int64_t ready = 0;  // parameters whose gradient arrived in this backward
  bool expert = false;  // an expert tensor's unit (FullyShardedOptions::expert)
  // Parameters that take no gradient (LoRA's base, Note [LoRA]): never
  // reduced, no gradient buffers, no optimizer state; gathered (stage 3) as
  // any unit. A module's frozen parameters are a unit of their own, a
  // companion of the unit of its trainable ones.
  bool frozen = false;
  // Stage 3: an expert tensor's unit is gathered and freed with the unit
  // holding its module (its host), which lists it among its companions.
  size_t host = SIZE_MAX;
  std::vector<size_t> companions;
};

// A stretch of this rank's shard (unit, offset, length) belonging to one
// parameter, for the gradient norm.
struct Stretch {
  size_t unit;
  int64_t offset, length;
  bool split;  // over groups.tensor
};

// The mutex protects everything below it; autograd may call the hooks from
// its own threads (GPU).
struct ShardedState {
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  FullyShardedOptions options;
  ShardingGroups groups;
  std::shared_ptr<comm::Communicator> gather_comm, reduce_comm;
  int shards = 1, shard_rank = 0;
  std::vector<Unit> units;  // forward order: the root unit first
  std::map<std::string, size_t> unit_of_module;
  // What gathers units (stage 3): forward hooks around a model's call sites,
  // or the operator observer (triggers.cpp).
  std::shared_ptr<model::ForwardHooks> hooks;
  bool observed = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keep the gradient hooks alive
  std::unique_ptr<torch::optim::AdamW> optimizer;  // or, offloaded:
  std::unique_ptr<OffloadedAdamW> offloaded;
  // This rank's slice of a parameter: elements [begin, end) of unit.params[param],
  // and the tensor AdamW updates for it (an alias into the unit's master).
  struct Slice {
    size_t unit, param;
    int64_t begin, end;
    at::Tensor tensor;
  };
  std::vector<Slice> slices;
  std::vector<Slice> frozen_slices;  // of frozen units (their master slices only)
  std::vector<Stretch> tensor_split;       // stretches of parameters split over groups.tensor
  std::vector<Stretch> counted_elsewhere;  // parameters another pipeline stage counts

  std::mutex mutex;
  bool sync = true;
  std::vector<size_t> reduce_order;  // the order backward finishes units in
  size_t next_reduce = 0;
  static constexpr size_t kMaxInFlight = 2;
  std::deque<Unit*> in_flight;  // stages 2, 3: issued reductions not yet folded into shard_grad
  // Operator-observed units (stage 3 of a module without hooks): the unit in
  // use, and the order units were first used in during the first step.
  size_t current_unit = SIZE_MAX;
  std::vector<size_t> use_order;
  size_t use_cursor = 0;
  bool use_order_known = false;
  double exposed_gather = 0, exposed_reduce = 0;

  bool stage3() const { return options.stage == 3; }
  bool is_expert(const std::string& name) const { return options.expert && options.expert(name); }
  // Where a unit's gradients are averaged: all data ranks, or an expert's copies.
  const std::shared_ptr<comm::Communicator>& all_of(const Unit& unit) const {
    return unit.expert ? groups.expert_all : groups.all;
  }
  const std::shared_ptr<comm::Communicator>& replicate_of(const Unit& unit) const {
    return unit.expert ? groups.expert_replicate : groups.replicate;
  }

  // units.cpp: groups `module`'s parameters into units with flat buffers.
  void build_units(torch::nn::Module& module);
  void split_frozen();  // frozen parameters into units of their own
  void attach_companions();  // stage 3: each expert unit to its host
  void build_reduce_order();
  // The unit gathered after (before) unit u in forward order, companions
  // skipped (they come with their host); SIZE_MAX if none.
  size_t next_host(size_t u) const;
  size_t previous_host(size_t u) const;
  // residency.cpp
  void gather_locked(Unit& unit);
  void wait_gathered_locked(Unit& unit);
  void regather_all_locked(bool frozen_too = false);  // stages 1, 2: every `full` from the masters
  // `frozen_too` false: a host's frozen companions stay (its backward may
  // still need them after its gradients are reduced; before_backward frees them).
  void reshard_locked(Unit& unit, bool frozen_too = true);
  void before_forward(size_t u);
  void after_forward(size_t u, bool backward_follows);
  void before_backward(size_t u);
  void on_use(size_t u);  // an operator of unit u is about to run (observed units)
  void end_step_locked();  // stage 3: free what is still gathered; the next step starts over
  // reducer.cpp
  void install_gradient_hooks(const std::shared_ptr<ShardedState>& self);
  void mark_ready(size_t u);
  void issue_reduce_locked(Unit& unit);
  void fold_locked(size_t keep);
  void after_backward();
  // sharded_adamw.cpp
  void build_optimizer();
  // What gathering unit u reads: its fp32 master (or a cast), or with an
  // offloaded optimizer the parameter shard (Note [Offloaded optimizer]).
  at::Tensor gather_input(size_t u);
  // Unit u's fp32 master shard, on the device, and setting it.
  at::Tensor master_values(size_t u);
  void set_master_values(size_t u, const at::Tensor& values);
  double clip_grad_norm(double max_norm);
  void step(double lr);
};

// While one exists on a thread, the operator observer ignores that thread's
// operators: fully sharded's own work on the flat buffers (a gather copying
// into one, a load) must not trigger gathers, nor wait for the state's mutex.
class ObserverPause {
 public:
  ObserverPause();
  ~ObserverPause();
  ObserverPause(const ObserverPause&) = delete;
  ObserverPause& operator=(const ObserverPause&) = delete;

 private:
  bool was_;
};
bool& observer_paused();  // this thread's flag

// triggers.cpp: installs what gathers stage-3 units before they are used.
void install_triggers(const std::shared_ptr<ShardedState>& state, const std::shared_ptr<torch::nn::Module>& module);
void remove_triggers(ShardedState& state, const std::shared_ptr<torch::nn::Module>& module);

}  // namespace meshtrain::parallel
