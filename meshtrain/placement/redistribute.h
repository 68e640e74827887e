// redistribute: a tensor's local piece under one placement turned into its
// local piece under another, with the collective each change needs, and
// autograd through it. See Note [Redistribute].
#pragma once

#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/placement/placement.h"

#include <ATen/ATen.h>

#include <vector>

namespace meshtrain::placement {

// Note [Redistribute]
// Along one mesh axis:
//   Shard(i) -> Replicate   all-gather          Partial -> Replicate  all-reduce
//   Partial  -> Shard(i)    reduce-scatter      Shard(i) -> Shard(j)  all-to-all
//   Replicate -> Shard(i)   local slice         Replicate -> Partial  coordinate 0 keeps it, the others 0
//   Shard(i) -> Partial     zeros around the local chunk (no communication)
// Several axes change in an order that keeps nesting right (Note
// [Placements]): shards are undone innermost first (an axis nested inside
// one that changes the same dim is gathered too), partial sums are reduced
// outermost first (reduce-scatter where the nesting allows, else all-reduce),
// then new shards are cut outermost first. Uneven chunks throughout.
// Autograd: the backward redistributes the gradient from dual(to) to
// dual(from), where dual swaps Replicate and Partial and keeps Shard: the
// gradient of a value every rank holds is a sum of every rank's
// contribution, and the gradient of a partial sum is the whole gradient on
// every rank. So all-gather and reduce-scatter are each other's backward,
// all-reduce's backward is an all-reduce, a slice's is a zero-padding.
// Collective over the communicators of the spec's axes: every rank of them
// calls it with the same specs. `mesh` must outlive the backward.
at::Tensor redistribute(const at::Tensor& local, const mesh::DeviceMesh& mesh, const TensorSpec& from,
                        const std::vector<Placement>& to);

// The same without autograd (the result does not require grad).
at::Tensor redistribute_data(const at::Tensor& local, const mesh::DeviceMesh& mesh, const TensorSpec& from,
                             const std::vector<Placement>& to);

// Replicate <-> Partial, Shard kept.
std::vector<Placement> dual(const std::vector<Placement>& placements);

}  // namespace meshtrain::placement
