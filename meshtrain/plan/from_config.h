// The planner's view of a meshtrain training config: its model, workload and
// layout, so `meshtrain plan` answers for a config file and the tests compare
// the plan of a run with the run.
#pragma once

#include "meshtrain/plan/layout.h"
#include "meshtrain/model/gpt_config.h"
#include "meshtrain/train/config.h"

namespace meshtrain::plan {

struct PlannedRun {
  std::string name;  // the model's, as the planner prints it (the config's preset)
  model::GptConfig model;
  Workload workload;
  Layout layout;
  int64_t microbatches = 1;  // per data rank per step
};

// The preset `name` (model::GptConfig::preset_names()); throws
// std::invalid_argument("unknown model 'NAME': give a meshtrain config file (.toml) or a preset: ...").
model::GptConfig preset_model(const std::string& name);

// What runs where the model trains: the loss's chunk, whether the fused CPU
// operators run (model.fused, on the CPU, on plain tensors) and whether the
// norms are kernels (Workload::loss_chunk_bytes, fused_ops, norm_kernels).
void set_device_operators(Workload& workload, bool model_fused, bool gpu, bool annotated);

// The model and workload of `config` (layout left at its defaults); any config.
PlannedRun planned_model(const train::TrainConfig& config);
// ... and its layout: `config` validated (derived dp, fsdp and grad_accum filled in).
PlannedRun planned_run(const train::TrainConfig& config);

}  // namespace meshtrain::plan
