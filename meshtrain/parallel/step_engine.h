// StepEngine: runs a training step over what parallelize() made — forward and
// backward of this rank's micro-batches (through the pipeline schedule when
// there is one), the gradient reduction, clipping and the optimizer — and
// the collectives a training loop reads its numbers from.
#pragma once

#include "meshtrain/model/batch.h"
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
  // its weight (the trainer's: 1 / their count, or, with targets that count
  // toward no loss, the share that makes the step's loss the mean over the
  // global batch's counted targets). Returns the summed weighted loss where
  // it is computed (the last pipeline stage; 0 elsewhere). Gradients are then
  // reduced. Under context parallel each micro-batch is cut to this rank's
  // columns first (ContextParallel::shard).
  double forward_backward(const std::vector<model::Batch>& batches);
  // The summed loss of evaluation micro-batches (no gradients), each times its weight.
  double evaluate(const std::vector<model::Batch>& batches);
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
  // The batches this rank computes: cut to its columns under context parallel.
  std::vector<model::Batch> local(const std::vector<model::Batch>& batches) const;
  double run_pipeline(const pipeline::Schedule& schedule, const std::vector<model::Batch>& batches);

  Parallelized parts_;
};

}  // namespace meshtrain::parallel
