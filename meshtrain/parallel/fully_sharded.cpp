#include "meshtrain/parallel/fully_sharded.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include <sstream>

namespace meshtrain::parallel {

FullySharded::FullySharded(std::shared_ptr<torch::nn::Module> module, ShardingGroups groups,
                           FullyShardedOptions options)
    : state_(std::make_shared<ShardedState>()) {
  ShardedState& s = *state_;
  if (!module) throw std::invalid_argument("fully sharded: no module");
  if (!groups.shard || !groups.replicate || !groups.all) throw std::invalid_argument("fully sharded: missing communicator");
  if (options.expert && (!groups.expert_replicate || !groups.expert_all || !groups.expert)) {
    throw std::invalid_argument("fully sharded: expert tensors need the expert groups");
  }
  if (groups.all->size() != groups.shard->size() * groups.replicate->size()) {
    throw std::invalid_argument("fully sharded: the data-parallel group has " + std::to_string(groups.all->size()) +
                                " ranks, not shard (" + std::to_string(groups.shard->size()) + ") x replicate (" +
                                std::to_string(groups.replicate->size()) + ")");
  }
  if (options.stage < 1 || options.stage > 3) {
    throw std::invalid_argument("fully sharded: stage must be 1, 2 or 3, not " + std::to_string(options.stage));
  }
  for (at::ScalarType type : {options.param_dtype, options.reduce_dtype}) {
    if (!at::isFloatingType(type)) throw std::invalid_argument("fully sharded: dtypes must be floating point");
  }
  s.options = std::move(options);
  s.groups = groups;
  s.shards = groups.shard->size();
  s.shard_rank = groups.shard->rank();
  s.gather_comm = groups.shard->split(0, s.shard_rank, groups.shard->name() + ":gather");
  s.reduce_comm = groups.shard->split(0, s.shard_rank, groups.shard->name() + ":reduce");
  module_ = module;
  {
    // Same starting point everywhere: rank 0's parameters and buffers.
    torch::NoGradGuard no_grad;
    std::vector<comm::Work> broadcasts;
    for (const auto& p : module->named_parameters()) {
      // An expert's copies hold the same.
      broadcasts.push_back((s.is_expert(p.key()) ? groups.expert_all : groups.all)->broadcast(p.value().data(), 0));
    }
    for (const at::Tensor& b : module->buffers()) broadcasts.push_back(groups.all->broadcast(b, 0));
    comm::wait_all(broadcasts);
  }
  s.build_units(*module);
  s.install_gradient_hooks(state_);
  install_triggers(state_, module);
  s.build_optimizer();
}

FullySharded::~FullySharded() {
  // In-flight operations write into buffers the state owns: let them finish.
  try {
    remove_triggers(*state_, module_);
    for (auto& unit : state_->units) {
      unit.gather_work.wait();
      unit.reduce_work.wait();
    }
  } catch (...) {
  }
}

void FullySharded::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync = sync;
}

void FullySharded::after_backward() { state_->after_backward(); }

void FullySharded::zero_grad() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->end_step_locked();
  for (auto& unit : state_->units) {
    if (unit.grad.defined()) unit.grad.zero_();
    if (unit.shard_grad.defined()) unit.shard_grad.zero_();
  }
}

at::Tensor FullySharded::reduced_gradient(const std::string& name) {
  auto it = state_->unit_of_module.find("parameter " + name);
  if (it == state_->unit_of_module.end()) throw std::invalid_argument("fully sharded: " + name + " has no unit of its own");
  return state_->units[it->second].shard_grad;
}

double FullySharded::clip_grad_norm(double max_norm) { return state_->clip_grad_norm(max_norm); }

void FullySharded::step(double lr) { state_->step(lr); }

