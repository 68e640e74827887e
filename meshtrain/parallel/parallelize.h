// parallelize: the one place that applies the parallelisms of a ParallelSpec
// to a model, in the order of Note [Apply order], returning the model and the
// pieces a step engine drives (step_engine.h).
#pragma once

#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/model/lora.h"
#include "meshtrain/parallel/activation_checkpoint.h"
#include "meshtrain/parallel/context_parallel.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/grad_norm.h"
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/parallel/pipeline/staged_model.h"
#include "meshtrain/parallel/random_streams.h"
#include "meshtrain/parallel/tensor_parallelism.h"

#include <memory>
#include <string>

namespace meshtrain::parallel {

struct ParallelizeOptions {
  ParallelSpec spec;             // checked by parallelize() for the world size and the model
  at::Device device = at::kCPU;  // where parameters, activations and optimizer states live
  uint64_t seed = 1337;          // of the random streams (Note [Random streams])
  int64_t micro_batch = 1;       // sequences per micro-batch
  int64_t microbatches = 1;      // per data rank per step (the pipeline's m)
  bool bfloat16_autocast = false;  // matmuls in bfloat16 (fp32 weights)
  AdamWSettings adamw;
  model::LoraConfig lora;  // rank > 0: adapters on a frozen model (Note [LoRA])
};

// What parallelize() made: the model as the techniques left it, and each
// technique that applies (null where it does not). Members are destroyed in
// reverse order: data parallelism first, the model last.
struct Parallelized {
  ParallelizeOptions options;  // the spec resolved and checked
  // The world wrapped for the device's tensors, the mesh pp x dp x fsdp x ep
  // x cp x tp over it, the ranks that read different micro-batches (dp x
  // fsdp x ep), and those whose gradients and losses are averaged: the data
  // ranks and their context-parallel peers (dp x fsdp x ep x cp).
  std::shared_ptr<comm::Communicator> world;
  std::shared_ptr<mesh::DeviceMesh> mesh;
  std::shared_ptr<comm::Communicator> data;
  std::shared_ptr<comm::Communicator> reduce;
  model::Gpt model{nullptr};
  // What data parallelism wraps: the model, or with annotations its parameters' local pieces.
  std::shared_ptr<torch::nn::Module> trained;
  std::unique_ptr<TensorParallelism> tensor;
  std::unique_ptr<ExpertParallel> experts;
  std::unique_ptr<pipeline::StagedModel> pipeline;
  std::unique_ptr<ContextParallel> context;
  std::shared_ptr<ActivationCheckpoint> checkpointing;
  std::unique_ptr<DataParallelism> data_parallelism;
  // How this rank's parameters relate to the whole model's (for the norm).
  ModelParallelNorm norm_groups;
  RandomStreams random;
  std::shared_ptr<model::ForwardHooks> lora;  // the adapters' hooks (LoRA)

  const ParallelSpec& spec() const { return options.spec; }
  DataParallel* data_parallel() const { return dynamic_cast<DataParallel*>(data_parallelism.get()); }
  FullySharded* sharded() const { return dynamic_cast<FullySharded*>(data_parallelism.get()); }
  // "ZeRO stage 3 over dp(1) x fsdp(4), 3 units, ... x tensor parallel tp(2) ..."
  std::string describe() const;
};

// Note [Apply order]
// parallelize() lays the ranks out as pp x dp x fsdp x ep x cp x tp and
// applies, in this order:
//   0. LoRA adapters (options.lora): registered under the targeted linears,
//      the rest frozen, their hooks innermost, so every technique below sees
//      adapters as parameters of the linears they adapt (model/lora.h);
//   1. tensor parallel (+ sequence parallel) over tp: parameters split in
//      place, collectives around the linears (tensor_parallel.h), or the
//      weights annotated (annotated_tensor_parallel.h);
//   2. expert parallel over ep: each rank keeps its share of every MoE
//      layer's experts, tokens travel by all-to-all (expert_parallel.h);
//   3. the pipeline stage split over pp: the model cut to this rank's stages,
//      the tied embedding kept by the first and last (pipeline/staged_model.h);
//   4. context parallel over cp: every block's attention core replaced by
//      attention across the cp group, on the heads tensor parallel left
//      (context_parallel.h); the step engine cuts each micro-batch to the
//      rank's rows;
//   5. activation checkpointing: after tensor and context parallel, so that
//      their collectives run again in the recompute (activation_checkpoint.h);
//   6. data parallel (zero_stage 0) or ZeRO-1/2/3 over dp x fsdp, the
//      gradients averaged over cp too, last: it sees the parameters as the
//      layers before left them (data_parallel.h, fully_sharded.h); frozen
//      ones take no gradient and no optimizer state.
// Each later step sees the model as the earlier ones left it; nothing else in
// meshtrain applies a parallelism to the trainer's model. The random streams
// are gathered last, from the default generators and tensor parallel's.
//
// Collective over `world`. Checks options.spec (ParallelSpec::check) for the
// world size and the model first; throws config::ConfigError as it does.
Parallelized parallelize(model::Gpt model, std::shared_ptr<comm::Communicator> world, const ParallelizeOptions& options);

}  // namespace meshtrain::parallel
