#include "meshtrain/parallel/random_streams.h"

#include <mutex>

namespace meshtrain::parallel {

namespace {

// One row per world rank: rank r holds row r (Shard(0) nested over every axis).
placement::TensorSpec per_rank_rows(const mesh::MeshLayout& layout, int64_t row_numel) {
  placement::TensorSpec spec;
  spec.shape = {layout.world_size(), row_numel};
  for (const mesh::MeshAxis& axis : layout.axes()) {
    spec.axes.push_back(axis.name);
    spec.placements.push_back(placement::Placement::shard(0));
  }
  return spec;
}

void set_generator_state(at::Device device, const at::Tensor& state) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

at::Tensor generator_state(at::Device device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

}  // namespace

at::Tensor seeded_state(at::Device device, uint64_t seed) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  const at::Tensor saved = generator.get_state();
  generator.set_current_seed(seed);
  at::Tensor state = generator.get_state();
  generator.set_state(saved);
  return state;
}

RandomStreams::RandomStreams(at::Device device, std::vector<PerRank> per_rank)
    : device_(device), per_rank_(std::move(per_rank)) {}

void RandomStreams::reseed(uint64_t seed, int64_t step) {
  const uint64_t moved = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(step + 1);
  set_generator_state(at::kCPU, seeded_state(at::kCPU, moved));
  if (!device_.is_cpu()) set_generator_state(device_, seeded_state(device_, moved));
  for (PerRank& p : per_rank_) p.stream.set(seeded_state(device_, per_rank_seed(moved, p.rank)));
}

void RandomStreams::add_state(placement::TrainingState& state, const mesh::MeshLayout& layout) {
  cpu_state_ = generator_state(at::kCPU);
  state.push_back({"rng/cpu", per_rank_rows(layout, cpu_state_.numel()), cpu_state_, true});
  if (device_.is_cuda()) {
    device_state_ = generator_state(device_);
    state.push_back({"rng/cuda", per_rank_rows(layout, device_state_.numel()), device_state_, true});
  }
  per_rank_states_.clear();
  for (PerRank& p : per_rank_) {
    per_rank_states_.push_back(p.stream.get());
    const at::Tensor& s = per_rank_states_.back();
    state.push_back({"rng/" + p.name, per_rank_rows(layout, s.numel()), s, true});
  }
}

void RandomStreams::restore() {
  set_generator_state(at::kCPU, cpu_state_);
  if (device_.is_cuda()) set_generator_state(device_, device_state_);
  for (size_t i = 0; i < per_rank_.size(); ++i) per_rank_[i].stream.set(per_rank_states_[i]);
}

}  // namespace meshtrain::parallel
