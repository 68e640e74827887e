// The global gradient norm of a model split over tensor-parallel ranks and
// pipeline stages, and clipping to it.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

namespace meshtrain::parallel {

// How a rank's parameters relate to the whole model's. Unset members: none.
struct ModelParallelNorm {
  std::shared_ptr<comm::Communicator> tensor;               // each rank holds part of the split parameters
  std::function<bool(const std::string&)> split_over_tensor;  // the others are copies over `tensor`
  std::shared_ptr<comm::Communicator> pipeline;             // each stage holds other parameters
  std::function<bool(const std::string&)> counted_elsewhere;  // copies another stage counts (a tied embedding)
  std::shared_ptr<comm::Communicator> expert;               // each rank holds other experts
  std::function<bool(const std::string&)> split_over_experts;  // expert tensors (summed over `expert`)
};

// The sum of x's squared elements as a double 0-dim tensor on x's device:
// on the CPU in double a slice at a time, with no whole double copy of x.
at::Tensor squared_sum(const at::Tensor& x);

// Squares of this rank's gradients summed over the model: split parameters
// over `tensor`, experts over `expert`, every stage over `pipeline`, each
// parameter once.
double grad_norm_squared(torch::nn::Module& module, const ModelParallelNorm& groups);
// The global norm; scales every gradient of `module` down to `max_norm` when
// above it (max_norm <= 0: no clipping). Collective over both groups.
double clip_grad_norm(torch::nn::Module& module, double max_norm, const ModelParallelNorm& groups);

}  // namespace meshtrain::parallel
