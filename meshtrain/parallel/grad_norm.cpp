#include "meshtrain/parallel/grad_norm.h"

#include <cmath>

namespace meshtrain::parallel {

double grad_norm_squared(torch::nn::Module& module, const ModelParallelNorm& groups) {
  torch::NoGradGuard no_grad;
  // Sums on the parameters' device: one read of the total at the end.
  at::TensorOptions sums(at::kDouble);
  for (const at::Tensor& p : module.parameters()) {
    sums = sums.device(p.device());
    break;
  }
  at::Tensor split = at::zeros({1}, sums), copied = at::zeros({1}, sums);
  for (const auto& item : module.named_parameters()) {
    const at::Tensor& grad = item.value().grad();
    if (!grad.defined()) continue;
    if (groups.counted_elsewhere && groups.counted_elsewhere(item.key())) continue;
    const bool is_split = groups.tensor && groups.split_over_tensor && groups.split_over_tensor(item.key());
    (is_split ? split : copied) += grad.to(at::kDouble).pow(2).sum();
  }
  if (groups.tensor && groups.tensor->size() > 1) groups.tensor->all_reduce(split).wait();
  at::Tensor total = split + copied;
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce(total).wait();
  return total.item<double>();
}

double clip_grad_norm(torch::nn::Module& module, double max_norm, const ModelParallelNorm& groups) {
  const double norm = std::sqrt(grad_norm_squared(module, groups));
  if (max_norm > 0) {
    const double coefficient = max_norm / (norm + 1e-6);
    if (coefficient < 1.0) {
      torch::NoGradGuard no_grad;
      for (const at::Tensor& p : module.parameters()) {
        if (p.grad().defined()) p.mutable_grad().mul_(coefficient);
      }
    }
  }
  return norm;
}

}  // namespace meshtrain::parallel
