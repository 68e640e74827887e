#include "meshtrain/model/gpt_config_keys.h"

#include <type_traits>

namespace meshtrain::model {

namespace {

using config::Kind;
using config::Value;
using Stored = ModelKey::Stored;

void put(Value& v, int64_t x) { v.i = x; }
void put(Value& v, double x) { v.f = x; }
void put(Value& v, bool x) { v.b = x; }
void put(Value& v, const std::string& x) { v.s = x; }

// A key stored in the field `access(config)` returns, named `json` in the checkpoint ("": as in TOML); an
// enumeration is read and written by its names.
template <typename Access>
ModelKey entry(std::string name_in_toml, std::string help, Stored stored, std::string json, Access access) {
  using T = std::decay_t<decltype(access(std::declval<GptConfig&>()))>;
  const std::string stored_as = json.empty() ? name_in_toml : json;
  if constexpr (std::is_enum_v<T>) {
    return ModelKey{config::enum_key<GptConfig>("model", std::move(name_in_toml), std::move(help), names(T{}), access),
                    stored, stored_as,
                    [access](const GptConfig& c) {
                      Value v;
                      v.s = name(access(const_cast<GptConfig&>(c)));
                      return v;
                    },
                    "", false, true};
  } else {
    return ModelKey{config::key<GptConfig>("model", std::move(name_in_toml), std::move(help), access), stored,
                    stored_as,
                    [access](const GptConfig& c) {
                      Value v;
                      put(v, access(const_cast<GptConfig&>(c)));
                      return v;
                    },
                    "", false, true};
  }
}

// The key as Hugging Face's config.json names it (Note [Model keys]).
ModelKey hf(ModelKey k, std::string name, bool required) {
  k.hf = std::move(name);
  k.hf_required = required;
  return k;
}
// A key that shapes training, not what the model computes.
ModelKey training_only(ModelKey k) {
  k.computes = false;
  return k;
}

#define MESHTRAIN_MODEL_MEMBER(field) [](GptConfig& c) -> auto& { return c.field; }
#define MODEL_KEY(field, stored, help) entry(#field, help, Stored::stored, "", MESHTRAIN_MODEL_MEMBER(field))
#define EXPERT_KEY(field, json, stored, help) entry(#field, help, Stored::stored, json, MESHTRAIN_MODEL_MEMBER(field))

std::vector<ModelKey> build() {
  return {
      hf(MODEL_KEY(layers, kRequired, "transformer blocks"), "num_hidden_layers", true),
      hf(MODEL_KEY(heads, kRequired, "attention heads (must divide width)"), "num_attention_heads", true),
      hf(MODEL_KEY(width, kRequired, "model dimension"), "hidden_size", true),
      MODEL_KEY(kv_heads, kAlways, "key/value heads for grouped-query attention (0: as many as heads)"),
      MODEL_KEY(ffn_hidden, kAlways, "the MLP's hidden size (0: 4 x width for gelu, 8/3 x width for swiglu)"),
      MODEL_KEY(rope_theta, kAlways, "rotary position base"),
      hf(MODEL_KEY(norm_eps, kAlways, "epsilon of the norms"), "rms_norm_eps", false),
      MODEL_KEY(fused, kNotStored,
                "fused CPU kernels for norms, GELU/SwiGLU, RoPE, cross-entropy (false: reference ATen operators)"),
      MODEL_KEY(chunked_loss, kNotStored,
                "output projection and cross-entropy over chunks of rows: no [tokens, vocabulary] logits "
                "(false: the logits whole)"),
      hf(MODEL_KEY(context, kRequired, "sequence length in tokens"), "max_position_embeddings", true),
      hf(MODEL_KEY(vocab_size, kRequired, "vocabulary (the byte tokenizer needs 256)"), "vocab_size", true),
      training_only(MODEL_KEY(dropout, kRequired, "dropout probability")),
      training_only(hf(MODEL_KEY(init_std, kWhenSet, "standard deviation of the initial weights (residual projections: / sqrt(2 x layers))"), "initializer_range", false)),
      MODEL_KEY(norm, kRequired, "\"layernorm\" or \"rmsnorm\""),
      MODEL_KEY(position, kRequired, "\"learned\" or \"rope\""),
      MODEL_KEY(mlp, kRequired, "\"gelu\", \"swiglu\" or \"geglu\""),
      hf(MODEL_KEY(tie_embeddings, kRequired, "LM head shares the token embedding"), "tie_word_embeddings", false),
      MODEL_KEY(bias, kRequired, "biases in linear layers and norms"),
      MODEL_KEY(qkv_bias, kAlways, "biases on the attention's q, k and v projections alone (Qwen2)"),
      EXPERT_KEY(moe_experts, "experts", kExperts, "experts per mixture-of-experts block (0: dense)"),
      EXPERT_KEY(moe_every, "every", kExperts, "every k-th block is a mixture of experts (blocks k-1, 2k-1, ...)"),
      EXPERT_KEY(moe_top_k, "top_k", kExperts, "experts per token (1: Switch, 2: GShard, 8: Qwen3-MoE)"),
      EXPERT_KEY(moe_capacity_factor, "capacity_factor", kExperts,
                 "capacity = ceil(tokens x top_k x factor / experts); 0: dropless"),
      EXPERT_KEY(moe_second_expert, "second_expert", kExperts,
                 "top_k 2: \"random\" (kept with probability min(1, 2 x gate), GShard) or \"always\""),
      training_only(EXPERT_KEY(moe_aux_loss, "aux_loss", kExperts, "load-balancing loss weight (Switch's alpha)")),
      training_only(EXPERT_KEY(moe_z_loss, "z_loss", kExperts, "router z-loss weight")),
      EXPERT_KEY(moe_hidden, "hidden", kExperts, "an expert's hidden size (0: the dense MLP's)"),
      EXPERT_KEY(moe_norm_topk, "norm_topk", kExpertsOptional,
                 "top_k >= 2: the chosen gates renormalised to sum 1 (false: softmax probabilities, Qwen2-MoE)"),
      EXPERT_KEY(moe_shared_hidden, "shared_hidden", kExpertsOptional,
                 "hidden size of a shared expert with a sigmoid gate (Qwen2-MoE; 0: none)"),
      // The open families' variations (Note [Model families]).
      MODEL_KEY(head_size, kWhenSet, "q/k/v size per head (0: width / heads)"),
      MODEL_KEY(attention_bias, kWhenSet, "biases on q, k, v and the attention's output projection"),
      MODEL_KEY(mlp_bias, kWhenSet, "biases on the MLP's projections"),
      MODEL_KEY(qk_norm, kWhenSet,
                "\"none\", \"head\" (RMSNorm over each head's q and k, Qwen3) or \"width\" (over all of q and of k, "
                "OLMo 2)"),
      MODEL_KEY(norm_placement, kWhenSet,
                "\"pre\", \"post\" (norm of each sublayer's output, OLMo 2) or \"sandwich\" (both, Gemma 2)"),
      MODEL_KEY(norm_plus_one, kWhenSet, "RMSNorm scales by (1 + weight) (Gemma)"),
      MODEL_KEY(embed_scale, kWhenSet, "token embeddings times sqrt(width) (Gemma)"),
      MODEL_KEY(attn_softcap, kWhenSet, "attention scores c x tanh(s / c) (0: none)"),
      MODEL_KEY(logit_softcap, kWhenSet, "final logits c x tanh(z / c) (0: none)"),
      training_only(MODEL_KEY(z_loss, kWhenSet, "the output z-loss weight: beta x mean(logsumexp(logits)^2) added to the "
                                                "training loss, keeping the logits' normaliser near 0 (PaLM: 1e-4; 0: none)")),
      MODEL_KEY(query_scale, kWhenSet, "scores scaled by 1/sqrt(query_scale) (0: the head size)"),
      MODEL_KEY(sliding_window, kWhenSet, "a token attends to itself and the window - 1 before it (0: all)"),
      MODEL_KEY(sliding_every, kWhenSet, "the window applies to blocks i with i % sliding_every == 0"),
      MODEL_KEY(rope_scaling, kWhenSet, "\"none\", \"linear\", \"llama3\" or \"yarn\""),
      MODEL_KEY(rope_factor, kWhenSet, "how many times the original context RoPE scaling stretches to"),
      MODEL_KEY(rope_original_context, kWhenSet, "the context before scaling (llama3, yarn)"),
      MODEL_KEY(rope_low_freq_factor, kWhenSet, "llama3 scaling's low frequency factor"),
      MODEL_KEY(rope_high_freq_factor, kWhenSet, "llama3 scaling's high frequency factor"),
      MODEL_KEY(rope_beta_fast, kWhenSet, "yarn's beta_fast"),
      MODEL_KEY(rope_beta_slow, kWhenSet, "yarn's beta_slow"),
      MODEL_KEY(rope_attention_factor, kWhenSet, "yarn: cos and sin times this (0: 0.1 ln(factor) + 1)"),
      MODEL_KEY(rotary_fraction, kWhenSet, "share of each head's dims RoPE rotates"),
  };
}

#undef EXPERT_KEY
#undef MODEL_KEY
#undef MESHTRAIN_MODEL_MEMBER

}  // namespace

const std::vector<ModelKey>& model_keys() {
  static const std::vector<ModelKey> keys = build();
  return keys;
}

const ModelKey* find_model_key(const std::string& name) {
  for (const ModelKey& k : model_keys()) {
    if (k.key.name == name) return &k;
  }
  return nullptr;
}

bool differs(const ModelKey& key, const GptConfig& a, const GptConfig& b) {
  const Value x = key.get(a), y = key.get(b);
  switch (key.key.kind) {
    case Kind::kInt: return x.i != y.i;
    case Kind::kFloat: return x.f != y.f;
    case Kind::kBool: return x.b != y.b;
    default: return x.s != y.s;
  }
}

}  // namespace meshtrain::model
