// PipelineExecutor: runs one rank's list of actions of any schedule.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/pipeline/trace.h"

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace meshtrain::parallel::pipeline {

struct StageCallbacks {
  // Stage `stage` forward on micro-batch `mb`; `input` is undefined on stage 0
  // (the callback has the tokens) and a leaf requiring grad elsewhere (in a
  // backward schedule). Returns the stage's output; on the last stage the
  // micro-batch's loss as a scalar (already scaled as backward should see it).
  std::function<at::Tensor(int stage, int mb, const at::Tensor& input)> forward;
  // Before each backward; `last` for this rank's last backward of the step
  // (data parallel reduces then).
  std::function<void(bool last)> before_backward;
  // After each backward.
  std::function<void()> after_backward;
};

// Note [Pipeline executor]
// One loop over this rank's actions. Activations and gradients between
// stages are [activation_shape] tensors of `dtype` (known from the config on
// every rank, so nothing about shapes is exchanged); an output of another
// shape or dtype is an error naming the stage. A receive is posted at its
// action and waited on by the forward/backward that needs it (the wait is a
// "recv" span: idle time, or communication not hidden); a send is posted and
// completes in the background, its tensor kept until the step's end. A
// forward keeps its input and output (the autograd graph between them holds
// the activations) until its backward: stashed() counts them.
class PipelineExecutor {
 public:
  // `comm`: the pipeline axis; its rank is this rank's pipeline rank.
  explicit PipelineExecutor(std::shared_ptr<comm::Communicator> comm);

  // Runs `schedule`'s actions for this rank; returns the sum of the last
  // stage's outputs (the step's loss there; 0 on other ranks).
  double run(const Schedule& schedule, const StageCallbacks& callbacks, std::vector<int64_t> activation_shape,
             at::ScalarType dtype);

  // Of the last run: every span, and the most forwards stashed at once.
  const std::vector<Span>& spans() const { return spans_; }
  int peak_stashed() const { return peak_stashed_; }
  const comm::Communicator& comm() const { return *comm_; }

 private:
  std::shared_ptr<comm::Communicator> comm_;
  std::vector<Span> spans_;
  int peak_stashed_ = 0;
};

}  // namespace meshtrain::parallel::pipeline
