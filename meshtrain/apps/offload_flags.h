// The --offload.* and --memory.limit_mb flags of the inference commands.
#pragma once

#include "meshtrain/apps/commands.h"
#include "meshtrain/serve/inference_model.h"

#include <CLI/CLI.hpp>

namespace meshtrain::apps {

void add_offload_flags(CLI::App& command, InferenceOffloadFlags& flags);
serve::InferenceOffload inference_offload(const InferenceOffloadFlags& flags);
// After the model is loaded (with the counting allocator installed before
// it, so that what stays resident is counted): the counting allocator holds the rank to
// memory_limit_mb (0: no limit) and its peaks start over. Returns a line for
// the log ("" without offload or limit).
std::string apply_memory_limit(const InferenceOffloadFlags& flags, const serve::InferenceModel& model);

}  // namespace meshtrain::apps
