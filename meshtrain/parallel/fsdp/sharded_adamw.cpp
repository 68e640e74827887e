// The optimizer over shards: AdamW on this rank's fp32 master slices, the
// global gradient norm over every shard, and clipping.
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include "meshtrain/parallel/grad_norm.h"

#include <algorithm>
#include <cmath>

namespace meshtrain::parallel {

namespace {

// A 1-D tensor over elements [offset, offset + length) of `flat`'s storage that
// is not an autograd view (the optimizer treats it as a parameter of its own).
at::Tensor alias(const at::Tensor& flat, int64_t offset, int64_t length) {
  torch::NoGradGuard no_grad;
  at::Tensor out = at::empty({0}, flat.options());
  out.set_(flat.storage(), flat.storage_offset() + offset, {length}, {1});
  return out;
}

}  // namespace

void ShardedState::build_optimizer() {
  const bool any_frozen = std::any_of(units.begin(), units.end(), [](const Unit& u) { return u.frozen; });
  if (any_frozen && options.offload_optimizer != offload::Tier::kDevice) {
    throw std::invalid_argument("offload.optimizer with frozen parameters (LoRA) is not supported; the adapters' "
                                "optimizer state is small: leave offload.optimizer = \"none\"");
  }
  if (options.offload_optimizer != offload::Tier::kDevice) {
    offloaded = std::make_unique<OffloadedAdamW>(*this, options.offload_optimizer, options.offload_params, options.nvme_dir);
  } else if (options.offload_params != offload::Tier::kDevice) {
    throw std::invalid_argument("offload.params needs offload.optimizer = \"cpu\" or \"nvme\" too");
  }
  // AdamW over this rank's slice of every parameter (padding excluded).
  std::vector<AdamWParameter> adamw;
  for (Unit& unit : units) {
    const int64_t begin = shard_rank * unit.shard, end = begin + unit.shard;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const int64_t lo = std::max(begin, unit.offsets[i]);
      const int64_t hi = std::min(end, unit.offsets[i] + unit.params[i].numel());
      if (lo >= hi) continue;
      if (unit.frozen) {  // loaded into, never stepped
        frozen_slices.push_back({size_t(&unit - units.data()), i, lo - unit.offsets[i], hi - unit.offsets[i],
                                 alias(unit.master, lo - begin, hi - lo)});
        continue;
      }
      // (An NVMe master has no tensor: the offloaded optimizer streams it.)
      at::Tensor slice = unit.master.defined() ? alias(unit.master, lo - begin, hi - lo) : at::Tensor();
      const bool split = options.split_over_tensor && options.split_over_tensor(unit.names[i]);
      const Stretch stretch{size_t(&unit - units.data()), lo - begin, hi - lo, split};
      if (split) tensor_split.push_back(stretch);
      if (options.counted_elsewhere && options.counted_elsewhere(unit.names[i])) counted_elsewhere.push_back(stretch);
      if (!offloaded) {
        slice.mutable_grad() = alias(unit.shard_grad, lo - begin, hi - lo);
        adamw.push_back({slice, decay_dims(unit.names[i], unit.params[i])});
      }
      slices.push_back({stretch.unit, i, lo - unit.offsets[i], hi - unit.offsets[i], slice});
    }
  }
  if (!offloaded) optimizer = make_adamw(adamw, options.adamw);
}

at::Tensor ShardedState::gather_input(size_t u) {
  Unit& unit = units[u];
  if (offloaded) {
    if (stage3()) return offloaded->gather_input(u);
    return unit.full.narrow(0, shard_rank * unit.shard, unit.shard);  // the step wrote this rank's part
  }
  return unit.master.scalar_type() == unit.full.scalar_type() ? unit.master : unit.master.to(unit.full.scalar_type());
}

at::Tensor ShardedState::master_values(size_t u) {
  if (offloaded) return offloaded->master_values(u);
  return units[u].master.contiguous();
}

void ShardedState::set_master_values(size_t u, const at::Tensor& values) {
  if (offloaded) return offloaded->set_master_values(u, values);
  units[u].master.copy_(values);
}

double ShardedState::clip_grad_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  // Shards of one group are disjoint (padding holds zeros); replicas hold the
  // same. With tensor parallel, split parameters add up over groups.tensor and
  // the others are copies there: [split, copied] sums of squares. Experts add
  // up over groups.expert (each ep rank holds others), in a third sum.
  at::Tensor squares = at::zeros({3}, at::TensorOptions(at::kDouble).device(reduce_comm->device()));
  // (An offloaded optimizer's shard gradients are in host memory: summed there.)
  for (Unit& unit : units) {
    if (!unit.frozen) squares[unit.expert ? 2 : 1] += squared_sum(unit.shard_grad).to(squares.device());
  }
  auto squares_of = [&](const Stretch& x) {
    return squared_sum(units[x.unit].shard_grad.narrow(0, x.offset, x.length)).to(squares.device());
  };
  for (const Stretch& x : tensor_split) {
    const at::Tensor part = squares_of(x);
    squares[0] += part;
    squares[1] -= part;
  }
  for (const Stretch& x : counted_elsewhere) squares[x.split ? 0 : 1] -= squares_of(x);
  reduce_comm->all_reduce(squares, comm::ReduceOp::kSum).wait();
  if (groups.expert && groups.expert->size() > 1) {
    at::Tensor experts = squares.narrow(0, 2, 1).clone();
    groups.expert->all_reduce(experts, comm::ReduceOp::kSum).wait();
    squares[2] = experts[0];
  }
  if (groups.tensor && groups.tensor->size() > 1) {
    at::Tensor split = squares.narrow(0, 0, 1).clone();
    groups.tensor->all_reduce(split, comm::ReduceOp::kSum).wait();
    squares[0] = split[0];
  }
  at::Tensor total = squares.sum();
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce(total).wait();
  const double norm = std::sqrt(total.item<double>());
  if (max_norm > 0) {
    const double coefficient = max_norm / (norm + 1e-6);
    if (coefficient < 1.0) {
      for (Unit& unit : units) {
        if (!unit.frozen) unit.shard_grad.mul_(coefficient);
      }
    }
  }
  return norm;
}

void ShardedState::step(double lr) {
  if (offloaded) {
    offloaded->step(lr);
  } else {
    set_learning_rate(*optimizer, lr);
    adamw_step(*optimizer);
  }
  if (stage3()) return;  // the next forward gathers
  std::lock_guard<std::mutex> lock(mutex);
  torch::NoGradGuard no_grad;
  regather_all_locked();
}

}  // namespace meshtrain::parallel
