// DataParallelism: how the ranks of the data axes (dp x fsdp) keep one model
// and step it: replicated with averaged gradients (DataParallel) or sharded
// (FullySharded, ZeRO-1/2/3). The training loop drives either through this.
#pragma once

#include "meshtrain/placement/state_tensor.h"

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

namespace meshtrain::parallel {

// A parameter's layout as the model-parallel layers left it: its global shape
// and placements over their axes (tensor parallel splits some), and whether
// this rank is the one of them that saves it (coordinate 0 where it is
// replicated; not the last pipeline stage's copy of a tied embedding).
// DataParallelism adds its own axes: each shard saves its part, and what
// replicas hold alike is saved by one of them (bytes balanced over them).
struct ParameterLayout {
  placement::TensorSpec spec;
  bool write = true;
};
using ParameterLayouts = std::function<ParameterLayout(const std::string& name, const at::Tensor& local)>;
// Without model parallelism: the local tensor is the whole parameter.
ParameterLayout whole_parameter(const std::string& name, const at::Tensor& local);

// Call order in one step: zero_grad(); per micro-batch set_sync(last), forward,
// backward, after_backward(); then clip_grad_norm(), step(). Everything is
// collective over the data axes (and the model-parallel groups of the norm).
class DataParallelism {
 public:
  virtual ~DataParallelism() = default;

  // Whether the coming backward ends the step (reduce) or only accumulates.
  virtual void set_sync(bool sync) = 0;
  // After every backward; after the step's last one the gradients are reduced.
  virtual void after_backward() = 0;
  virtual void zero_grad() = 0;
  // After the step's last after_backward(): the reduced gradient of parameter
  // `name` as this rank holds it (whole, or its shard in a unit of its own);
  // it may be changed in place (a pipeline sums a tied embedding's copies).
  virtual at::Tensor reduced_gradient(const std::string& name) = 0;
  // The global gradient norm (over every shard and model-parallel rank), and
  // clipping to `max_norm` (<= 0: none).
  virtual double clip_grad_norm(double max_norm) = 0;
  // AdamW at learning rate `lr`.
  virtual void step(double lr) = 0;
  // The frozen parameters (LoRA's base, Note [LoRA]) as this rank holds
  // them, for loading a base model into; state() leaves them out.
  virtual placement::TrainingState frozen_state(const ParameterLayouts& layouts = whole_parameter) = 0;

  // Parameters ("model/NAME", fp32) and AdamW moments ("optim/NAME/exp_avg",
  // ".../exp_avg_sq") this rank holds, as views: a checkpoint writes them and
  // loads into them.
  virtual placement::TrainingState state(const ParameterLayouts& layouts = whole_parameter) = 0;
  // After a load wrote into state(): AdamW's step count, and whatever derives
  // from the loaded values (ZeRO-1/2 gather full parameters again).
  virtual void after_load(int64_t optimizer_steps) = 0;
  // Every parameter this rank's model holds, fp32, unsharded over the data
  // axes, by name, on data rank `root` (-1: every data rank). Collective.
  virtual std::map<std::string, at::Tensor> full_parameters(int root) = 0;
  // "data parallel over 4 ranks", "ZeRO stage 3 over dp(1) x fsdp(4), 7 units, ..."
  virtual std::string describe() const = 0;
};

}  // namespace meshtrain::parallel
