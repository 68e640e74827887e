#include "meshtrain/parallel/adamw.h"

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

void set_adamw_steps(torch::optim::AdamW& optimizer, int64_t steps) {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) adamw_state(optimizer, p).step(steps);
  }
}

}  // namespace meshtrain::parallel
