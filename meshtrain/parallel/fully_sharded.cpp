#include "meshtrain/parallel/fully_sharded.h"

#include "meshtrain/comm/agree.h"

#include <c10/core/StorageImpl.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <deque>
#include <cmath>
#include <mutex>
#include <sstream>

namespace meshtrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Storage swaps (Note [Fully sharded]): every view of `flat` keeps pointing at
// the same StorageImpl, whose data pointer comes and goes.
void free_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, flat.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(flat.numel()) * flat.element_size();
  if (storage->nbytes() >= bytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

// A 1-D tensor over elements [offset, offset + length) of `flat`'s storage that
// is not an autograd view (the optimizer treats it as a parameter of its own).
at::Tensor alias(const at::Tensor& flat, int64_t offset, int64_t length) {
  torch::NoGradGuard no_grad;
  at::Tensor out = at::empty({0}, flat.options());
  out.set_(flat.storage(), flat.storage_offset() + offset, {length}, {1});
  return out;
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return c10::toString(type);
  }
}

}  // namespace

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("unknown dtype '" + name + "' (float32, bfloat16 or float16)");
}

struct FullySharded::State {
  enum class Residency { kFreed, kGathering, kGathered };

  struct Unit {
    std::string module;  // "" for the root unit
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
    int64_t ready = 0;
  };

  FullyShardedOptions options;
  model::Gpt model{nullptr};
  std::shared_ptr<model::ForwardHooks> hooks;  // stage 3
  // Stretches of this rank's shard (unit, offset, length) that belong to
  // parameters split over groups.tensor.
  struct Stretch {
    size_t unit;
    int64_t offset, length;
    bool split;  // over groups.tensor
  };
  std::vector<Stretch> tensor_split;
  std::vector<Stretch> counted_elsewhere;  // parameters another pipeline stage counts
  ShardingGroups groups;
  std::shared_ptr<comm::Communicator> gather_comm, reduce_comm;
  int shards = 1, shard_rank = 0;
  std::vector<Unit> units;  // forward order: the root unit first
  std::map<std::string, size_t> unit_of_module;
  std::vector<size_t> reduce_order;  // the order backward finishes units in
  size_t next_reduce = 0;
  static constexpr size_t kMaxInFlight = 2;
  std::deque<Unit*> in_flight;  // stages 2, 3: issued reductions not yet folded into shard_grad
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keep the hooks alive
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::mutex mutex;  // autograd may call the hooks from its own threads (GPU)
  bool sync = true;
  double exposed_gather = 0, exposed_reduce = 0;

  bool stage3() const { return options.stage == 3; }

  // -- parameters ----------------------------------------------------------

  void gather_locked(Unit& unit) {
    if (unit.residency != Residency::kFreed) return;
    allocate_storage(unit.full);
    at::Tensor input = unit.master;
    if (options.param_dtype != at::kFloat) input = unit.gather_input = unit.master.to(options.param_dtype);
    unit.gather_work = gather_comm->all_gather(unit.full, input);
    unit.residency = Residency::kGathering;
  }

  void wait_gathered_locked(Unit& unit) {
    gather_locked(unit);
    if (unit.residency != Residency::kGathering) return;
    const auto start = Clock::now();
    unit.gather_work.wait();
    exposed_gather += seconds_since(start);
    unit.gather_work = comm::Work();
    unit.gather_input = at::Tensor();
    unit.residency = Residency::kGathered;
  }

  // Stages 1 and 2: every unit's `full` from the (updated) master slices.
  void regather_all_locked() {
    for (Unit& unit : units) {
      unit.residency = Residency::kFreed;  // its storage stays (only stage 3 frees): gather_locked reuses it
      gather_locked(unit);
    }
    for (Unit& unit : units) wait_gathered_locked(unit);
  }

  void reshard_locked(Unit& unit) {
    if (!stage3() || unit.residency == Residency::kFreed) return;
    if (unit.residency == Residency::kGathering) unit.gather_work.wait();
    unit.gather_work = comm::Work();
    unit.gather_input = at::Tensor();
    free_storage(unit.full);
    unit.residency = Residency::kFreed;
  }

  // Stage-3 forward hooks.
  void before_forward(const std::string& module) {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t u = unit_of_module.at(module);
    wait_gathered_locked(units[u]);
    if (options.prefetch && u + 1 < units.size()) gather_locked(units[u + 1]);
  }

