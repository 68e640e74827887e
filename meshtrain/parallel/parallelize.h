// parallelize: the one place that applies the parallelisms to a model, in the
// order of Note [Apply order], and the ParallelModel the training loop drives.
#pragma once

#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/activation_checkpoint.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/pipeline/staged_model.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/placement/state_tensor.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

class AnnotatedTensorParallel;

// The sizes of `config` the layout rules check (mesh/parallel_dims.h).
mesh::ModelDims model_dims(const model::GptConfig& config);

struct ParallelizeOptions {
  mesh::ParallelDims dims;       // resolved for the world size
  int64_t microbatches = 1;      // per data rank per step (the pipeline's m)
  int64_t micro_batch = 1;       // sequences per micro-batch
  uint64_t seed = 1337;          // of tensor parallel's per-rank random streams
  bool bfloat16_autocast = false;  // matmuls in bfloat16 (fp32 weights)
  // Where parameters, activations and optimizer states live. The model is
  // moved there first; a CPU `world` is then wrapped for that device's tensors
  // (comm::device_communicator: NCCL, or MPI staged through the host).
  at::Device device = at::kCPU;
  // Pipeline
  std::string pp_split = "params";
  // Activation checkpointing
  std::string activation_checkpoint = "none";
  int64_t activation_checkpoint_every = 1;
  // Data parallel (zero_stage 0) and sharding (1-3)
  int64_t bucket_mb = 25;
  std::string unit_policy = "block";  // "block" | "model"
  bool prefetch = true;
  bool reshard_after_forward = true;
  std::string param_dtype = "float32";
  std::string reduce_dtype = "float32";
  std::string zero1_reduce = "all_reduce";
  // ZeRO-Offload / ZeRO-Infinity (zero_stage >= 1): "none" | "cpu" | "nvme".
  std::string offload_optimizer = "none";
  std::string offload_params = "none";
  std::string nvme_dir = "/tmp";
  AdamWSettings adamw;
  // Tensor parallel: "plan" (the hand-written layers, tensor_parallel.h) or
  // "annotations" (weights annotated, the rest by completion: annotated_tensor_parallel.h).
  std::string tp_impl = "plan";
};

// Note [Apply order]
// parallelize() lays the ranks out as pp x dp x fsdp x ep x tp and applies, in
// this order:
//   1. tensor parallel (+ sequence parallel) over tp: parameters split in
//      place, collectives around the linears (tensor_parallel.h);
//   2. expert parallel over ep: each rank keeps its share of every MoE
//      layer's experts, tokens travel by all-to-all (expert_parallel.h);
//   3. the pipeline stage split over pp: the model cut to this rank's stages,
//      the tied embedding kept by the first and last (pipeline/staged_model.h);
//   4. activation checkpointing: after tensor parallel, so that its
//      collectives run again in the recompute (activation_checkpoint.h);
//   5. data parallel (zero_stage 0) or ZeRO-1/2/3 over dp x fsdp, last: it
//      sees the parameters as the layers before left them (data_parallel.h,
//      fully_sharded.h).
// Each later step sees the model as the earlier ones left it; nothing else in
// meshtrain applies a parallelism to the trainer's model.
class ParallelModel {
 public:
  ParallelModel(model::Gpt model, std::shared_ptr<comm::Communicator> world, const ParallelizeOptions& options);
  ~ParallelModel();

