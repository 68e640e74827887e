// ModelShape: what the planner needs to know about a decoder-only transformer —
// its dimensions and which variant of each part it uses — for any model
// meshtrain can build (from a GptConfig) and for the published shapes it
// plans for but cannot train here (Llama-2/3, GPT-3 175B, a 1T GPT).
#pragma once

#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::plan {

struct ModelShape {
  std::string name;
  int64_t vocab = 0;
  int64_t seq = 0;       // sequence length trained on (the model's context)
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;  // grouped-query attention: key/value heads (= heads without it)
  int64_t width = 0;     // h
  int64_t ffn = 0;       // hidden size of the MLP
  bool gated_mlp = false;       // SwiGLU (three matrices) instead of GELU (two)
  bool rms_norm = false;        // RMSNorm (a scale) instead of LayerNorm (scale + shift)
  bool bias = true;             // biases in linear layers and norms
  bool tied_head = true;        // the LM head is the token embedding
  bool learned_positions = true;  // a position embedding table (GPT) instead of RoPE

  // Every preset meshtrain can build (GptConfig presets) and the planning-only
  // shapes: llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b,
  // gpt3-175b, gpt-1t. Throws std::invalid_argument listing them for an unknown name.
  static ModelShape preset(const std::string& name);
  static std::vector<std::string> preset_names();
  static ModelShape from_config(const model::GptConfig& config, const std::string& name);

  mesh::ModelDims dims() const { return {layers, heads, kv_heads, ffn, vocab, seq}; }
  int64_t head_dim() const { return width / heads; }
  int64_t kv_width() const { return kv_heads * head_dim(); }

  // Parameter counts by part; parameter_count() is their sum (tied head counted once).
  int64_t block_parameters() const;          // one transformer block
  int64_t block_split_parameters() const;    // of those, the ones tensor parallel splits
  int64_t embedding_parameters() const;      // token (+ position) embedding
  int64_t head_parameters() const;           // final norm + untied LM head
  int64_t parameter_count() const;

  // Training FLOPs for one sequence of `seq` tokens: forward + backward, 6
  // per weight of every matrix multiply (the LM head included) and the
  // attention's scores and weighted values, 12·seq·width per token and layer.
  double block_training_flops() const;  // one block
  double head_training_flops() const;   // the LM head
  double training_flops_per_sequence() const { return layers * block_training_flops() + head_training_flops(); }
  // The forward work recompute repeats in one block: "selective" the
  // attention core (4·seq·width per token), "full" the block's forward.
  double block_recompute_flops(const std::string& recompute) const;

  // "gpt2-124m: 124.4M parameters, 12 layers, h 768, 12 heads, ffn 3072, vocab 50257, seq 1024"
  std::string describe() const;
};

}  // namespace meshtrain::plan
