// GptConfig: the shape of a GPT-family decoder, its named presets, and the
// parameter counts and training FLOPs that follow from the shape alone. It is
// the one description of a model: the layout rules (parallel::model_dims),
// the planner and the checkpoints all read it.
#pragma once

#include "meshtrain/util/config_keys.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::model {

// The choices among a model's parts, each read and written by its name (names(), name()).
enum class NormStyle { kLayerNorm, kRmsNorm };
enum class PositionStyle { kLearned, kRope };  // a position table (GPT-2), or rotary embeddings
enum class MlpStyle { kGelu, kSwiglu, kGeglu };
enum class QkNorm { kNone, kHead, kWidth };
enum class NormPlacement { kPre, kPost, kSandwich };
enum class RopeScaling { kNone, kLinear, kLlama3, kYarn };
enum class SecondExpert { kRandom, kAlways };

const config::Names<NormStyle>& names(NormStyle);          // "layernorm", "rmsnorm"
const config::Names<PositionStyle>& names(PositionStyle);  // "learned", "rope"
const config::Names<MlpStyle>& names(MlpStyle);            // "gelu", "swiglu", "geglu"
const config::Names<QkNorm>& names(QkNorm);                // "none", "head", "width"
const config::Names<NormPlacement>& names(NormPlacement);  // "pre", "post", "sandwich"
const config::Names<RopeScaling>& names(RopeScaling);      // "none", "linear", "llama3", "yarn"
const config::Names<SecondExpert>& names(SecondExpert);    // "random", "always"
template <typename E>
const std::string& name(E value) {
  return config::name_of(names(E{}), value);
}

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t context = 128;  // maximum sequence length
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;    // model dimension
  double dropout = 0.0;
  double init_std = 0.02;  // weights drawn from N(0, init_std²); residual projections / sqrt(2·layers)
  // GPT-2 style by default; Llama style is rmsnorm + rope + swiglu + untied head.
  NormStyle norm = NormStyle::kLayerNorm;
  PositionStyle position = PositionStyle::kLearned;
  MlpStyle mlp = MlpStyle::kGelu;      // gelu (4·width hidden) | swiglu | geglu (gated, tanh GELU: Gemma)
  bool tie_embeddings = true;          // the LM head shares the token embedding
  bool bias = true;                    // biases in linear layers and norms (GPT-2 has them)
  bool qkv_bias = false;               // biases on the q, k and v projections alone (Qwen2)
  // Grouped-query attention (Llama 2/3): key/value heads, each shared by
  // heads / kv_heads query heads; 0: as many as heads (multi-head attention).
  int64_t kv_heads = 0;
  int64_t ffn_hidden = 0;              // the MLP's hidden size; 0: the default for mlp (below)
  double rope_theta = 10000.0;         // rotary base (Llama 3: 500000)
  double norm_eps = 1e-5;              // epsilon of layernorm / rmsnorm

  // The families' variations (Note [Model families] in gpt_config.cpp).
  int64_t head_size = 0;               // q/k/v size per head; 0: width / heads (Qwen3, Gemma 2 set it)
  bool attention_bias = false;         // biases on q, k, v and the attention's output projection
  bool mlp_bias = false;               // biases on the MLP's projections
  QkNorm qk_norm = QkNorm::kNone;      // none | head: RMSNorm over each head's q and k before RoPE
                                       // (Qwen3) | width: over all of q and all of k (OLMo 2)
  NormPlacement norm_placement = NormPlacement::kPre;  // pre: x + f(norm(x)) | post: x + norm(f(x)) (OLMo 2)
                                                       // | sandwich: x + norm(f(norm(x))) (Gemma 2)
  bool norm_plus_one = false;          // RMSNorm scales by (1 + weight) (Gemma)
  bool embed_scale = false;            // token embeddings times sqrt(width) (Gemma)
  double attn_softcap = 0;             // attention scores c·tanh(s / c); 0: none (Gemma 2)
  double logit_softcap = 0;            // final logits c·tanh(z / c); 0: none (Gemma 2)
  double z_loss = 0;                   // β·mean(logsumexp(z)²) added to the training loss (PaLM: 1e-4); 0: none
  double query_scale = 0;              // scores scaled by 1/sqrt(query_scale); 0: 1/sqrt(head size)
  // Sliding-window attention: a token sees itself and the window - 1 before
  // it, in the blocks i with i % sliding_every == 0 (Mistral: 1; Gemma 2: 2);
  // 0: every block sees the whole context.
  int64_t sliding_window = 0;
  int64_t sliding_every = 1;
  // RoPE scaling (Note [RoPE scaling] in attention_variants.cpp): none | linear
  // (positions / factor) | llama3 (Llama 3.1: long wavelengths / factor,
  // smoothed between low and high frequency factors) | yarn.
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 1.0;
  int64_t rope_original_context = 0;   // the context before scaling (llama3, yarn)
  double rope_low_freq_factor = 1.0;   // llama3
  double rope_high_freq_factor = 4.0;  // llama3
  double rope_beta_fast = 32.0;        // yarn
  double rope_beta_slow = 1.0;         // yarn
  double rope_attention_factor = 0;    // yarn: cos and sin scaled by it; 0: 0.1·ln(factor) + 1
  double rotary_fraction = 1.0;        // the share of each head's dims RoPE rotates (the first ones)
  // The fused CPU operators (model/fused/ops.h) where the tensors allow;
  // false: the reference composition of ATen operators everywhere.
  bool fused = true;
  // The loss without the [tokens, vocabulary] logits (Note [Chunked loss]).
  bool chunked_loss = true;

  // Mixture of experts (model/moe.h): the feed-forward of every moe_every-th
  // block (blocks moe_every-1, 2·moe_every-1, ...) is moe_experts experts of
  // the MLP's style, moe_top_k of them per token (1: Switch, 2: GShard).
  int64_t moe_experts = 0;             // 0: dense
  int64_t moe_every = 2;
  int64_t moe_top_k = 1;
  double moe_capacity_factor = 1.25;   // capacity = ceil(tokens·top_k·cf / experts); 0: dropless
  SecondExpert moe_second_expert = SecondExpert::kRandom;  // top_k 2: random (GShard: kept with probability min(1, 2·gate)) | always
  double moe_aux_loss = 0.01;          // Switch load balancing: α·E·Σ fᵢ·Pᵢ
  double moe_z_loss = 0.001;           // router z-loss: β·mean(logsumexp(logits)²)
  int64_t moe_hidden = 0;              // an expert's hidden size; 0: the dense MLP's
  // top_k >= 2: the chosen gates renormalised to sum 1 (Mixtral, Qwen3-MoE's
  // norm_topk_prob) or kept as softmax probabilities (Qwen2-MoE).
  bool moe_norm_topk = true;
  // A shared expert every token passes through besides the routed ones, its
  // output times sigmoid(x·w) (Qwen2-MoE); 0: none.
  int64_t moe_shared_hidden = 0;

  // Named shapes: tiny, small, llama-tiny, gpt2-124m ... gpt2-1.5b, and the
  // published shapes of the open families (preset_names()). Throws
  // std::invalid_argument listing them.
  static GptConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Throws std::invalid_argument naming the field, the value and what is allowed.
  void validate() const;
  void validate_families() const;  // the keys of Note [Model families]

  int64_t head_dim() const { return head_size > 0 ? head_size : width / heads; }
  int64_t key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  bool grouped_query() const { return key_value_heads() != heads; }
  int64_t q_width() const { return heads * head_dim(); }               // the outputs of q; proj's inputs
  int64_t kv_width() const { return key_value_heads() * head_dim(); }  // the outputs of k (and of v)
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }     // the fused qkv's outputs
  bool qkv_has_bias() const { return bias || qkv_bias || attention_bias; }
  bool proj_has_bias() const { return bias || attention_bias; }
  bool mlp_has_bias() const { return bias || mlp_bias; }
  // The attention window of block i (0: the whole context).
  int64_t window_of(int64_t block) const { return sliding_window > 0 && block % sliding_every == 0 ? sliding_window : 0; }
  int64_t rotary_dims() const { return static_cast<int64_t>(rotary_fraction * static_cast<double>(head_dim()) + 1e-9) / 2 * 2; }
  // ffn_hidden, else gelu: 4·width; swiglu: 8/3·width rounded up to a multiple of 64.
  int64_t mlp_hidden() const;
  bool moe() const { return moe_experts > 0; }
  bool is_moe_block(int64_t i) const { return moe() && i % moe_every == moe_every - 1; }
  int64_t moe_blocks() const { return moe() ? layers / moe_every : 0; }
  int64_t expert_hidden() const { return moe_hidden > 0 ? moe_hidden : mlp_hidden(); }
  bool gated_mlp() const { return mlp != MlpStyle::kGelu; }  // three matrices instead of two
  int64_t norms_per_block() const { return norm_placement == NormPlacement::kSandwich ? 4 : 2; }
  int64_t qk_norm_parameters() const;  // per block
  bool rms_norm() const { return norm == NormStyle::kRmsNorm; }
  bool learned_positions() const { return position == PositionStyle::kLearned; }  // a position table (GPT) instead of RoPE
  // The open family this shape is: "gpt2" (layernorm, a position table), one of
  // the Llama-style model_types (rmsnorm, RoPE, no norm biases: "llama",
  // "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "phi3",
  // "olmo2"), or "" for a mix of the two.
  std::string family() const;

  // Parameter counts by part (Note [Model counts]); parameter_count() is
  // their sum, the tied head counted once, every expert counted.
  int64_t embedding_parameters() const;          // token (+ position) embedding
  int64_t block_parameters() const;              // one dense transformer block
  int64_t block_split_parameters() const;        // of those, the ones tensor parallel splits
  int64_t mlp_parameters(int64_t hidden) const;  // one MLP of this style and hidden size (weights and biases)
  int64_t moe_block_parameters() const;          // one MoE block: attention, norms, router, every expert
  int64_t expert_parameters() const;             // the experts of one MoE block (what expert parallel splits)
  int64_t head_parameters() const;               // final norm + untied LM head
  int64_t parameter_count() const;
  // Those a token uses: with experts, moe_top_k experts per MoE block instead of all.
  int64_t active_parameter_count() const;

  // Training FLOPs (forward + backward) of one sequence of `context` tokens:
  // 6 per weight of every matrix multiply per token (the LM head included, the
  // embedding lookups not) and 12·context·width per token and layer for the
  // attention's scores and weighted values. MoE blocks count the router and
  // moe_top_k experts.
  double block_training_flops(bool moe = false) const;  // a dense block, or a MoE block
  double head_training_flops() const;            // the LM head
  double training_flops_per_sequence() const;
  double flops_per_token() const { return training_flops_per_sequence() / static_cast<double>(context); }

  // "gpt2-124m: 124.4M parameters, 12 layers, h 768, 12 heads, ffn 3072 gelu, vocab 50257, seq 1024"
  // (+ ", 8 experts top-2 in every block, 12.88B active" with experts).
  std::string describe(const std::string& name) const;
};

}  // namespace meshtrain::model