  void after_forward(const std::string& module, bool backward_follows) {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t u = unit_of_module.at(module);
    if (u == 0) {
      if (!backward_follows) reshard_locked(units[0]);  // evaluation: nothing more to do
      return;
    }
    if (options.reshard_after_forward || !backward_follows) reshard_locked(units[u]);
  }

  void before_backward(size_t u) {
    std::lock_guard<std::mutex> lock(mutex);
    wait_gathered_locked(units[u]);
    if (options.prefetch && u > 1) gather_locked(units[u - 1]);  // unit 0 (root) is still gathered
  }

  // -- gradients -----------------------------------------------------------

  void mark_ready(size_t u) {
    std::lock_guard<std::mutex> lock(mutex);
    if (options.stage == 1 && !sync) return;
    ++units[u].ready;
    while (next_reduce < reduce_order.size()) {
      Unit& unit = units[reduce_order[next_reduce]];
      if (unit.ready < static_cast<int64_t>(unit.params.size())) break;
      issue_reduce_locked(unit);
      ++next_reduce;
    }
  }

  void issue_reduce_locked(Unit& unit) {
    const at::ScalarType reduce_dtype = options.reduce_dtype;
    if (options.stage == 1) {
      at::Tensor input = unit.grad;
      if (reduce_dtype != unit.grad.scalar_type()) input = unit.reduce_in = unit.grad.to(reduce_dtype);
      if (options.stage1_reduce_scatter) {
        unit.reduce_out = at::empty({unit.shard}, input.options());
        unit.reduce_work = reduce_comm->reduce_scatter(unit.reduce_out, input, comm::ReduceOp::kAvg);
      } else {
        unit.reduce_work = groups.all->all_reduce(input, comm::ReduceOp::kAvg);
      }
      return;
    }
    // Stages 2 and 3: flatten this backward's gradients and drop autograd's copies.
    unit.reduce_in = at::zeros({unit.padded}, unit.full.options().dtype(reduce_dtype));
    for (size_t i = 0; i < unit.params.size(); ++i) {
      at::Tensor& grad = unit.params[i].mutable_grad();
      if (!grad.defined()) continue;
      unit.reduce_in.narrow(0, unit.offsets[i], grad.numel()).copy_(grad.reshape({-1}));
      grad.reset();
    }
    unit.reduce_out = at::empty({unit.shard}, unit.reduce_in.options());
    unit.reduce_work = reduce_comm->reduce_scatter(unit.reduce_out, unit.reduce_in, comm::ReduceOp::kAvg);
    reshard_locked(unit);  // stage 3: its backward is over
    in_flight.push_back(&unit);
    // At most kMaxInFlight flat gradients exist at once; backward waits for the oldest beyond that.
    fold_locked(kMaxInFlight);
  }

  // Stages 2 and 3: folds finished reductions (and, beyond `keep` in flight,
  // the oldest ones, waiting) into the shard gradients, freeing their buffers.
  void fold_locked(size_t keep) {
    const auto start = Clock::now();
    while (!in_flight.empty() && (in_flight.size() > keep || in_flight.front()->reduce_work.completed())) {
      Unit& unit = *in_flight.front();
      in_flight.pop_front();
      unit.reduce_work.wait();
      if (groups.replicate->size() > 1) groups.replicate->all_reduce(unit.reduce_out, comm::ReduceOp::kAvg).wait();
      unit.shard_grad.add_(unit.reduce_out);
      unit.reduce_in = unit.reduce_out = at::Tensor();
      unit.reduce_work = comm::Work();
    }
    exposed_reduce += seconds_since(start);
  }

