// Residency: when a unit's full parameters exist. Stage 3 gathers a unit
// before it is used and frees it after; stages 1 and 2 keep every unit and
// gather them again after each optimizer step.
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include <c10/core/StorageImpl.h>

namespace meshtrain::parallel {

namespace {

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

}  // namespace

void ShardedState::gather_locked(Unit& unit) {
  for (size_t c : unit.companions) gather_locked(units[c]);
  if (unit.residency != Residency::kFreed) return;
  ObserverPause pause;  // a one-rank gather copies into `full` on this thread
  allocate_storage(unit.full);
  const at::Tensor input = unit.gather_input = gather_input(static_cast<size_t>(&unit - units.data()));
  unit.gather_work = gather_comm->all_gather(unit.full, input);
  unit.residency = Residency::kGathering;
}

void ShardedState::wait_gathered_locked(Unit& unit) {
  gather_locked(unit);
  for (size_t c : unit.companions) wait_gathered_locked(units[c]);
  if (unit.residency != Residency::kGathering) return;
  const auto start = Clock::now();
  unit.gather_work.wait();
  exposed_gather += seconds_since(start);
  unit.gather_work = comm::Work();
  unit.gather_input = at::Tensor();
  unit.residency = Residency::kGathered;
}

void ShardedState::regather_all_locked(bool frozen_too) {
  for (Unit& unit : units) {
    if (unit.frozen && !frozen_too) continue;  // unchanged by a step
    unit.residency = Residency::kFreed;  // its storage stays (only stage 3 frees): gather_locked reuses it
    gather_locked(unit);
  }
  for (Unit& unit : units) wait_gathered_locked(unit);
}

void ShardedState::reshard_locked(Unit& unit, bool frozen_too) {
  if (!stage3()) return;
  for (size_t c : unit.companions) {
    if (frozen_too || !units[c].frozen) reshard_locked(units[c]);
  }
  if (unit.residency == Residency::kFreed) return;
  if (unit.residency == Residency::kGathering) unit.gather_work.wait();
  unit.gather_work = comm::Work();
  unit.gather_input = at::Tensor();
  free_storage(unit.full);
  unit.residency = Residency::kFreed;
}

void ShardedState::before_forward(size_t u) {
  std::lock_guard<std::mutex> lock(mutex);
  wait_gathered_locked(units[u]);
  const size_t next = next_host(u);
  if (options.prefetch && next != SIZE_MAX) gather_locked(units[next]);
}

void ShardedState::after_forward(size_t u, bool backward_follows) {
  std::lock_guard<std::mutex> lock(mutex);
  if (units[u].module.empty()) {  // the root: kept until its gradients are reduced
    if (!backward_follows) reshard_locked(units[u]);  // evaluation: nothing more to do
    return;
  }
  if (options.reshard_after_forward || !backward_follows) reshard_locked(units[u]);
}

void ShardedState::before_backward(size_t u) {
  std::lock_guard<std::mutex> lock(mutex);
  wait_gathered_locked(units[u]);
  // The gradient of u's output is complete: the unit after it has computed
  // every input gradient it will, so its frozen parameters (which only those
  // need) can go. Its trainable ones went with their reduction.
  const size_t after = next_host(u);
  if (after != SIZE_MAX) {
    if (units[after].frozen) reshard_locked(units[after]);
    for (size_t c : units[after].companions) {
      if (units[c].frozen) reshard_locked(units[c]);
    }
  }
  const size_t previous = previous_host(u);
  if (options.prefetch && previous != SIZE_MAX && !units[previous].module.empty()) {
    gather_locked(units[previous]);  // (the root is still gathered)
  }
}

void ShardedState::on_use(size_t u) {
  std::lock_guard<std::mutex> lock(mutex);
  if (units[u].host != SIZE_MAX) u = units[u].host;  // a companion is in use with its host
  if (u == current_unit && units[u].residency == Residency::kGathered) return;  // reductions may have freed it
  const size_t previous = current_unit;
  current_unit = u;
  wait_gathered_locked(units[u]);
  if (previous != SIZE_MAX && options.reshard_after_forward && !units[previous].module.empty()) {
    reshard_locked(units[previous]);  // it is gathered again if used again
  }
  if (!use_order_known) {
    use_order.push_back(u);
    return;
  }
  // Prefetch what followed u the first time: the next use of u in the
  // recorded order, from where the last one was found.
  for (size_t step = 0; step < use_order.size(); ++step) {
    const size_t i = (use_cursor + step) % use_order.size();
    if (use_order[i] != u) continue;
    use_cursor = (i + 1) % use_order.size();
    if (options.prefetch) gather_locked(units[use_order[use_cursor]]);
    break;
  }
}

void ShardedState::end_step_locked() {
  if (!stage3()) return;
  for (Unit& unit : units) reshard_locked(unit);
  current_unit = SIZE_MAX;
  use_cursor = 0;
  if (!use_order.empty()) use_order_known = true;
}

}  // namespace meshtrain::parallel
