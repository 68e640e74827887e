// DataParallel: every rank holds the whole model; gradients are averaged over
// the data-parallel communicator by bucketed all-reduces that overlap backward.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/adamw.h"
#include "meshtrain/parallel/data_parallelism.h"
#include "meshtrain/parallel/grad_norm.h"

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace meshtrain::parallel {

struct DataParallelOptions {
  int64_t bucket_bytes = int64_t{25} << 20;       // gradients per all-reduce
  int64_t first_bucket_bytes = int64_t{1} << 20;  // the first (last layers') bucket is small so
                                                  // communication starts early in backward
  AdamWSettings adamw;                            // the optimizer step() runs
  ModelParallelNorm norm;                         // model-parallel groups of the gradient norm
  // Expert parallel (Note [Expert parallel]): parameters `expert` names are
  // broadcast and averaged over `expert_comm` (dp x fsdp) only, their gradients
  // multiplied by `expert_scale` (1 / ep) first. Unset: every parameter alike.
  std::function<bool(const std::string&)> expert;
  std::shared_ptr<comm::Communicator> expert_comm;
  double expert_scale = 1.0;
  // The ranks that see different data (dp x ep), for describe(); 0: every rank
  // of the communicator (context parallel's ranks share their rows' data).
  int64_t data_degree = 0;
};

// Note [Data parallel]
// - At construction every parameter and buffer is broadcast from rank 0.
// - Gradients live in flat buckets (parameters in reverse registration order,
//   roughly the order backward produces them); each parameter's .grad is a view
//   into its bucket, so autograd accumulates in place and no copies are made.
// - A post-hook on each parameter's AccumulateGrad node (kept alive here: the
//   tensor holds it only weakly) counts the bucket's ready gradients; when a
//   bucket is complete its all-reduce (average) is issued at once, while
//   backward goes on. Buckets are issued strictly in index order so every rank
//   issues the same sequence of collectives.
// - set_sync(false) before a backward accumulates locally (gradient
//   accumulation micro-steps): no communication at all.
// - A parameter that gets no gradient in a step is reduced as zero (its view
//   still holds zeros, or what earlier micro-steps accumulated): finish()
//   issues any bucket that did not complete during backward.
// - Use zero_grad() here, not the optimizer's (which would drop the views).
// - step() runs AdamW (options.adamw) over the module's parameters; a caller
//   may instead use finish() and an optimizer of its own.
class DataParallel : public DataParallelism {
 public:
  // `module` must outlive this object. Collective over `comm`.
  DataParallel(torch::nn::Module& module, std::shared_ptr<comm::Communicator> comm,
               DataParallelOptions options = {});
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Whether the next backward ends the step (reduce) or only accumulates.
  void set_sync(bool sync) override;
  // After every backward: when it ended the step, finish().
  void after_backward() override;
  // After the step's last backward: issues buckets still pending, waits for all.
  // Every .grad is then the average over ranks.
  void finish();
  void zero_grad() override;
  at::Tensor reduced_gradient(const std::string& name) override;
  double clip_grad_norm(double max_norm) override;
  void step(double lr) override;
  placement::TrainingState state(const ParameterLayouts& layouts = whole_parameter) override;
  placement::TrainingState frozen_state(const ParameterLayouts& layouts = whole_parameter) override;
  void after_load(int64_t optimizer_steps) override;
  std::map<std::string, at::Tensor> full_parameters(int root) override;
  std::string describe() const override;

  const comm::Communicator& comm() const { return *comm_; }
  int64_t bucket_count() const;
  // Seconds finish() spent waiting for all-reduces after backward returned
  // (communication not hidden behind backward), summed since construction.
  double exposed_wait_seconds() const;
  // steady_clock times (seconds) at which the last finish() was entered (this
  // rank's backward was done) and returned (its gradients were averaged).
  std::pair<double, double> last_finish_times() const;
  // Collective: times all-reducing copies of every bucket with nothing else
  // running (the communication a step needs); median of `repeats`, seconds.
  double standalone_reduce_seconds(int repeats) const;

  struct State;  // shared with the autograd hooks

 private:
  torch::nn::Module& module_;
  std::set<std::string> expert_names_;  // parameters options_.expert names
  std::shared_ptr<comm::Communicator> comm_;
  DataParallelOptions options_;
  std::shared_ptr<State> state_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

}  // namespace meshtrain::parallel
