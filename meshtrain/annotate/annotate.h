// Sharding annotations (GShard, GSPMD): replicate, split, shard and
// mesh_split, on parameters (their layout) and on intermediate tensors (a
// constraint). See Note [Annotations].
#pragma once

#include "meshtrain/annotate/dist_tensor.h"

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace meshtrain::annotate {

// Note [Annotations]
// An annotation names where a tensor lives on a mesh; completion
// (rules.cpp) decides every other tensor. Each function takes a tensor and
// returns it annotated:
// - a parameter (a leaf that requires grad) becomes a distributed tensor in
//   place: the same TensorImpl turns into a storage-less one holding this
//   rank's piece, so every module field and parameter list that refers to it
//   sees the change and the model's code stays as it is;
// - another plain tensor (an input) is taken as the same global value on
//   every rank and cut to the annotation;
// - a distributed tensor (an activation) is redistributed there, with
//   autograd: a constraint on what completion chose.
// The four forms:
//   replicate(t, mesh)                      whole on every rank
//   split(t, dim, num_partitions, mesh)     dim cut over the mesh axis of that
//                                           size (name it when several have it)
//   shard(t, mesh, tiles, device_order)     dim d cut into tiles[d]; tile i
//                                           (row-major) on rank device_order[i];
//                                           the order must be one the mesh's
//                                           axes give (it picks which axis cuts
//                                           which dim); other axes replicate
//   mesh_split(t, mesh, dims_mapping)       dim d cut over mesh axis
//                                           dims_mapping[d] (-1: whole)
// Axes not named replicate. A split need not divide evenly: chunks are
// balanced (Note [Distributed tensors]).
using Mesh = std::shared_ptr<const mesh::DeviceMesh>;
using Sharding = std::vector<placement::Placement>;  // one per mesh axis

Sharding replicated(const mesh::DeviceMesh& mesh);
Sharding split_sharding(const mesh::DeviceMesh& mesh, int64_t dim, int num_partitions,
                        const std::string& axis = "");
Sharding tiled_sharding(const mesh::DeviceMesh& mesh, const std::vector<int64_t>& tiles,
                        const std::vector<int>& device_order);
// `blocks` > 1: each split dim is that many equal blocks, each split alike
// (a fused q, k, v projection split by heads; Note [Placements]).
Sharding mesh_split_sharding(const mesh::DeviceMesh& mesh, const std::vector<int>& dims_mapping, int64_t blocks = 1);

// Puts `t` in `sharding` as the Note says.
at::Tensor annotate(const at::Tensor& t, const Mesh& mesh, const Sharding& sharding);

at::Tensor replicate(const at::Tensor& t, const Mesh& mesh);
at::Tensor split(const at::Tensor& t, int64_t dim, int num_partitions, const Mesh& mesh, const std::string& axis = "");
at::Tensor shard(const at::Tensor& t, const Mesh& mesh, const std::vector<int64_t>& tiles,
                 const std::vector<int>& device_order);
at::Tensor mesh_split(const at::Tensor& t, const Mesh& mesh, const std::vector<int>& dims_mapping, int64_t blocks = 1);

// Every parameter of `module` whose dotted name matches a pattern ("*"
// matches one segment: "blocks.*.attn.qkv.weight") gets that pattern's
// sharding (the first that matches); every other parameter is replicated.
// Returns the names annotated other than replicated.
using ShardingRule = std::pair<std::string, Sharding>;
std::vector<std::string> annotate_module(torch::nn::Module& module, const Mesh& mesh,
                                         const std::vector<ShardingRule>& rules);

// The dotted-name pattern match annotate_module uses.
bool name_matches(const std::string& pattern, const std::string& name);

// After backward: every gradient put in its parameter's placements (partial
// sums reduced), so an optimizer can step on the local pieces.
void settle_gradients(torch::nn::Module& module);

}  // namespace meshtrain::annotate
