// meshtrain plan --auto: the search's fastest layout that fits, as a config file.
#pragma once

#include "meshtrain/plan/search.h"
#include "meshtrain/train/config.h"

#include <optional>
#include <string>

namespace meshtrain::apps {

// What the search was asked and found.
struct AutoPlanInput {
  std::string name;  // the model's name as the header says it
  bool preset = false;  // `name` is a preset (written as [model] preset)
  model::GptConfig model;
  plan::Workload workload;
  plan::Machine machine;
  plan::SearchResult result;
  std::optional<train::TrainConfig> source;  // the config file planned, kept but for the layout and batch
};

// Writes the fastest layout that fits to `path` as a train config: the model,
// the global batch and micro-batch, the layout's [parallel] and [offload]
// keys, bfloat16 for a bf16-autocast plan (--auto plans bf16-mixed as
// autocast, what train runs), and the source config's other keys;
// above it, as comments, the prediction, the runners-up and what makes each
// slower, and the closest layouts that do not fit. Returns the text. Throws
// std::invalid_argument when nothing fits, and config::ConfigError if train
// would refuse the layout.
std::string auto_plan(const AutoPlanInput& input, int64_t world, const std::string& path);

}  // namespace meshtrain::apps
