// AdamW as every parallelism uses it: one way to build its parameter groups
// (weight decay on matrices and embeddings, not on biases and norm weights),
// set its learning rate, and reach its per-parameter state.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace meshtrain::parallel {

struct AdamWSettings {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // on parameters with >= 2 dimensions only
};

// A tensor AdamW updates and the number of dimensions of the parameter it is
// (or is a slice of): >= 2 decays.
struct AdamWParameter {
  at::Tensor tensor;
  int64_t parameter_dims;
};

// The dimensions of parameter `name` that decide its weight decay: its own,
// but one fewer for a mixture-of-experts tensor, whose dim 0 stacks experts
// (an expert's bias [experts, h] is a bias).
int64_t decay_dims(const std::string& name, const at::Tensor& parameter);

// Two groups, decayed and not, in the order given.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<AdamWParameter>& parameters,
                                                const AdamWSettings& settings);
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);
// The state of `parameter`, created (zero moments, step 0) when AdamW has not
// stepped it yet, so that a checkpoint can be saved or loaded into it.
torch::optim::AdamWParamState& adamw_state(torch::optim::AdamW& optimizer, const at::Tensor& parameter);
// Sets the step count of every parameter's state (creating missing ones).
void set_adamw_steps(torch::optim::AdamW& optimizer, int64_t steps);
// optimizer.step(), on the CPU as one fused pass per parameter
// (offload::cpu_adamw, Note [CPU AdamW]), on CUDA as one fused kernel per parameter group
// (at::_fused_adamw_, the kernel of PyTorch's AdamW(fused=True)) instead of
// about ten kernels per parameter; the states are the same tensors, so
// checkpoints see no difference. Elsewhere it is optimizer.step().
void adamw_step(torch::optim::AdamW& optimizer);

}  // namespace meshtrain::parallel
