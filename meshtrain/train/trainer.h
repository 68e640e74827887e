// Trainer: the training loop of one run — data, model, data parallel, AdamW
// with warmup and cosine decay, accumulation, clipping, validation, metrics,
// checkpoints.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/parallel/activation_checkpoint.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/grad_norm.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/pipeline/stages.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/util/memory.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

namespace meshtrain::train {

// One rank's fp32 matmul rate (FLOP/s) with its threads: 2·n³ / t for n = 1024, best of 3.
double measure_matmul_peak();

// Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at `steps`.
double learning_rate(const TrainConfig& config, int64_t step);

// Counted CPU tensor bytes of this rank during one step (util/memory.h).
struct StepMemory {
  int64_t model_states = 0;  // in use after the step: parameters, gradients, optimizer states
  std::array<int64_t, memory::kPhaseCount> phase_peak{};  // highest in use within each phase
  int64_t peak() const { return *std::max_element(phase_peak.begin(), phase_peak.end()); }
};

struct StepResult {
  int64_t step = 0;        // steps completed after this one
  double loss = 0;         // mean training loss over the global batch
  double grad_norm = 0;    // global norm before clipping
  double lr = 0;
  double seconds = 0;
  StepMemory memory;
};

class Trainer {
 public:
  // `config` must be validated for world->size() ranks (pp x dp x fsdp x tp).
  // Collective over `world`: prepares data (rank 0), builds the model from the
  // seed, lays the ranks out as a pp x dp x fsdp x tp mesh, applies tensor
  // parallel over tp (tp > 1), keeps this rank's pipeline stages (pp > 1),
  // installs activation checkpointing, then data parallel (zero_stage 0) or
  // sharding (1-3) over dp x fsdp, and resumes from the latest checkpoint when
  // config.resume and one exists. Installs the counting allocator and, with
  // memory.limit_mb, the per-rank limit (until destruction).
  Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> world);
  ~Trainer();

  StepResult step();
  double evaluate();                     // validation loss, averaged over ranks
  void save_checkpoint();                // collective; rank 0 writes
  // Runs to config.steps with progress lines, metrics, validation and checkpoints;
  // prints a generated sample at the end. Output only on rank 0.
  void run();

  int64_t completed_steps() const { return step_; }
  bool resumed() const { return resumed_; }
  // The model as the parallel layer left it: with zero_stage 3 its parameters
  // have no storage between steps; use full_parameters().
  model::Gpt& model() { return model_; }
  const parallel::DataParallel& data_parallel() const { return *data_parallel_; }
  parallel::FullySharded* sharded() { return sharded_.get(); }
  parallel::TensorParallel* tensor_parallel() { return tensor_parallel_.get(); }
  // pp > 1: the executor (its spans and stash count from the last step) and
  // every stage of the pipeline, in order.
  const parallel::pipeline::PipelineExecutor* pipeline() const { return executor_.get(); }
  const std::vector<parallel::pipeline::StageSpec>& stages() const { return stages_; }
  const mesh::DeviceMesh& mesh() const { return *mesh_; }
  // Every parameter, unsharded, fp32, by name, on every rank (root -1) or at
  // least on world rank `root`. Collective.
  std::map<std::string, at::Tensor> full_parameters(int root = -1);
  const TrainConfig& config() const { return config_; }
  std::string model_fingerprint() const;
  // One rank's fp32 matmul rate (FLOP/s), measured at construction.
  double peak_flops_per_rank() const { return peak_flops_; }
  // Model FLOPs utilisation at `tokens_per_second` over all ranks.
  double mfu(double tokens_per_second) const;

 private:
  void load_checkpoint(const std::string& folder);
  // What a checkpoint's per-rank files need to load ("" for plain data parallel).
  std::string layout() const;
  std::string shard_file() const;  // this rank's file in a checkpoint
  void log_metrics(const StepResult& result, std::optional<double> val_loss, double tokens_per_second);
  void apply_pipeline();
  // pp > 1: runs `schedule` over micro-batches `inputs`/`targets`; the loss
  // summed over them on the last stage, 0 elsewhere.
  double run_pipeline(const parallel::pipeline::Schedule& schedule, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& targets, double scale);
  void write_trace();
  // The gradient of a tied embedding summed over its first- and last-stage copies.
  void sum_tied_embedding_gradient();

  TrainConfig config_;
  std::shared_ptr<comm::Communicator> world_;
  std::unique_ptr<mesh::DeviceMesh> mesh_;   // pp x dp x fsdp x tp
  std::shared_ptr<comm::Communicator> data_;  // this rank's dp x fsdp group: ranks reading different data
  std::unique_ptr<TokenFile> train_file_, val_file_;
  std::unique_ptr<Sampler> train_sampler_, val_sampler_;
  model::Gpt model_{nullptr};
  std::unique_ptr<parallel::DataParallel> data_parallel_;  // zero_stage 0
  std::unique_ptr<torch::optim::AdamW> optimizer_;         // zero_stage 0
  std::unique_ptr<parallel::TensorParallel> tensor_parallel_;  // tp > 1
  std::unique_ptr<parallel::FullySharded> sharded_;        // zero_stage 1-3
  std::shared_ptr<parallel::ActivationCheckpoint> checkpointing_;
  parallel::ModelParallelNorm model_parallel_;  // tp and pp groups of the gradient norm
  // Pipeline (pp > 1): the pp axis; the first and last stage when they share a
  // tied embedding; every stage and this rank's; the schedules.
  std::shared_ptr<comm::Communicator> pipeline_, embedding_;
  std::vector<parallel::pipeline::StageSpec> stages_;
  std::vector<int> local_stages_;
  parallel::pipeline::Schedule schedule_;
  std::unique_ptr<parallel::pipeline::PipelineExecutor> executor_;
  // Every parameter of the whole model: name, shape, the pipeline rank holding it.
  struct ParameterHome {
    std::string name;
    std::vector<int64_t> shape;
    int pipeline_rank;
  };
  std::vector<ParameterHome> homes_;
  int64_t previous_limit_ = 0;
  CheckpointStore checkpoints_;
  int64_t step_ = 0;
  int64_t cursor_ = 0;
  bool resumed_ = false;
  double peak_flops_ = 0;
  std::ofstream metrics_;
};

}  // namespace meshtrain::train
