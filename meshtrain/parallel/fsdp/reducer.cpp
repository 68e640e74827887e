// Gradient reduction: each unit's gradients are reduced as soon as backward
// has produced all of them, in the same unit order on every rank.
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include "meshtrain/parallel/gradient_ready_hook.h"

namespace meshtrain::parallel {

void ShardedState::install_gradient_hooks(const std::shared_ptr<ShardedState>& self) {
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].frozen) continue;
    for (const at::Tensor& p : units[u].params) {
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      accumulator->add_post_hook(std::make_unique<GradientReadyHook<ShardedState>>(self, u));
      accumulators.push_back(std::move(accumulator));
    }
  }
}

void ShardedState::mark_ready(size_t u) {
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

void ShardedState::issue_reduce_locked(Unit& unit) {
  const at::ScalarType reduce_dtype = options.reduce_dtype;
  const double scale = unit.expert ? options.expert_scale : 1.0;
  if (options.stage == 1) {
    at::Tensor input = unit.grad;
    if (reduce_dtype != unit.grad.scalar_type()) input = unit.reduce_in = unit.grad.to(reduce_dtype);
    if (scale != 1.0) input.mul_(scale);
    if (options.stage1_reduce_scatter) {
      unit.reduce_out = at::empty({unit.shard}, input.options());
      unit.reduce_work = reduce_comm->reduce_scatter(unit.reduce_out, input, comm::ReduceOp::kAvg);
    } else {
      unit.reduce_work = all_of(unit)->all_reduce(input, comm::ReduceOp::kAvg);
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
  if (scale != 1.0) unit.reduce_in.mul_(scale);
  unit.reduce_out = at::empty({unit.shard}, unit.reduce_in.options());
  unit.reduce_work = reduce_comm->reduce_scatter(unit.reduce_out, unit.reduce_in, comm::ReduceOp::kAvg);
  reshard_locked(unit, /*frozen_too=*/false);  // stage 3: its backward is over (but for its input gradients)
  in_flight.push_back(&unit);
  // At most kMaxInFlight flat gradients exist at once; backward waits for the oldest beyond that.
  fold_locked(kMaxInFlight);
}

void ShardedState::fold_locked(size_t keep) {
  const auto start = Clock::now();
  // Folding early, when a reduction happens to be done, frees memory sooner,
  // but only a fold without communication may: a fold that all-reduces over
  // the replicas blocks this rank, so it must come at the same point on every
  // rank, or a replica that waits for this one elsewhere mid-backward (a
  // context-parallel ring or all-to-all, an expert all-to-all, a
  // tensor-parallel reduction, a stage-3 gather) never gets it. Only the
  // count decides those.
  const auto early = [&](Unit& unit) { return replicate_of(unit)->size() == 1 && unit.reduce_work.completed(); };
  while (!in_flight.empty() && (in_flight.size() > keep || early(*in_flight.front()))) {
    Unit& unit = *in_flight.front();
    in_flight.pop_front();
    unit.reduce_work.wait();
    const auto& replicate = replicate_of(unit);
    if (replicate->size() > 1) replicate->all_reduce(unit.reduce_out, comm::ReduceOp::kAvg).wait();
    unit.shard_grad.add_(unit.reduce_out.to(unit.shard_grad.device()));  // host memory when offloaded
    unit.reduce_in = unit.reduce_out = at::Tensor();
    unit.reduce_work = comm::Work();
  }
  exposed_reduce += seconds_since(start);
}

void ShardedState::after_backward() {
  std::lock_guard<std::mutex> lock(mutex);
  if (options.stage == 1 && !sync) return;
  // Units with a parameter that got no gradient are reduced now, in order.
  for (; next_reduce < reduce_order.size(); ++next_reduce) issue_reduce_locked(units[reduce_order[next_reduce]]);
  if (options.stage == 1) {
    const auto start = Clock::now();
    std::vector<comm::Work> replicas;
    for (size_t u : reduce_order) {
      units[u].reduce_work.wait();
      const auto& replicate = replicate_of(units[u]);
      if (replicate->size() > 1 && options.stage1_reduce_scatter) {
        replicas.push_back(replicate->all_reduce(units[u].reduce_out, comm::ReduceOp::kAvg));
      }
    }
    comm::wait_all(replicas);
    for (Unit& unit : units) {
      if (unit.frozen) continue;
      const bool grad_is_view = unit.grad.defined() && unit.shard_grad.is_alias_of(unit.grad);
      if (options.stage1_reduce_scatter) {
        unit.shard_grad.copy_(unit.reduce_out.to(unit.shard_grad.device()));
      } else {
        if (unit.reduce_in.defined()) unit.grad.copy_(unit.reduce_in);
        if (!grad_is_view) unit.shard_grad.copy_(unit.grad.narrow(0, shard_rank * unit.shard, unit.shard));
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

}  // namespace meshtrain::parallel
