// Test helper: counts a gradient accumulator's post-hook calls, as data
// parallel's bucket counts do (parallel/gradient_ready_hook.h).
#pragma once

#include <torch/csrc/autograd/function_hook.h>

namespace meshtrain::model {

struct CountingPostHook : torch::autograd::FunctionPostHook {
  explicit CountingPostHook(int* calls) : calls(calls) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    ++*calls;
    return outputs;
  }
  int* calls;
};

}  // namespace meshtrain::model
