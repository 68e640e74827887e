// TrainConfig: everything a training run is told, from a TOML file
// (torchtitan style sections) plus --section.key=value overrides, checked
// before any work starts.
#pragma once

#include "meshtrain/model/gpt_config.h"
#include "meshtrain/model/lora.h"
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/train/data_options.h"
#include "meshtrain/util/config_keys.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::text {
class Tokenizer;
}  // namespace meshtrain::text

namespace meshtrain::train {

// A config error: names the key, the value and what is allowed.
using ConfigError = config::ConfigError;

// What a step whose loss or gradient norm is not finite does (Note [Non-finite steps]).
enum class OnNonfinite { kStop, kSkip };

// The model a checkpoint folder (its latest step, or a step folder) holds;
// throws ConfigError naming the folder (trainer_checkpoint.cpp).
model::GptConfig init_model(const std::string& checkpoint_dir);

// data.tokenizer's spec: text::load_tokenizer's, or "checkpoint:DIR", the
// tokenizer a checkpoint embeds (checkpoint.init_from's, unless
// data.tokenizer names another). Throws text::TokenizerError.
inline constexpr const char* kCheckpointTokenizer = "checkpoint:";
std::unique_ptr<text::Tokenizer> load_training_tokenizer(const std::string& spec);

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
  DataFormat data_format = DataFormat::kText;
  std::string field = "text";  // JSONL / Parquet: the field holding the text
  LossOn loss_on = LossOn::kAssistant;
  Packing packing = Packing::kConcat;
  int64_t split_mb = 64;  // prepare's unit of work (Note [Data units])
  // [[data.sources]]: a mixture, each source's files sampled in proportion to its weight.
  struct Source {
    std::vector<std::string> path;
    double weight = 1;
  };
  std::vector<Source> sources;
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
  at::ScalarType dtype = at::kFloat;  // float32, or bfloat16 (autocast of matmuls)
  int64_t eval_every = 25;   // 0: only at the end
  int64_t eval_batches = 4;  // micro-batches of validation data per rank
  int64_t log_every = 1;
  int64_t sample_tokens = 300;  // generated at the end of training (0: none)
  OnNonfinite on_nonfinite = OnNonfinite::kStop;  // a step with a non-finite loss or gradient norm
  int64_t max_nonfinite_skips = 3;                // on_nonfinite = skip: in a row, then stop
  // [parallel] and [offload]: the degrees, their layout rules and every
  // technique's options (parallel/parallel_spec.h).
  parallel::ParallelSpec parallel;
  // [lora]: adapters on a frozen model (Note [LoRA]); rank 0: none
  model::LoraConfig lora;
  // [memory]
  int64_t memory_limit_mb = 0;  // per-rank limit on counted CPU tensor memory; 0: none
  // [checkpoint]
  std::string checkpoint_dir;  // default: out/checkpoints
  std::string init_from;       // fine-tuning: a checkpoint whose model and weights start the run
  int64_t checkpoint_every = 50;  // steps between checkpoints; 0: only at the end
  bool checkpoint_async = true;   // write in the background from a host snapshot
  int64_t checkpoint_keep = 2;
  bool checkpoint_local = false;  // each host writes its ranks' files to its own disk (Note [Local checkpoints])
  double checkpoint_preempt_grace_s = 30;  // after a stop signal, until the scheduler's SIGKILL (Note [Preemption])
  bool resume = true;          // continue from the latest checkpoint when there is one
  // [run]
  std::string device = "cpu";  // "cpu" | "cuda" | "cuda:N" | "auto" (cuda:local_rank % GPUs when there are GPUs)
  std::string out = "runs/default";  // metrics.jsonl, prepared data, checkpoints
  std::string sharding_report;  // tp_impl "annotations": the first step's operators and collectives, as JSON lines
  int64_t trace_step = 0;  // pp > 1: write out/trace.json and out/timeline.svg of this step (0: none)

  // Derived, after validate(world_size).
  int64_t grad_accum = 1;  // micro-batches per data rank per step (the pipeline's m when pp > 1)
  int64_t data_ranks() const { return parallel.dims.data_ranks(); }  // ranks that each read their own micro-batches
  bool bfloat16() const { return dtype == at::kBFloat16; }
  // What the matmuls and parameters compute in and where (the rules that depend on it).
  parallel::Compute compute() const;
  std::string nvme_dir() const { return parallel.nvme_dir(out); }

  // Loads `path` (empty: defaults only), then applies overrides ("section.key=value").
  // The torch device `device` names for a rank whose node-local rank is `local_rank`.
  at::Device torch_device(int local_rank) const;
  static TrainConfig load(const std::string& path, const std::vector<std::string>& overrides);
  // Checks the values against each other and the world size; fills derived fields.
  void validate(int world_size);
  std::string checkpoint_path() const;
  // One line per key: "[section] key = default   help".
  static std::string describe_keys();
  // The config as a TOML file `train` reads back as the same config: [model]
  // as its preset and the keys that differ from it, every other section's keys
  // that differ from the defaults (`every_key`: all of them).
  std::string to_toml(bool every_key = false) const;
};

}  // namespace meshtrain::train
