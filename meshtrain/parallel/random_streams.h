// The random streams of a parallel run: seeded once, written into
// checkpoints and restored from them, on whichever device the run uses.
// See Note [Random streams].
#pragma once

#include "meshtrain/mesh/mesh_layout.h"
#include "meshtrain/placement/state_tensor.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// A random stream other than the default generator (tensor parallel's
// per-rank stream): read and replaced by value. Activation checkpointing
// restores it for a recompute; checkpoints save it.
struct RandomStream {
  std::function<at::Tensor()> get;
  std::function<void(const at::Tensor&)> set;
};

// The state `device`'s default generator takes from set_current_seed(seed):
// a CPU (Mersenne Twister) state on the CPU, a Philox state on a GPU, so that
// it can be set into a generator of that device. The generator itself is
// left as it was. Thread-safe.
at::Tensor seeded_state(at::Device device, uint64_t seed);

// Note [Random streams]
// Replicated regions draw from the default generators (CPU, and the GPU's on
// a CUDA device), which hold the same state on every rank; regions where
// ranks hold different data (tensor parallel's split heads and sequence
// chunks) draw from a stream of each rank's own. A fresh run seeds them all
// from the training seed moved on by the step (reseed), so a run resumed in
// another layout draws what a fresh run of that layout would; a run resumed
// in its own layout restores the exact states it saved (entries "rng/cpu",
// "rng/cuda" and "rng/<stream>", one row per world rank). Every state is
// made by seeded_state() for the device its generator lives on.
class RandomStreams {
 public:
  // A rank's own stream: its name in checkpoints and the rank of its group
  // ("tensor_parallel", tp rank) that offsets its seed.
  struct PerRank {
    std::string name;
    RandomStream stream;
    int64_t rank = 0;
  };

  RandomStreams() = default;
  RandomStreams(at::Device device, std::vector<PerRank> per_rank);

  // What a fresh run draws at `step`: the default generators seeded from
  // `seed` moved on by the step, each per-rank stream from that + 2718 + its rank.
  void reseed(uint64_t seed, int64_t step);
  // Appends one entry per generator (a row per world rank of `layout`): a
  // copy of the state now, which a checkpoint load writes into.
  void add_state(placement::TrainingState& state, const mesh::MeshLayout& layout);
  // Sets every generator to what a load wrote into add_state()'s entries.
  void restore();

  // The seed of a per-rank stream of rank `rank` for a run seeded with `seed`.
  static uint64_t per_rank_seed(uint64_t seed, int64_t rank) { return seed + 2718 + static_cast<uint64_t>(rank); }

 private:
  at::Device device_ = at::kCPU;
  std::vector<PerRank> per_rank_;
  at::Tensor cpu_state_, device_state_;
  std::vector<at::Tensor> per_rank_states_;
};

}  // namespace meshtrain::parallel
