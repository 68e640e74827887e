// ModelShape: what the planner needs to know about a decoder-only transformer —
// its dimensions and which variant of each part it uses — for any model
// meshtrain can build (from a GptConfig) and for the published shapes it
// plans for but cannot train here (Llama-2/3, GPT-3 175B, a 1T GPT).
#pragma once

#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/parallel/parallel_spec.h"
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
  bool fused = true;            // model.fused: the fused CPU operators (what they save differs)
  // Mixture of experts (model/moe.h): blocks every-1, 2·every-1, ... replace
  // the MLP by a router and `experts` MLPs of `expert_ffn`, top_k per token.
  int64_t experts = 0;          // 0: dense
  int64_t moe_every = 1;
  int64_t top_k = 1;
  int64_t expert_ffn = 0;
  double capacity_factor = 0;   // 0: dropless

  // Every preset meshtrain can build (GptConfig presets) and the planning-only
  // shapes: llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b,
  // gpt3-175b, gpt-1t, mixtral-8x7b. Throws std::invalid_argument listing them for an unknown name.
  static ModelShape preset(const std::string& name);
  static std::vector<std::string> preset_names();
  static ModelShape from_config(const model::GptConfig& config, const std::string& name);

  mesh::ModelDims dims() const { return {layers, heads, kv_heads, ffn, vocab, seq, experts}; }
  bool moe() const { return experts > 0; }
  bool is_moe_block(int64_t i) const { return moe() && i % moe_every == moe_every - 1; }
  int64_t moe_blocks() const { return moe() ? layers / moe_every : 0; }
  // (token, expert) assignments one MoE layer computes for `tokens` tokens:
  // tokens x top_k x `load`, or with load 0 (a balanced router) x min(1, cf).
  double assignments(double tokens, double load = 0) const;
  int64_t head_dim() const { return width / heads; }
  int64_t kv_width() const { return kv_heads * head_dim(); }

  // Parameter counts by part; parameter_count() is their sum (tied head counted once).
  int64_t block_parameters() const;          // one dense transformer block
  int64_t block_split_parameters() const;    // of those, the ones tensor parallel splits
  int64_t mlp_parameters(int64_t hidden) const;  // one MLP of this style (weights and biases)
  int64_t moe_block_parameters() const;      // one MoE block: attention, norms, router, every expert
  int64_t expert_parameters() const { return experts * mlp_parameters(expert_ffn); }  // those expert parallel splits
  int64_t embedding_parameters() const;      // token (+ position) embedding
  int64_t head_parameters() const;           // final norm + untied LM head
  int64_t parameter_count() const;
  int64_t active_parameter_count() const;    // those a token uses: top_k experts per MoE block

  // Training FLOPs for one sequence of `seq` tokens: forward + backward, 6
  // per weight of every matrix multiply (the LM head included) and the
  // attention's scores and weighted values, 12·seq·width per token and layer.
  double block_training_flops() const;  // one dense block
  double block_training_flops(int64_t i) const;  // block i (MoE: the router and top_k experts)
  double head_training_flops() const;   // the LM head
  double training_flops_per_sequence() const;
  // The forward work recompute repeats in one block: "selective" the
  // attention core (4·seq·width per token), "full" the block's forward.
  double block_recompute_flops(parallel::CheckpointMode recompute) const;

  // "gpt2-124m: 124.4M parameters, 12 layers, h 768, 12 heads, ffn 3072, vocab 50257, seq 1024"
  // (+ ", 8 experts top-2 every block, 12.9B active" with experts)
  std::string describe() const;
};

}  // namespace meshtrain::plan
