// Megatron's tensor-parallel layout of model::Gpt written as annotations on
// its weights alone: completion (rules.cpp) derives the rest.
#pragma once

#include "meshtrain/annotate/annotate.h"
#include "meshtrain/model/gpt_config.h"

#include <vector>

namespace meshtrain::annotate {

// Over the mesh's "tp" axis: the token embedding (and an untied head) by
// vocabulary rows, qkv by heads (rows in 3 blocks), MLP in-projections by
// rows, out-projections by columns; everything else replicated. The batch
// goes over "dp" by annotating the input tokens (split(tokens, 0, dp)).
// Throws for what it does not cover (mixture-of-experts blocks) and for a
// head count tp does not divide; vocabulary and MLP sizes may split unevenly.
std::vector<ShardingRule> gpt_megatron_annotations(const model::GptConfig& config, const mesh::DeviceMesh& mesh);

}  // namespace meshtrain::annotate
