// Hugging Face transformers checkpoints (config.json + safetensors, sharded
// with an index) to and from meshtrain's model, for GPT-2 and Llama.
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace meshtrain::interop {

// Note [Hugging Face layouts]
// GPT-2 (GPT2LMHeadModel): Conv1D weights are stored [in, out], the
// transpose of a Linear's; c_attn is q, k and v fused like meshtrain's qkv;
// the GELU is the tanh approximation ("gelu_new"); names may carry a
// "transformer." prefix. Llama (LlamaForCausalLM): separate q/k/v/o, gate/up/
// down projections, RMSNorm, no biases; rotary embeddings rotate pairs
// (i, i + d/2) ("rotate_half"), as meshtrain's do, so q and k need no
// permutation; grouped-query k and v go into the fused qkv by group (Note
// [Grouped-query layout]). Anything these two architectures cannot express
// (rope scaling, biases in Llama, another activation) is refused by name.
struct HfModel {
  std::string model_type;                      // "gpt2" | "llama"
  model::GptConfig config;
  std::map<std::string, at::Tensor> weights;  // meshtrain parameter names, float32
};

// Reads DIR/config.json and DIR/model.safetensors or the shards that
// DIR/model.safetensors.index.json lists. Throws FormatError naming the file,
// the key or the tensor.
HfModel read_hf_model(const std::string& dir);
// DIR/config.json alone: the model (no weights read).
HfModel read_hf_config(const std::string& dir);

// Writes config.json and model.safetensors (or model-0000k-of-0000n.safetensors
// shards of at most max_shard_bytes with model.safetensors.index.json) in
// `dtype`. `weights` by meshtrain parameter name. Throws FormatError when the
// model has no Hugging Face equivalent (saying which setting).
void write_hf_model(const std::string& dir, const model::GptConfig& config,
                    const std::map<std::string, at::Tensor>& weights, at::ScalarType dtype, int64_t max_shard_bytes);

}  // namespace meshtrain::interop
