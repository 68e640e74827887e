#include "meshtrain/plan/from_config.h"

#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/ops.h"

#include <stdexcept>

namespace meshtrain::plan {

model::GptConfig preset_model(const std::string& name) {
  for (const std::string& preset : model::GptConfig::preset_names()) {
    if (preset == name) return model::GptConfig::preset(name);
  }
  std::string names;
  for (const auto& n : model::GptConfig::preset_names()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model '" + name + "': give a meshtrain config file (.toml) or a preset: " + names);
}

void set_device_operators(Workload& workload, bool model_fused, bool gpu, bool annotated) {
  workload.gpu = gpu;
  workload.loss_chunk_bytes = static_cast<double>(model::loss_chunk_bytes(gpu));
  workload.fused_ops = model_fused && !gpu && !annotated;
  workload.norm_kernels = workload.fused_ops || gpu;  // model/gpt.cpp NormImpl::forward
}

PlannedRun planned_model(const train::TrainConfig& config) {
  PlannedRun run;
  run.name = config.preset;
  run.model = config.model;
  run.workload.global_batch = config.batch;
  // meshtrain keeps fp32 parameters and optimizer states; bfloat16 autocast
  // changes the products' activations and keeps 16-bit copies of the weights, not the states.
  run.workload.precision = Precision::parse(config.bfloat16() ? "bf16-autocast" : "fp32");
  run.workload.dropout = config.model.dropout;
  run.workload.prefetch = config.parallel.prefetch;
  run.workload.lora = config.lora;
  const bool gpu = config.device != "cpu";
  // libtorch's fused attention on the CPU has no dropout; with dropout it falls back to the math kernel.
  // On CUDA the memory-efficient kernel takes dropout, and dropout keeps byte masks.
  // The fused operators' batched attention keeps contiguous q, k, v and its softmax (Note [CPU attention]).
  const bool bf16 = config.bfloat16() || config.parallel.param_dtype == at::kBFloat16;
  // Windows, scales and soft-caps take the fused path where it applies (a soft-cap's backward computes
  // the scores again, one block at a time); elsewhere a soft-capped attention goes through ATen's ops
  // and keeps its scores (Note [Attention variants]).
  run.workload.bf16_attention = bf16;
  const bool capped = config.model.attn_softcap > 0;
  const bool batched = config.model.fused && !config.parallel.annotated() &&
                       model::fused::batched_attention_applies(!gpu, config.model.context, config.model.head_dim(),
                                                               config.model.dropout);
  const bool math = (config.model.dropout > 0 && !gpu) || (capped && !batched);
  run.workload.attention = batched ? "batched" : math ? "math" : "flash";
  set_device_operators(run.workload, config.model.fused, gpu, config.parallel.annotated());
  run.workload.fused_loss = run.workload.fused_ops;
  run.workload.chunked_loss = config.model.chunked_loss && !config.parallel.annotated();
  if (gpu) run.workload.precision.mask = 1;
  return run;
}

PlannedRun planned_run(const train::TrainConfig& config) {
  PlannedRun run = planned_model(config);
  Layout& l = run.layout;
  l = Layout(config.parallel, config.micro_batch);
  run.microbatches = config.grad_accum;
  if (config.parallel.activation_checkpoint != parallel::CheckpointMode::kNone &&
      config.parallel.activation_checkpoint_every != 1) {
    throw std::invalid_argument("the planner models checkpointing of every block only (activation_checkpoint_every = 1)");
  }
  return run;
}

}  // namespace meshtrain::plan