  void after_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    if (options.stage == 1 && !sync) return;
    // Units with a parameter that got no gradient are reduced now, in order.
    for (; next_reduce < reduce_order.size(); ++next_reduce) issue_reduce_locked(units[reduce_order[next_reduce]]);
    if (options.stage == 1) {
      const auto start = Clock::now();
      const bool hybrid = groups.replicate->size() > 1;
      std::vector<comm::Work> replicas;
      for (size_t u : reduce_order) {
        units[u].reduce_work.wait();
        if (hybrid && options.stage1_reduce_scatter) {
          replicas.push_back(groups.replicate->all_reduce(units[u].reduce_out, comm::ReduceOp::kAvg));
        }
      }
      comm::wait_all(replicas);
      for (Unit& unit : units) {
        if (options.stage1_reduce_scatter) {
          unit.shard_grad.copy_(unit.reduce_out);
        } else {
          if (unit.reduce_in.defined()) unit.grad.copy_(unit.reduce_in);
          if (!is_alias_of_grad(unit)) unit.shard_grad.copy_(unit.grad.narrow(0, shard_rank * unit.shard, unit.shard));
        }
        unit.reduce_in = unit.reduce_out = at::Tensor();
        unit.reduce_work = comm::Work();
      }
      exposed_reduce += seconds_since(start);
    } else {
      fold_locked(0);
    }
    for (Unit& unit : units) unit.ready = 0;
    next_reduce = 0;
  }

  bool is_alias_of_grad(const Unit& unit) const {
    return unit.grad.defined() && unit.shard_grad.is_alias_of(unit.grad);
  }
};

namespace {

class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::weak_ptr<FullySharded::State> state, size_t unit) : state_(std::move(state)), unit_(unit) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto state = state_.lock()) state->mark_ready(unit_);
    return outputs;
  }

 private:
  std::weak_ptr<FullySharded::State> state_;
  size_t unit_;
};

class UnitHooks : public model::ForwardHooks {
 public:
  explicit UnitHooks(std::weak_ptr<FullySharded::State> state) : state_(std::move(state)) {}

  // Gathers a unit before its forward and frees it after; the gradient of its
  // output gathers it again before its backward.
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    auto state = state_.lock();
    if (!state || !state->unit_of_module.count(module)) return forward(input);
    state->before_forward(module);
    return after(state, module, forward(input));
  }

 private:
  static at::Tensor after(const std::shared_ptr<FullySharded::State>& state, const std::string& module,
                          const at::Tensor& output) {
    const bool backward_follows = torch::GradMode::is_enabled() && output.requires_grad();
    state->after_forward(module, backward_follows);
    const size_t u = state->unit_of_module.at(module);
    if (backward_follows && u != 0) {
      // Runs when the gradient of the unit's output arrives: before the unit's backward.
      std::weak_ptr<FullySharded::State> weak = state;
      output.register_hook([weak, u](const at::Tensor& grad) {
        if (auto s = weak.lock()) s->before_backward(u);
        return grad;
      });
    }
    return output;
  }

  std::weak_ptr<FullySharded::State> state_;
};

}  // namespace

