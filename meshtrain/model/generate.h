// Sampling text from a trained model.
#pragma once

#include "meshtrain/model/gpt.h"

#include <functional>
#include <vector>

namespace meshtrain::model {

// Note [Safe sampling]
// pick_next never fails for a setting validate() accepts and finite logits:
// a temperature below kGreedyBelow is greedy (dividing by it would overflow
// the logits; vLLM does the same below 1e-2); nucleus sampling always keeps
// the likeliest token, however small top_p; logits are shifted by their
// maximum before the temperature divides them. Ids outside `sampleable`
// (a model's padded vocabulary rows, ids its tokenizer cannot decode) are
// never picked, greedy or not. Non-finite logits are a model failure: the
// row's generation throws, and a server fails that request alone.
constexpr double kGreedyBelow = 1e-2;

struct SampleOptions {
  int64_t tokens = 200;      // the most new tokens (max_tokens)
  double temperature = 0.8;  // >= 0; 0 (or below kGreedyBelow): greedy (the likeliest token)
  int64_t top_k = 40;        // 0: the whole vocabulary
  double top_p = 1.0;        // (0, 1]: sample among the likeliest tokens whose probabilities sum to top_p (nucleus)
  uint64_t seed = 1;
  bool kv_cache = true;      // keys and values kept (Note [KV cache]); false: every step a full forward
  // Called with each new token; returning false ends the generation there
  // (a stop string was seen, the client went away).
  std::function<bool(int64_t token)> on_token;
  // The last position's logits [B, V'] -> [B, vocab]: tensor parallel gathers
  // a vocabulary split over ranks. Unset: the model's logits are whole.
  std::function<at::Tensor(const at::Tensor&)> full_vocabulary;
  // Where the KV cache keeps keys and values (KvCache::set_storage; unset: the device).
  std::function<at::Tensor(at::IntArrayRef, const at::TensorOptions&)> kv_storage;
  // Which ids may be picked: bool [vocab] (undefined: all).
  at::Tensor sampleable;

  // Throws std::invalid_argument naming the option that is out of range.
  void validate() const;
};

// The next token of each row from logits [B, vocab], by the options'
// temperature, top-k and top-p, drawing from `generator`: [B, 1] (Note [Safe
// sampling]). Throws std::runtime_error when a row's logits are not finite.
at::Tensor pick_next(at::Tensor logits, const SampleOptions& options, at::Generator& generator);

// Note [Decode loop]
// One loop samples every generation but the server's: a Decoder says where
// the keys and values live and gives the logits after the prompt, then after
// each batch of new tokens; the loop samples each row with its own generator
// (seeded alike from options.seed), gathers a split vocabulary, and stops at
// options.tokens or when on_token says so. The decoders: one sequence with a
// KV cache that rolls in windowed blocks (and a full forward over the last
// `context` tokens once the sequence outgrows it, or without a cache),
// left-padded prompts in one batch, and the cache split over a
// context-parallel group (parallel/context_parallel_generate.h). The server's
// batch engine keeps a loop of its own (docs/inference.md says why).
class Decoder {
 public:
  virtual ~Decoder() = default;
  // The last position's logits [B, V'] after the prompts.
  virtual at::Tensor prefill(Gpt& model) = 0;
  // The logits [B, V'] after `tokens` [B, 1], the newest of each row.
  virtual at::Tensor next(Gpt& model, const at::Tensor& tokens) = 0;
};
// The new tokens of each of `rows` rows: up to options.tokens each (Note [Decode loop]).
std::vector<at::Tensor> decode(Gpt& model, Decoder& decoder, int64_t rows, const SampleOptions& options);

// Extends `prompt` (int64 token ids, 1-D) by up to options.tokens sampled
// tokens and returns only the new ones. Deterministic for a seed.
at::Tensor generate(Gpt& model, const at::Tensor& prompt, const SampleOptions& options);

// Several prompts of any lengths in one batch (left-padded, with the KV
// cache): each result equals generate() of that prompt alone with the same
// options (its own generator from options.seed). Prompt and new tokens must
// fit the context. Returns the new tokens of each.
std::vector<at::Tensor> generate_batch(Gpt& model, const std::vector<at::Tensor>& prompts, const SampleOptions& options);

}  // namespace meshtrain::model
