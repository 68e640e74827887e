// GptConfig: the shape of a GPT-family decoder, its named presets, and the
// parameter count and training FLOPs that follow from the shape alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::model {

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t context = 128;  // maximum sequence length
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;    // model dimension
  double dropout = 0.0;
  // GPT-2 style by default; Llama style is rmsnorm + rope + swiglu + untied head.
  std::string norm = "layernorm";      // "layernorm" | "rmsnorm"
  std::string position = "learned";    // "learned" | "rope"
  std::string mlp = "gelu";            // "gelu" (4·width hidden) | "swiglu" (hidden below)
  bool tie_embeddings = true;          // the LM head shares the token embedding
  bool bias = true;                    // biases in linear layers and norms (GPT-2 has them)
  // Grouped-query attention (Llama 2/3): key/value heads, each shared by
  // heads / kv_heads query heads; 0: as many as heads (multi-head attention).
  int64_t kv_heads = 0;
  int64_t ffn_hidden = 0;              // the MLP's hidden size; 0: the default for mlp (below)
  double rope_theta = 10000.0;         // rotary base (Llama 3: 500000)
  double norm_eps = 1e-5;              // epsilon of layernorm / rmsnorm
  // The fused CPU operators (model/fused/ops.h) where the tensors allow;
  // false: the reference composition of ATen operators everywhere.
  bool fused = true;

  // Mixture of experts (model/moe.h): the feed-forward of every moe_every-th
  // block (blocks moe_every-1, 2·moe_every-1, ...) is moe_experts experts of
  // the MLP's style, moe_top_k of them per token (1: Switch, 2: GShard).
  int64_t moe_experts = 0;             // 0: dense
  int64_t moe_every = 2;
  int64_t moe_top_k = 1;
  double moe_capacity_factor = 1.25;   // capacity = ceil(tokens·top_k·cf / experts); 0: dropless
  std::string moe_second_expert = "random";  // top_k 2: "random" (GShard: kept with probability min(1, 2·gate)) | "always"
  double moe_aux_loss = 0.01;          // Switch load balancing: α·E·Σ fᵢ·Pᵢ
  double moe_z_loss = 0.001;           // router z-loss: β·mean(logsumexp(logits)²)
  int64_t moe_hidden = 0;              // an expert's hidden size; 0: the dense MLP's

  // Named shapes: tiny, small, llama-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b.
  static GptConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Throws std::invalid_argument naming the field, the value and what is allowed.
  void validate() const;

  int64_t head_dim() const { return width / heads; }
  int64_t key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  bool grouped_query() const { return key_value_heads() != heads; }
  int64_t qkv_width() const { return width + 2 * key_value_heads() * head_dim(); }  // the fused qkv's outputs
  // ffn_hidden, else gelu: 4·width; swiglu: 8/3·width rounded up to a multiple of 64.
  int64_t mlp_hidden() const;
  bool moe() const { return moe_experts > 0; }
  bool is_moe_block(int64_t i) const { return moe() && i % moe_every == moe_every - 1; }
  int64_t moe_blocks() const { return moe() ? layers / moe_every : 0; }
  int64_t expert_hidden() const { return moe_hidden > 0 ? moe_hidden : mlp_hidden(); }
  // Exact number of trainable parameters (tied embeddings counted once; every expert).
  int64_t parameter_count() const;
  // Those a token uses: with experts, moe_top_k experts per MoE block instead of all.
  int64_t active_parameter_count() const;
  // Training FLOPs per token at full context: 6·N_matmul + 12·layers·context·width for
  // attention scores and values (forward 2, backward 4 per multiply-add), where
  // N_matmul counts the weights used in matrix multiplies (the embedding lookups are
  // not multiplies; the LM head is). MoE blocks count top_k experts and the router.
  double flops_per_token() const;
};

}  // namespace meshtrain::model
