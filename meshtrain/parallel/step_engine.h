// StepEngine: runs a training step over what parallelize() made — forward and
// backward of this rank's micro-batches (through the pipeline schedule when
// there is one), the gradient reduction, clipping and the optimizer — and
// the collectives a training loop reads its numbers from.
#pragma once

#include "meshtrain/model/moe.h"
#include "meshtrain/parallel/parallelize.h"

#include <ATen/ATen.h>

#include <vector>

namespace meshtrain::parallel {

// The call order of a step is DataParallelism's (data_parallelism.h):
// zero_grad(), forward_backward(), clip_grad_norm(), step(). Every call is
// collective over the world.
class StepEngine {
 public:
  explicit StepEngine(Parallelized parts);

  // One step's forward and backward over this rank's micro-batches (tokens
  // and targets [micro_batch, context]), each micro-batch's loss multiplied by
  // its weight (none given: 1 / their count; with targets that count toward no
  // loss, the trainer's weights make the step's loss the mean over the global
  // batch's counted targets). Returns the summed weighted loss where it is
  // computed (the last pipeline stage; 0 elsewhere). Gradients are then reduced.
  // `documents`: each micro-batch's packed-document positions (Note [Packed documents]), or none.
  // Under context parallel each micro-batch is cut to this rank's rows first
  // (ContextParallel::rows).
  double forward_backward(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                          std::vector<double> weights = {}, const std::vector<at::Tensor>& documents = {});
  // The summed loss of evaluation micro-batches (no gradients), each times its weight (none: 1).
  double evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                  std::vector<double> weights = {}, const std::vector<at::Tensor>& documents = {});
  // The mean over data ranks and their context-parallel peers of a per-rank
  // loss sum `local` (taken from the last pipeline stage; tensor-parallel
  // ranks hold the same).
  double mean_loss(double local);
  void zero_grad();
  // Completes the gradients (a tied embedding's two copies summed), returns
  // the global norm and clips to `max_norm` (<= 0: none).
  double clip_grad_norm(double max_norm);
  void step(double lr);
  // What the mixture-of-experts layers saw since the last call, per layer in
  // block order, averaged over their forwards and the ranks.
  std::vector<model::MoeLayerMetrics> moe_metrics();

  Parallelized& parts() { return parts_; }
  const Parallelized& parts() const { return parts_; }

 private:
  // The auxiliary losses' share of the loss gradient (the main loss is divided by the micro-batches).
  void set_aux_loss_scale(double scale);
  // forward_backward() and evaluate() on the rows this rank computes, with their weights.
  double forward_backward_rows(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                               const std::vector<double>& weights, const std::vector<at::Tensor>& documents);
  double evaluate_rows(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                       const std::vector<double>& weights, const std::vector<at::Tensor>& documents);
  double run_pipeline(const pipeline::Schedule& schedule, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& targets, const std::vector<double>& weights,
                      const std::vector<at::Tensor>& documents);

  Parallelized parts_;
};

}  // namespace meshtrain::parallel