FullySharded::FullySharded(model::Gpt model, ShardingGroups groups, FullyShardedOptions options)
    : options_(std::move(options)), state_(std::make_shared<State>()) {
  State& s = *state_;
  if (!groups.shard || !groups.replicate || !groups.all) throw std::invalid_argument("fully sharded: missing communicator");
  if (groups.all->size() != groups.shard->size() * groups.replicate->size()) {
    throw std::invalid_argument("fully sharded: the data-parallel group has " + std::to_string(groups.all->size()) +
                                " ranks, not shard (" + std::to_string(groups.shard->size()) + ") x replicate (" +
                                std::to_string(groups.replicate->size()) + ")");
  }
  if (options_.stage < 1 || options_.stage > 3) {
    throw std::invalid_argument("fully sharded: stage must be 1, 2 or 3, not " + std::to_string(options_.stage));
  }
  if (options_.unit_policy != "block" && options_.unit_policy != "model") {
    throw std::invalid_argument("fully sharded: unit policy must be 'block' or 'model', not '" + options_.unit_policy + "'");
  }
  for (at::ScalarType type : {options_.param_dtype, options_.reduce_dtype}) {
    if (!at::isFloatingType(type)) throw std::invalid_argument("fully sharded: dtypes must be floating point");
  }
  s.options = options_;
  s.model = model;
  s.groups = groups;
  s.shards = groups.shard->size();
  s.shard_rank = groups.shard->rank();
  s.gather_comm = groups.shard->split(0, s.shard_rank, groups.shard->name() + ":gather");
  s.reduce_comm = groups.shard->split(0, s.shard_rank, groups.shard->name() + ":reduce");
  torch::NoGradGuard no_grad;

  // Same starting point everywhere: rank 0's parameters and buffers.
  {
    std::vector<comm::Work> broadcasts;
    for (const at::Tensor& p : model->parameters()) broadcasts.push_back(groups.all->broadcast(p.data(), 0));
    for (const at::Tensor& b : model->buffers()) broadcasts.push_back(groups.all->broadcast(b, 0));
    comm::wait_all(broadcasts);
  }

  // Units: the root (everything outside the blocks) first, then any parameter
  // with a unit of its own, then each block this model holds.
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  auto holds = [&](const std::string& prefix) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
  };
  s.units.emplace_back();
  for (const std::string& name : names) {
    if (!options_.own_unit || !options_.own_unit(name)) continue;
    if (options_.stage == 3) throw std::invalid_argument("fully sharded: units of one parameter need stage 1 or 2");
    s.units.emplace_back();
    s.units.back().module = "parameter " + name;
  }
  const size_t first_block_unit = s.units.size();
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    const std::string block = "blocks." + std::to_string(i);
    if (options_.unit_policy == "block" && holds(block + ".")) {
      s.units.emplace_back();
      s.units.back().module = block;
    }
  }
  for (const auto& item : model->named_parameters()) {
    size_t u = 0;
    for (size_t k = 1; k < s.units.size(); ++k) {
      const std::string& m = s.units[k].module;
      if (k < first_block_unit ? m == "parameter " + item.key() : item.key().rfind(m + ".", 0) == 0) u = k;
    }
    State::Unit& unit = s.units[u];
    unit.names.push_back(item.key());
    unit.params.push_back(item.value());
    unit.offsets.push_back(unit.numel);
    unit.numel += item.value().numel();
  }
  // A pipeline stage may hold nothing outside its blocks.
  if (s.units.front().params.empty()) {
    if (options_.stage == 3) throw std::invalid_argument("fully sharded: stage 3 needs the whole model");
    s.units.erase(s.units.begin());
  }
  if (s.units.empty()) throw std::invalid_argument("fully sharded: the model has no parameters");
  for (size_t u = 0; u < s.units.size(); ++u) s.unit_of_module[s.units[u].module] = u;
  if (options_.unit_policy != "block") {
    for (size_t i = 0; i < model->blocks->size(); ++i) s.unit_of_module["blocks." + std::to_string(i)] = 0;
  }

  const int64_t n = s.shards;
  const bool master_is_view = options_.stage < 3 && options_.param_dtype == at::kFloat;
  for (State::Unit& unit : s.units) {
    unit.padded = (unit.numel + n - 1) / n * n;
    unit.shard = unit.padded / n;
    const at::TensorOptions fp32 = unit.params.front().options().dtype(at::kFloat);
    unit.full = at::zeros({unit.padded}, fp32.dtype(options_.param_dtype));
    at::Tensor flat32 = at::zeros({unit.padded}, fp32);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      flat32.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(unit.params[i].reshape({-1}));
    }
    unit.full.copy_(flat32);
    unit.master = master_is_view ? unit.full.narrow(0, s.shard_rank * unit.shard, unit.shard)
                                 : flat32.narrow(0, s.shard_rank * unit.shard, unit.shard).clone();
    for (size_t i = 0; i < unit.params.size(); ++i) {
      at::Tensor& p = unit.params[i];
      const std::vector<int64_t> shape = p.sizes().vec();
      p.mutable_grad().reset();
      p.set_data(unit.full.narrow(0, unit.offsets[i], p.numel()).view(shape));
    }
    if (options_.stage == 1) {
      unit.grad = at::zeros({unit.padded}, unit.full.options());
      for (size_t i = 0; i < unit.params.size(); ++i) {
        unit.params[i].mutable_grad() =
            unit.grad.narrow(0, unit.offsets[i], unit.params[i].numel()).view(unit.params[i].sizes());
      }
    }
    const bool grad_is_view = options_.stage == 1 && !options_.stage1_reduce_scatter && options_.param_dtype == at::kFloat;
    unit.shard_grad = grad_is_view ? unit.grad.narrow(0, s.shard_rank * unit.shard, unit.shard)
                                   : at::zeros({unit.shard}, fp32);
    if (options_.stage == 3) {
      free_storage(unit.full);
      unit.residency = State::Residency::kFreed;
    }
  }

  // Backward finishes the blocks last to first, then the root (the embedding's
  // gradient is the last one ready).
  for (size_t u = s.units.size(); u-- > 0;) s.reduce_order.push_back(u);
  for (size_t u = 0; u < s.units.size(); ++u) {
    for (const at::Tensor& p : s.units[u].params) {
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      accumulator->add_post_hook(std::make_unique<GradientReadyHook>(state_, u));
      s.accumulators.push_back(std::move(accumulator));
    }
  }
  if (options_.stage == 3) {
    s.hooks = std::make_shared<UnitHooks>(state_);
    model->add_forward_hooks(s.hooks);
  }

  // AdamW over this rank's slice of every parameter (padding excluded).
  std::vector<at::Tensor> decayed, undecayed;
  for (State::Unit& unit : s.units) {
    const int64_t begin = s.shard_rank * unit.shard, end = begin + unit.shard;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const int64_t lo = std::max(begin, unit.offsets[i]);
      const int64_t hi = std::min(end, unit.offsets[i] + unit.params[i].numel());
      if (lo >= hi) continue;
      at::Tensor slice = alias(unit.master, lo - begin, hi - lo);
      const bool split = options_.split_over_tensor && options_.split_over_tensor(unit.names[i]);
      const State::Stretch stretch{size_t(&unit - s.units.data()), lo - begin, hi - lo, split};
      if (split) s.tensor_split.push_back(stretch);
      if (options_.counted_elsewhere && options_.counted_elsewhere(unit.names[i])) s.counted_elsewhere.push_back(stretch);
      slice.mutable_grad() = alias(unit.shard_grad, lo - begin, hi - lo);
      (unit.params[i].dim() >= 2 ? decayed : undecayed).push_back(slice);
    }
  }
  const AdamWSettings& a = options_.adamw;
  auto adamw = [&](double decay) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(a.lr);
    o->betas({a.beta1, a.beta2}).weight_decay(decay).eps(a.eps);
    return o;
  };
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  param_groups.emplace_back(decayed, adamw(a.weight_decay));
  param_groups.emplace_back(undecayed, adamw(0.0));
  s.optimizer = std::make_unique<torch::optim::AdamW>(std::move(param_groups), *adamw(a.weight_decay));
}

