#include "meshtrain/parallel/adamw.h"

#include "meshtrain/model/moe.h"
#include "meshtrain/offload/cpu_adam.h"

namespace meshtrain::parallel {

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<AdamWParameter>& parameters,
                                                const AdamWSettings& settings) {
  std::vector<at::Tensor> decayed, undecayed;
  for (const AdamWParameter& p : parameters) (p.parameter_dims >= 2 ? decayed : undecayed).push_back(p.tensor);
  auto options = [&](double decay) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(settings.lr);
    o->betas({settings.beta1, settings.beta2}).weight_decay(decay).eps(settings.eps);
    return o;
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decayed, options(settings.weight_decay));
  groups.emplace_back(undecayed, options(0.0));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), *options(settings.weight_decay));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

torch::optim::AdamWParamState& adamw_state(torch::optim::AdamW& optimizer, const at::Tensor& parameter) {
  auto& states = optimizer.state();
  void* key = parameter.unsafeGetTensorImpl();
  auto it = states.find(key);
  if (it == states.end()) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(0);
    state->exp_avg(at::zeros_like(parameter, at::MemoryFormat::Preserve));
    state->exp_avg_sq(at::zeros_like(parameter, at::MemoryFormat::Preserve));
    it = states.emplace(key, std::move(state)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

int64_t decay_dims(const std::string& name, const at::Tensor& parameter) {
  return parameter.dim() - (model::is_expert_tensor(name) ? 1 : 0);
}

void set_adamw_steps(torch::optim::AdamW& optimizer, int64_t steps) {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) adamw_state(optimizer, p).step(steps);
  }
}

namespace {

bool fused_cpu_eligible(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  return p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() && g.scalar_type() == at::kFloat &&
         g.is_contiguous() && g.device().is_cpu();
}

bool fused_cuda_eligible(const at::Tensor& p) {
  return p.is_cuda() && p.scalar_type() == at::kFloat && p.grad().is_contiguous();
}

// The CPU AdamW kernel (Note [CPU AdamW]) on every parameter with a gradient.
void cpu_step(torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::optim::AdamWParamState& state = adamw_state(optimizer, p);
      state.step(state.step() + 1);
      offload::cpu_adamw(p, p.grad(), state.exp_avg(), state.exp_avg_sq(),
                         {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                          state.step()});
    }
  }
}

}  // namespace

void adamw_step(torch::optim::AdamW& optimizer) {
  bool cpu = true, cuda = true;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      cpu = cpu && fused_cpu_eligible(p);
      cuda = cuda && fused_cuda_eligible(p);
    }
  }
  if (cpu) return cpu_step(optimizer);
  if (!cuda) {
    optimizer.step();
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<at::Tensor> params, grads, averages, squares;
    std::vector<float> steps;
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::optim::AdamWParamState& state = adamw_state(optimizer, p);
      state.step(state.step() + 1);
      params.push_back(p);
      grads.push_back(p.grad());
      averages.push_back(state.exp_avg());
      squares.push_back(state.exp_avg_sq());
      steps.push_back(static_cast<float>(state.step()));
    }
    if (params.empty()) continue;
    // The kernel reads each parameter's step from a device tensor: one copy for the
    // group, from pinned memory and asynchronous (a plain copy would wait for the GPU).
    const std::vector<at::Tensor> step_tensors =
        at::tensor(steps).pin_memory().to(params.front().device(), /*non_blocking=*/true).unbind(0);
    at::_fused_adamw_(params, grads, averages, squares, /*max_exp_avg_sqs=*/{}, step_tensors, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), /*amsgrad=*/false,
                      /*maximize=*/false);
  }
}

}  // namespace meshtrain::parallel
