// TensorParallelism: what the rest of a layout needs of tensor parallel,
// however it was applied — the hand-written Megatron layers (TensorParallel,
// tensor_parallel.h) or weights annotated and placed by the sharding rules
// (AnnotatedTensorParallel, annotated_tensor_parallel.h). Data parallelism,
// the gradient norm, checkpoints and the random streams use only this.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/random_streams.h"
#include "meshtrain/placement/placement.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

class TensorParallelism {
 public:
  virtual ~TensorParallelism() = default;

  // The tp group.
  virtual const std::shared_ptr<comm::Communicator>& comm() const = 0;
  // Whether a parameter is split over the group (else every rank holds it
  // whole), and how: Shard(dim, parts) or Replicate (Note [Placements]).
  virtual bool is_split(const std::string& name) const = 0;
  virtual placement::Placement placement_of(const std::string& name) const = 0;
  // Every entry of `local` (parameters' pieces by name) made whole. Collective.
  virtual std::map<std::string, at::Tensor> gather_all(const std::map<std::string, at::Tensor>& local) const = 0;
  // After each backward, before data parallelism's after_backward().
  virtual void after_backward() {}
  // Streams of this rank's own that regions holding different data per rank
  // draw from (Note [Random streams]); a recompute restores them too.
  virtual std::vector<RandomStreams::PerRank> random_streams() { return {}; }
  // "tensor parallel tp(2) with sequence parallel"
  virtual std::string describe() const = 0;
};

}  // namespace meshtrain::parallel
