// TrainConfig: everything a training run is told, from a TOML file
// (torchtitan style sections) plus --section.key=value overrides, checked
// before any work starts.
#pragma once

#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt_config.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::train {

// A config error: names the key, the value and what is allowed.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct TrainConfig {
  // [model]
  std::string preset = "small";
  model::GptConfig model = model::GptConfig::preset("small");  // preset + overrides
  // [data]
  std::vector<std::string> text{"/usr/share/common-licenses"};  // prepared into out/data when no token files
  std::string train_file;  // token files (meshtrain prepare); override `text` when set
  std::string val_file;
  double val_fraction = 0.1;
  std::string tokenizer = "bytes";  // text::load_tokenizer's spec
  // [training]
  int64_t steps = 100;
  int64_t batch = 16;        // global batch, sequences per optimizer step
  int64_t micro_batch = 8;   // sequences per forward/backward on one rank
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;    // global-norm clipping; 0 disables
  uint64_t seed = 1337;
  std::string dtype = "float32";  // "float32" | "bfloat16" (autocast)
  int64_t eval_every = 25;   // 0: only at the end
  int64_t eval_batches = 4;  // micro-batches of validation data per rank
  int64_t log_every = 1;
  int64_t sample_tokens = 300;  // generated at the end of training (0: none)
  // [parallel]
  // Degrees (pp, dp, fsdp, tp; dp and fsdp 0: derived), sequence parallel,
  // ZeRO stage, schedule and virtual stages; the layout rules live there.
  mesh::ParallelDims parallel;
  int64_t microbatches = 0;  // per data rank per step; 0: batch / (micro_batch x dp x fsdp)
  std::string pp_split = "params";  // "params" | "time" (balanced) | "3,3,2" (blocks per stage)
  std::string activation_checkpoint = "none";  // "none" | "full" | "selective"
  int64_t activation_checkpoint_every = 1;     // every k-th block
  int64_t bucket_mb = 25;
  std::string unit_policy = "block";  // fully sharded units: "block" or "model"
  bool prefetch = true;
  bool reshard_after_forward = true;
  std::string param_dtype = "float32";   // zero_stage >= 1: dtype of forward/backward
  std::string reduce_dtype = "float32";  // zero_stage >= 1: dtype of gradient reductions
  std::string zero1_reduce = "all_reduce";  // zero_stage 1: "all_reduce" (then slice) or "reduce_scatter"
  std::string tp_impl = "plan";  // tensor parallel: "plan" (hand-written layers) or "annotations" (weights annotated)
  // [offload] ZeRO-Offload / ZeRO-Infinity (parallel/fsdp/offloaded_adamw.h)
  std::string offload_optimizer = "none";  // "none" | "cpu" | "nvme": fp32 masters + AdamW moments, step on the CPU
  std::string offload_params = "none";     // "none" | "cpu" | "nvme": zero_stage 3's parameter shards
  std::string offload_nvme_dir;            // default: <run.out>/nvme
  std::string nvme_dir() const { return offload_nvme_dir.empty() ? out + "/nvme" : offload_nvme_dir; }
  // [memory]
  int64_t memory_limit_mb = 0;  // per-rank limit on counted CPU tensor memory; 0: none
  // [checkpoint]
  std::string checkpoint_dir;  // default: out/checkpoints
  int64_t checkpoint_every = 50;  // steps between checkpoints; 0: only at the end
  bool checkpoint_async = true;   // write in the background from a host snapshot
  int64_t checkpoint_keep = 2;
  bool resume = true;          // continue from the latest checkpoint when there is one
  // [run]
  std::string device = "cpu";  // "cpu" | "cuda" | "cuda:N" | "auto" (cuda:local_rank % GPUs when there are GPUs)
  std::string out = "runs/default";  // metrics.jsonl, prepared data, checkpoints
  std::string sharding_report;  // tp_impl "annotations": the first step's operators and collectives, as JSON lines
  int64_t trace_step = 0;  // pp > 1: write out/trace.json and out/timeline.svg of this step (0: none)

  // Derived, after validate(world_size).
  int64_t grad_accum = 1;  // micro-batches per data rank per step (the pipeline's m when pp > 1)
  int64_t data_ranks() const { return parallel.data_ranks(); }  // ranks that each read their own micro-batches

  // Loads `path` (empty: defaults only), then applies overrides ("section.key=value").
  // The torch device `device` names for a rank whose node-local rank is `local_rank`.
  at::Device torch_device(int local_rank) const;
  static TrainConfig load(const std::string& path, const std::vector<std::string>& overrides);
  // Checks the values against each other and the world size; fills derived fields.
  void validate(int world_size);
  std::string checkpoint_path() const;
  // One line per key: "[section] key = default   help".
  static std::string describe_keys();
};

// The model shape as JSON (stored in checkpoints) and back.
std::string model_config_to_json(const model::GptConfig& config);
model::GptConfig model_config_from_json(const std::string& text);
// The model's shape in one line, recorded in checkpoints and checked on resume.
std::string model_fingerprint(const model::GptConfig& config);

}  // namespace meshtrain::train
