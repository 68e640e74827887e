// A post hook on a parameter's gradient accumulator that tells its owner that
// the gradient of one bucket or unit is ready, for data parallel's buckets and
// fully sharded's units alike.
#pragma once

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <utility>

namespace meshtrain::parallel {

// Calls owner->mark_ready(index) each time autograd has accumulated the
// gradient of a parameter it is installed on. The owner is held weakly: a hook
// outlives the wrapper that installed it when the model is kept.
template <typename Owner>
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::weak_ptr<Owner> owner, size_t index) : owner_(std::move(owner)), index_(index) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto owner = owner_.lock()) owner->mark_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<Owner> owner_;
  size_t index_;
};

}  // namespace meshtrain::parallel