FullySharded::~FullySharded() {
  // In-flight operations write into buffers the state owns: let them finish.
  try {
    if (state_->hooks) state_->model->remove_forward_hooks(state_->hooks.get());
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
  for (auto& unit : state_->units) {
    if (unit.grad.defined()) unit.grad.zero_();
    unit.shard_grad.zero_();
  }
}

double FullySharded::clip_grad_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  State& s = *state_;
  // Shards of one group are disjoint (padding holds zeros); replicas hold the
  // same. With tensor parallel, split parameters add up over groups.tensor and
  // the others are copies there: [split, copied] sums of squares.
  at::Tensor squares = at::zeros({2}, at::kDouble);
  for (auto& unit : s.units) squares[1] += unit.shard_grad.to(at::kDouble).pow(2).sum();
  auto squares_of = [&](const State::Stretch& x) {
    return s.units[x.unit].shard_grad.narrow(0, x.offset, x.length).to(at::kDouble).pow(2).sum();
  };
  for (const State::Stretch& x : s.tensor_split) {
    const at::Tensor part = squares_of(x);
    squares[0] += part;
    squares[1] -= part;
  }
  for (const State::Stretch& x : s.counted_elsewhere) squares[x.split ? 0 : 1] -= squares_of(x);
  s.reduce_comm->all_reduce(squares, comm::ReduceOp::kSum).wait();
  if (s.groups.tensor && s.groups.tensor->size() > 1) {
    at::Tensor split = squares.narrow(0, 0, 1).clone();
    s.groups.tensor->all_reduce(split, comm::ReduceOp::kSum).wait();
    squares[0] = split[0];
  }
  at::Tensor total = squares.sum();
  if (s.groups.pipeline && s.groups.pipeline->size() > 1) s.groups.pipeline->all_reduce(total).wait();
  const double norm = std::sqrt(total.item<double>());
  if (max_norm > 0) {
    const double coefficient = max_norm / (norm + 1e-6);
    if (coefficient < 1.0) {
      for (auto& unit : s.units) unit.shard_grad.mul_(coefficient);
    }
  }
  return norm;
}