  // One step's forward and backward over this rank's micro-batches (tokens
  // and targets [micro_batch, context]), each micro-batch's loss divided by
  // their count. Returns the summed loss where it is computed (the last
  // pipeline stage; 0 elsewhere). Gradients are then reduced.
  double forward_backward(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  // The summed loss of evaluation micro-batches (no gradients).
  double evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  // The mean over data ranks of a per-rank loss sum `local` (taken from the
  // last pipeline stage; tensor-parallel ranks hold the same). Collective.
  double mean_loss(double local);
  void zero_grad();
  // Completes the gradients (a tied embedding's two copies summed), returns
  // the global norm and clips to `max_norm` (<= 0: none).
  double clip_grad_norm(double max_norm);
  void step(double lr);

  // What a checkpoint holds of this rank: parameters and AdamW moments
  // (placed), and the random streams ("rng/cpu", "rng/tensor_parallel": one
  // row per rank). Views of the live tensors. Collective-free.
  placement::TrainingState state();
  // After a load into state(): AdamW's step count, and the random streams
  // set from what was loaded into their entries (`random_streams`) or else
  // re-derived with reseed_random_streams.
  void after_load(int64_t optimizer_steps, bool random_streams);
  // Sets the random streams to what a fresh run would draw at `step` (when a
  // checkpoint from another layout cannot give this rank's own).
  void reseed_random_streams(uint64_t seed, int64_t step);
  // Every parameter of the whole model, unsharded, fp32, by name, on world
  // rank `root` (-1: every rank). Collective.
  std::map<std::string, at::Tensor> full_parameters(int root = -1);

  // What the mixture-of-experts layers saw since the last call, per layer in
  // block order, averaged over their forwards and the ranks. Collective.
  std::vector<model::MoeLayerMetrics> moe_metrics();

  // "ZeRO stage 3 over dp(1) x fsdp(4), 3 units, ... x tensor parallel tp(2) ..."
  std::string describe() const;
  const mesh::ParallelDims& dims() const { return options_.dims; }
  const mesh::DeviceMesh& mesh() const { return *mesh_; }
  // dp x fsdp: the ranks that read different micro-batches.
  const std::shared_ptr<comm::Communicator>& data_comm() const { return data_; }
  model::Gpt& model() { return model_; }
  DataParallelism& data() { return *data_parallelism_; }
  DataParallel* data_parallel() { return data_parallel_; }
  FullySharded* sharded() { return sharded_; }
  TensorParallel* tensor_parallel() { return tensor_parallel_.get(); }
  AnnotatedTensorParallel* annotated() { return annotated_.get(); }
  ExpertParallel* expert_parallel() { return expert_parallel_.get(); }
  pipeline::StagedModel* pipeline() { return staged_.get(); }
  const pipeline::StagedModel* pipeline() const { return staged_.get(); }
  bool checkpointing() const { return checkpointing_ != nullptr; }

 private:
  void apply_tensor_parallel();
  void apply_expert_parallel();
  void apply_pipeline();
  // The auxiliary losses' share of the loss gradient (the main loss is divided by the micro-batches).
  void set_aux_loss_scale(double scale);
  void apply_activation_checkpointing();
  void apply_data_parallelism();
  // A parameter's placement over tp, and whether this rank saves it.
  ParameterLayout parameter_layout(const std::string& name, const at::Tensor& local) const;
  double run_pipeline(const pipeline::Schedule& schedule, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& targets, double scale);

  ParallelizeOptions options_;
  std::shared_ptr<comm::Communicator> world_;
  std::shared_ptr<mesh::DeviceMesh> mesh_;
  std::shared_ptr<comm::Communicator> data_;
  model::Gpt model_;
  std::unique_ptr<TensorParallel> tensor_parallel_;
  std::unique_ptr<AnnotatedTensorParallel> annotated_;
  std::unique_ptr<ExpertParallel> expert_parallel_;
  std::unique_ptr<pipeline::StagedModel> staged_;
  std::shared_ptr<ActivationCheckpoint> checkpointing_;
  ModelParallelNorm norm_groups_;
  std::unique_ptr<DataParallelism> data_parallelism_;
  DataParallel* data_parallel_ = nullptr;  // whichever data_parallelism_ is
  FullySharded* sharded_ = nullptr;
  // Copies of the random streams taken by state(), loaded into by a checkpoint.
  at::Tensor cpu_random_state_, cuda_random_state_, tp_random_state_;
};

// Applies every parallelism of `options` to `model` (see Note [Apply order]).
// Collective over `world`, whose size must be options.dims.world().
std::unique_ptr<ParallelModel> parallelize(model::Gpt model, std::shared_ptr<comm::Communicator> world,
                                           const ParallelizeOptions& options);

}  // namespace meshtrain::parallel