placement::TrainingState FullySharded::state(const ParameterLayouts& layouts) {
  ShardedState& s = *state_;
  placement::TrainingState out;
  // The replicas (dp) hold the same slices: each is saved by one of them, the bytes spread evenly.
  // (An expert's slices: among the replicas of that expert.)
  std::vector<int64_t> sizes, expert_sizes;
  for (const ShardedState::Slice& slice : s.slices) {
    (s.units[slice.unit].expert ? expert_sizes : sizes).push_back(slice.end - slice.begin);
  }
  const std::vector<int> owners = placement::balanced_owners(sizes, s.groups.replicate->size());
  const std::vector<int> expert_owners =
      s.groups.expert_replicate ? placement::balanced_owners(expert_sizes, s.groups.expert_replicate->size())
                                : std::vector<int>();
  size_t next = 0, next_expert = 0;
  std::map<size_t, OffloadedAdamW::Views> offloaded;  // by unit: host tensors (Note [Offloaded optimizer])
  for (size_t i = 0; i < s.slices.size(); ++i) {
    const ShardedState::Slice& slice = s.slices[i];
    const Unit& unit = s.units[slice.unit];
    const bool owned = unit.expert ? expert_owners[next_expert++] == s.groups.expert_replicate->rank()
                                   : owners[next++] == s.groups.replicate->rank();
    const std::string& name = unit.names[slice.param];
    ParameterLayout layout = layouts(name, unit.params[slice.param]);
    layout.spec.flat_begin = slice.begin;
    layout.spec.flat_end = slice.end;
    const bool write = layout.write && owned;
    if (s.offloaded) {
      if (!offloaded.count(slice.unit)) offloaded[slice.unit] = s.offloaded->views(slice.unit);
      const OffloadedAdamW::Views& v = offloaded[slice.unit];
      const int64_t at = unit.offsets[slice.param] + slice.begin - s.shard_rank * unit.shard, n = slice.end - slice.begin;
      out.push_back({"model/" + name, layout.spec, v.master.narrow(0, at, n), write});
      out.push_back({"optim/" + name + "/exp_avg", layout.spec, v.exp_avg.narrow(0, at, n), write});
      out.push_back({"optim/" + name + "/exp_avg_sq", layout.spec, v.exp_avg_sq.narrow(0, at, n), write});
      continue;
    }
    out.push_back({"model/" + name, layout.spec, slice.tensor, write});
    torch::optim::AdamWParamState& adam = adamw_state(*s.optimizer, slice.tensor);
    out.push_back({"optim/" + name + "/exp_avg", layout.spec, adam.exp_avg(), write});
    out.push_back({"optim/" + name + "/exp_avg_sq", layout.spec, adam.exp_avg_sq(), write});
  }
  return out;
}

placement::TrainingState FullySharded::frozen_state(const ParameterLayouts& layouts) {
  ShardedState& s = *state_;
  placement::TrainingState out;
  for (const ShardedState::Slice& slice : s.frozen_slices) {
    const Unit& unit = s.units[slice.unit];
    const std::string& name = unit.names[slice.param];
    ParameterLayout layout = layouts(name, unit.params[slice.param]);
    layout.spec.flat_begin = slice.begin;
    layout.spec.flat_end = slice.end;
    out.push_back({"model/" + name, layout.spec, slice.tensor, layout.write});
  }
  return out;
}

void FullySharded::after_load(int64_t optimizer_steps) {
  if (state_->offloaded) {
    state_->offloaded->set_steps(optimizer_steps);
    state_->offloaded->after_load();
  } else {
    set_adamw_steps(*state_->optimizer, optimizer_steps);
  }
  if (state_->stage3()) return;
  std::lock_guard<std::mutex> lock(state_->mutex);
  torch::NoGradGuard no_grad;
  state_->regather_all_locked(/*frozen_too=*/true);
}

std::map<std::string, at::Tensor> FullySharded::full_parameters(int root) {
  ShardedState& s = *state_;
  std::map<std::string, at::Tensor> out;
  const bool keep = root < 0 || s.groups.all->rank() == root;
  for (size_t u = 0; u < s.units.size(); ++u) {
    const Unit& unit = s.units[u];
    const at::Tensor master = s.master_values(u);  // fp32, or a frozen unit's own dtype
    at::Tensor flat = at::empty({unit.padded}, unit.full.options().dtype(master.scalar_type()));
    s.gather_comm->all_gather(flat, master).wait();
    flat = flat.to(at::kFloat);
    if (!keep) continue;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      out[unit.names[i]] = flat.narrow(0, unit.offsets[i], unit.params[i].numel()).view(unit.params[i].sizes()).clone();  // fp32
    }
  }
  return out;
}