void FullySharded::step(double lr) {
  State& s = *state_;
  for (auto& group : s.optimizer->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  s.optimizer->step();
  if (s.stage3()) return;  // the next forward gathers
  std::lock_guard<std::mutex> lock(s.mutex);
  torch::NoGradGuard no_grad;
  s.regather_all_locked();
}

at::Tensor FullySharded::own_unit_shard_gradient(const std::string& name) {
  auto it = state_->unit_of_module.find("parameter " + name);
  if (it == state_->unit_of_module.end()) throw std::invalid_argument("fully sharded: " + name + " has no unit of its own");
  return state_->units[it->second].shard_grad;
}

std::map<std::string, at::Tensor> FullySharded::full_state_dict(int root) {
  State& s = *state_;
  std::map<std::string, at::Tensor> out;
  const bool keep = root < 0 || s.groups.all->rank() == root;
  for (auto& unit : s.units) {
    at::Tensor flat = at::empty({unit.padded}, unit.master.options());
    s.gather_comm->all_gather(flat, unit.master.contiguous()).wait();
    if (!keep) continue;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      out[unit.names[i]] = flat.narrow(0, unit.offsets[i], unit.params[i].numel()).view(unit.params[i].sizes()).clone();
    }
  }
  return out;
}

void FullySharded::load_full_state_dict(const std::map<std::string, at::Tensor>& state, int root) {
  State& s = *state_;
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
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& unit : s.units) {
    at::Tensor flat = at::zeros({unit.padded}, unit.master.options());
    if (s.groups.all->rank() == root) {
      for (size_t i = 0; i < unit.params.size(); ++i) {
        flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(state.at(unit.names[i]).reshape({-1}));
      }
    }
    s.groups.all->broadcast(flat, root).wait();
    unit.master.copy_(flat.narrow(0, s.shard_rank * unit.shard, unit.shard));
    if (unit.residency != State::Residency::kFreed) {  // stages 1 and 2, or a stage-3 unit in use
      s.wait_gathered_locked(unit);
      unit.full.copy_(flat);
    }
  }
}

std::string FullySharded::layout() const {
  const State& s = *state_;
  std::ostringstream text;
  text << "zero_stage=" << options_.stage << " shards=" << s.shards << " replicas=" << s.groups.replicate->size()
       << " units=" << options_.unit_policy << "[";
  for (size_t u = 0; u < s.units.size(); ++u) text << (u ? "," : "") << s.units[u].numel;
  text << "] param_dtype=" << dtype_name(options_.param_dtype);
  return text.str();
}

void FullySharded::save_shard(const std::string& path) const {
  const State& s = *state_;
  torch::serialize::OutputArchive archive;
  archive.write("layout", at::tensor(std::vector<int64_t>{options_.stage, s.shards, s.shard_rank}));
  for (size_t u = 0; u < s.units.size(); ++u) archive.write("unit." + std::to_string(u) + ".master", s.units[u].master);
  torch::serialize::OutputArchive optimizer;
  s.optimizer->save(optimizer);
  archive.write("optimizer", optimizer);
  archive.write("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  archive.save_to(path);
}

void FullySharded::load_shard(const std::string& path) {
  State& s = *state_;
  torch::NoGradGuard no_grad;
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  at::Tensor layout;
  archive.read("layout", layout);
  const auto saved = std::vector<int64_t>(layout.data_ptr<int64_t>(), layout.data_ptr<int64_t>() + layout.numel());
  if (saved != std::vector<int64_t>{options_.stage, s.shards, s.shard_rank}) {
    throw std::runtime_error("shard file " + path + " was written by ZeRO stage " + std::to_string(saved.at(0)) +
                             ", shard " + std::to_string(saved.at(2)) + " of " + std::to_string(saved.at(1)) +
                             "; this rank is stage " + std::to_string(options_.stage) + ", shard " +
                             std::to_string(s.shard_rank) + " of " + std::to_string(s.shards));
  }
  for (size_t u = 0; u < s.units.size(); ++u) {
    at::Tensor master;
    archive.read("unit." + std::to_string(u) + ".master", master);
    s.units[u].master.copy_(master);
  }
  torch::serialize::InputArchive optimizer;
  archive.read("optimizer", optimizer);
  s.optimizer->load(optimizer);
  at::Tensor rng;
  archive.read("rng.cpu", rng);
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default state
  generator.set_state(rng);
  if (s.stage3()) return;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.regather_all_locked();
}

int64_t FullySharded::unit_count() const { return static_cast<int64_t>(state_->units.size()); }

int64_t FullySharded::largest_unit_numel() const {
  int64_t largest = 0;
  for (const auto& unit : state_->units) largest = std::max(largest, unit.padded);
  return largest;
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
