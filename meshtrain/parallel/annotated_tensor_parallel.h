// Tensor parallel from sharding annotations: the GPT's weights annotated
// Megatron-style over the mesh's tp axis (annotate/gpt_annotations.h) and
// every other tensor placed by completion. See Note [Annotated tensor parallel].
#pragma once

#include "meshtrain/annotate/annotate.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/tensor_parallelism.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>

namespace meshtrain::parallel {

// Note [Annotated tensor parallel]
// The model's parameters become distributed tensors in place; the model's
// code is unchanged and runs on them, every operator through the sharding
// rules. What follows tensor parallel in the apply order (data parallel,
// the optimizer, checkpoints, clipping) works on plain tensors, so it is
// given local_module(): a module of each parameter's local piece under the
// parameter's name, sharing its storage, so an optimizer step on a piece is
// a step of the distributed parameter. After each backward, after_backward()
// puts the distributed gradients in their parameters' placements and hands
// them to the pieces through autograd, so that data parallelism's gradient
// hooks fire as they would after a plain backward. Pieces are those of the
// hand-written tensor parallel (the same rows, the same q, k, v blocks), so
// checkpoints move between the two. The mesh is the tp group's alone: each
// rank's micro-batch is its own, and data parallelism (or ZeRO-1/2) averages the
// gradients over dp as it does for the hand-written layout. (A dp axis in
// the annotation mesh would call the ranks' different micro-batches one
// Replicate value, which a rule may cut and gather; a batch annotated as
// split over dp, as annotate_test does, is the way to put dp there.)
// Annotations do not combine yet with pp, ep, ZeRO-3, sequence parallel,
// activation checkpointing, bfloat16 autocast or a GPU: ParallelSpec::check
// refuses those. (ZeRO-1/2 shard the pieces' optimizer states and gradients
// over the data axes as for the plan.)
class AnnotatedTensorParallel : public TensorParallelism {
 public:
  // `mesh`: the tp group's (its other axes of size 1).
  AnnotatedTensorParallel(model::Gpt model, std::shared_ptr<const mesh::DeviceMesh> mesh);

  std::shared_ptr<torch::nn::Module> local_module() const { return local_; }
  void after_backward() override;

  bool is_split(const std::string& name) const override;
  placement::Placement placement_of(const std::string& name) const override;  // over tp
  std::map<std::string, at::Tensor> gather_all(const std::map<std::string, at::Tensor>& local) const override;
  const std::shared_ptr<comm::Communicator>& comm() const override { return mesh_->comm("tp"); }
  std::string describe() const override;

 private:
  model::Gpt model_;
  std::shared_ptr<const mesh::DeviceMesh> mesh_;
  std::shared_ptr<torch::nn::Module> local_;
  std::map<std::string, at::Tensor> parameters_;  // the distributed ones, by name
};

}  // namespace meshtrain::parallel
