// Sampling text from a trained model.
#pragma once

#include "meshtrain/model/gpt.h"

#include <vector>

namespace meshtrain::model {

struct SampleOptions {
  int64_t tokens = 200;
  double temperature = 0.8;  // >= 0; 0: greedy (the likeliest token)
  int64_t top_k = 40;        // 0: the whole vocabulary
  uint64_t seed = 1;
  bool kv_cache = true;      // keys and values kept (Note [KV cache]); false: every step a full forward
};

// Extends `prompt` (int64 token ids, 1-D) by options.tokens sampled tokens and
// returns only the new ones. Deterministic for a seed.
at::Tensor generate(Gpt& model, const at::Tensor& prompt, const SampleOptions& options);

// Several prompts of any lengths in one batch (left-padded, with the KV
// cache): each result equals generate() of that prompt alone with the same
// options (its own generator from options.seed). Prompt and new tokens must
// fit the context. Returns the new tokens of each.
std::vector<at::Tensor> generate_batch(Gpt& model, const std::vector<at::Tensor>& prompts, const SampleOptions& options);

}  // namespace meshtrain::model
