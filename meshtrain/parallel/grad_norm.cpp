#include "meshtrain/parallel/grad_norm.h"

#include "meshtrain/model/fused/tensor_args.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>

namespace meshtrain::parallel {

namespace {

// Elements of a gradient squared and summed in double at a time on the CPU
// where the fused kernel does not read its dtype: 8 MiB of double copy. A
// whole gradient's copy and its square were the step's largest temporaries
// (four times the tied embedding's fp32 gradient, 4 GiB at Llama 3's
// vocabulary and width 2048).
constexpr int64_t kSquaredSlice = int64_t{1} << 20;

// The sum of the squares of every element of `tensors`, as a [1] double tensor:
// per tensor in a few kernels on a GPU (foreach norms), in double on the CPU.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors, const at::TensorOptions& options) {
  at::Tensor total = at::zeros({1}, options);
  if (tensors.empty()) return total;
  if (tensors.front().is_cuda()) return total + at::stack(at::_foreach_norm(tensors, 2)).to(at::kDouble).pow(2).sum();
  for (const at::Tensor& t : tensors) total += squared_sum(t);
  return total;
}

}  // namespace

at::Tensor squared_sum(const at::Tensor& x) {
  if (!x.device().is_cpu()) return x.to(at::kDouble).pow(2).sum();
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) {  // one read, no copy
    RECORD_FUNCTION("meshtrain::squared_sum", std::vector<c10::IValue>());
    const at::Tensor c = x.contiguous();
    const double sum = model::fused::kernel::table().sum_squares(c.numel(), c.const_data_ptr(), model::fused::detail::dt(c));
    return at::scalar_tensor(sum, x.options().dtype(at::kDouble));
  }
  const at::Tensor flat = x.reshape({-1});
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  for (int64_t i = 0; i < flat.numel(); i += kSquaredSlice) {
    const at::Tensor slice = flat.narrow(0, i, std::min(kSquaredSlice, flat.numel() - i)).to(at::kDouble);
    total += at::dot(slice, slice);
  }
  return total;
}

double grad_norm_squared(torch::nn::Module& module, const ModelParallelNorm& groups) {
  torch::NoGradGuard no_grad;
  // Sums on the parameters' device: one read of the total at the end.
  at::TensorOptions sums(at::kDouble);
  for (const at::Tensor& p : module.parameters()) {
    sums = sums.device(p.device());
    break;
  }
  std::vector<at::Tensor> split_grads, expert_grads, copied_grads;
  for (const auto& item : module.named_parameters()) {
    const at::Tensor& grad = item.value().grad();
    if (!grad.defined()) continue;
    if (groups.counted_elsewhere && groups.counted_elsewhere(item.key())) continue;
    const bool is_split = groups.tensor && groups.split_over_tensor && groups.split_over_tensor(item.key());
    const bool is_expert = groups.expert && groups.split_over_experts && groups.split_over_experts(item.key());
    (is_split ? split_grads : is_expert ? expert_grads : copied_grads).push_back(grad);
  }
  at::Tensor split = sum_of_squares(split_grads, sums), copied = sum_of_squares(copied_grads, sums);
  at::Tensor experts = sum_of_squares(expert_grads, sums);
  if (groups.tensor && groups.tensor->size() > 1) groups.tensor->all_reduce(split).wait();
  if (groups.expert && groups.expert->size() > 1) groups.expert->all_reduce(experts).wait();
  at::Tensor total = split + experts + copied;
  if (groups.pipeline && groups.pipeline->size() > 1) groups.pipeline->all_reduce(total).wait();
  return total.item<double>();
}

double clip_grad_norm(torch::nn::Module& module, double max_norm, const ModelParallelNorm& groups) {
  const double norm = std::sqrt(grad_norm_squared(module, groups));
  if (max_norm > 0) {
    const double coefficient = max_norm / (norm + 1e-6);
    if (coefficient < 1.0) {
      torch::NoGradGuard no_grad;
      std::vector<at::Tensor> grads;
      for (const at::Tensor& p : module.parameters()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      at::_foreach_mul_(grads, coefficient);
    }
  }
  return norm;
}

}  // namespace meshtrain::parallel