void FullySharded::load_full_state_dict(const std::map<std::string, at::Tensor>& state, int root) {
  ShardedState& s = *state_;
  comm::on_root_or_all_fail(*s.groups.all, root, [&] {
    for (auto& unit : s.units) {
      for (size_t i = 0; i < unit.params.size(); ++i) {
        auto it = state.find(unit.names[i]);
        if (it == state.end()) throw std::invalid_argument("state dict has no parameter '" + unit.names[i] + "'");
        if (it->second.sizes() != unit.params[i].sizes()) {
          std::ostringstream text;
          text << "state dict parameter '" << unit.names[i] << "' has shape " << it->second.sizes() << ", the model "
               << unit.params[i].sizes();
          throw std::invalid_argument(text.str());
        }
      }
    }
  });
  torch::NoGradGuard no_grad;
  ObserverPause pause;  // this writes into the flat buffers itself
  std::lock_guard<std::mutex> lock(s.mutex);
  for (size_t u = 0; u < s.units.size(); ++u) {
    Unit& unit = s.units[u];
    at::Tensor flat = at::zeros({unit.padded}, unit.full.options().dtype(at::kFloat));
    if (s.groups.all->rank() == root) {
      for (size_t i = 0; i < unit.params.size(); ++i) {
        flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(state.at(unit.names[i]).reshape({-1}));
      }
    }
    s.groups.all->broadcast(flat, root).wait();
    s.set_master_values(u, flat.narrow(0, s.shard_rank * unit.shard, unit.shard));
    if (unit.residency != Residency::kFreed) {  // stages 1 and 2, or a stage-3 unit in use
      s.wait_gathered_locked(unit);
      unit.full.copy_(flat);
    }
  }
}

std::string FullySharded::describe() const {
  const ShardedState& s = *state_;
  std::string offload;
  if (s.offloaded) {
    offload = ", optimizer offloaded to " + std::string(offload::tier_name(s.options.offload_optimizer));
    if (s.options.offload_params != offload::Tier::kDevice) {
      offload += ", parameters to " + std::string(offload::tier_name(s.options.offload_params));
    }
  }
  int64_t frozen = 0;
  for (const Unit& unit : s.units) frozen += unit.frozen ? 1 : 0;
  return "ZeRO stage " + std::to_string(s.options.stage) + " over dp(" + std::to_string(s.groups.replicate->size()) +
         ") x fsdp(" + std::to_string(s.shards) + "), " + std::to_string(s.units.size()) + " units" +
         (frozen ? " (" + std::to_string(frozen) + " frozen)" : "") + ", " +
         comm::dtype_name(s.options.param_dtype) + " compute, " + comm::dtype_name(s.options.reduce_dtype) +
         " reductions" + offload;
}

int FullySharded::stage() const { return state_->options.stage; }
int64_t FullySharded::unit_count() const { return static_cast<int64_t>(state_->units.size()); }

int64_t FullySharded::largest_unit_numel() const {
  int64_t largest = 0;
  for (const auto& unit : state_->units) {
    int64_t numel = unit.padded;
    for (size_t c : unit.companions) numel += state_->units[c].padded;
    largest = std::max(largest, numel);
  }
  return largest;
}

int64_t FullySharded::gathered_numel() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  int64_t total = 0;
  for (const auto& unit : state_->units) total += unit.residency == Residency::kFreed ? 0 : unit.padded;
  return total;
}

int64_t FullySharded::shard_numel() const {
  int64_t total = 0;
  for (const auto& unit : state_->units) total += unit.shard;
  return total;
}

int64_t FullySharded::padded_numel() const {
  int64_t total = 0;
  for (const auto& unit : state_->units) total += unit.padded;
  return total;
}

double FullySharded::exposed_gather_seconds() const { return state_->exposed_gather; }
double FullySharded::exposed_reduce_seconds() const { return state_->exposed_reduce; }

}  // namespace meshtrain::parallel
