#include "meshtrain/model/config_json.h"

#include <nlohmann/json.hpp>

namespace meshtrain::model {

namespace {

// The keys of Note [Model families] that differ from their defaults.
nlohmann::json family_keys(const GptConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  const GptConfig d;
  auto differs = [&](const char* key, auto value, auto fallback) {
    if (value != fallback) j[key] = value;
  };
  differs("head_size", c.head_size, d.head_size);
  differs("attention_bias", c.attention_bias, d.attention_bias);
  differs("mlp_bias", c.mlp_bias, d.mlp_bias);
  differs("qk_norm", c.qk_norm, d.qk_norm);
  differs("norm_placement", c.norm_placement, d.norm_placement);
  differs("norm_plus_one", c.norm_plus_one, d.norm_plus_one);
  differs("embed_scale", c.embed_scale, d.embed_scale);
  differs("attn_softcap", c.attn_softcap, d.attn_softcap);
  differs("logit_softcap", c.logit_softcap, d.logit_softcap);
  differs("query_scale", c.query_scale, d.query_scale);
  differs("sliding_window", c.sliding_window, d.sliding_window);
  differs("sliding_every", c.sliding_every, d.sliding_every);
  differs("rope_scaling", c.rope_scaling, d.rope_scaling);
  differs("rope_factor", c.rope_factor, d.rope_factor);
  differs("rope_original_context", c.rope_original_context, d.rope_original_context);
  differs("rope_low_freq_factor", c.rope_low_freq_factor, d.rope_low_freq_factor);
  differs("rope_high_freq_factor", c.rope_high_freq_factor, d.rope_high_freq_factor);
  differs("rope_beta_fast", c.rope_beta_fast, d.rope_beta_fast);
  differs("rope_beta_slow", c.rope_beta_slow, d.rope_beta_slow);
  differs("rope_attention_factor", c.rope_attention_factor, d.rope_attention_factor);
  differs("rotary_fraction", c.rotary_fraction, d.rotary_fraction);
  return j;
}

}  // namespace

std::string to_json(const GptConfig& c) {
  nlohmann::json j{{"vocab_size", c.vocab_size}, {"context", c.context}, {"layers", c.layers},
                   {"heads", c.heads},           {"width", c.width},     {"dropout", c.dropout},
                   {"norm", c.norm},             {"position", c.position}, {"mlp", c.mlp},
                   {"tie_embeddings", c.tie_embeddings}, {"bias", c.bias}, {"qkv_bias", c.qkv_bias},
                   {"kv_heads", c.kv_heads},     {"ffn_hidden", c.ffn_hidden}, {"rope_theta", c.rope_theta},
                   {"norm_eps", c.norm_eps}};
  if (c.moe()) {
    j["moe"] = {{"experts", c.moe_experts},         {"every", c.moe_every},   {"top_k", c.moe_top_k},
                {"capacity_factor", c.moe_capacity_factor}, {"second_expert", c.moe_second_expert},
                {"aux_loss", c.moe_aux_loss},       {"z_loss", c.moe_z_loss}, {"hidden", c.moe_hidden},
                {"norm_topk", c.moe_norm_topk},     {"shared_hidden", c.moe_shared_hidden}};
  }
  // The families' keys (Note [Model families]), written only where they differ
  // from the defaults, so older readers still read a plain model.
  j.update(family_keys(c));
  return j.dump();
}

std::string fingerprint(const GptConfig& m) {
  const nlohmann::json families = family_keys(m);
  return "gpt layers=" + std::to_string(m.layers) + " heads=" + std::to_string(m.heads) + " width=" +
         std::to_string(m.width) + " context=" + std::to_string(m.context) + " vocab=" + std::to_string(m.vocab_size) +
         " " + m.norm + "/" + m.position + "/" + m.mlp + (m.tie_embeddings ? "/tied" : "/untied") +
         (m.bias ? "/bias" : m.qkv_bias ? "/qkvbias" : "/nobias") + (m.grouped_query() ? " kv_heads=" + std::to_string(m.kv_heads) : "") +
         (m.ffn_hidden > 0 ? " ffn=" + std::to_string(m.ffn_hidden) : "") +
         (families.empty() ? "" : " " + families.dump());
}

std::string with_lora(const std::string& model_json, const LoraSection& lora) {
  nlohmann::json j = nlohmann::json::parse(model_json);
  j["lora"] = nlohmann::json::parse(lora.config.to_json());
  j["lora"]["base"] = lora.base;
  return j.dump();
}

std::optional<LoraSection> lora_of(const std::string& model_json) {
  const nlohmann::json j = nlohmann::json::parse(model_json);
  if (!j.contains("lora")) return std::nullopt;
  nlohmann::json section = j.at("lora");
  LoraSection out;
  out.base = section.value("base", "");
  section.erase("base");
  out.config = LoraConfig::from_json(section.dump());
  return out;
}

GptConfig config_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  GptConfig c;
  c.vocab_size = j.at("vocab_size");
  c.context = j.at("context");
  c.layers = j.at("layers");
  c.heads = j.at("heads");
  c.width = j.at("width");
  c.dropout = j.at("dropout");
  c.norm = j.at("norm");
  c.position = j.at("position");
  c.mlp = j.at("mlp");
  c.tie_embeddings = j.at("tie_embeddings");
  c.bias = j.at("bias");
  // Added later: absent in older checkpoints, which had the defaults.
  c.kv_heads = j.value("kv_heads", int64_t{0});
  c.ffn_hidden = j.value("ffn_hidden", int64_t{0});
  c.rope_theta = j.value("rope_theta", 10000.0);
  c.norm_eps = j.value("norm_eps", 1e-5);
  c.qkv_bias = j.value("qkv_bias", false);
  if (j.contains("moe")) {
    const nlohmann::json& m = j.at("moe");
    c.moe_experts = m.at("experts");
    c.moe_every = m.at("every");
    c.moe_top_k = m.at("top_k");
    c.moe_capacity_factor = m.at("capacity_factor");
    c.moe_second_expert = m.at("second_expert");
    c.moe_aux_loss = m.at("aux_loss");
    c.moe_z_loss = m.at("z_loss");
    c.moe_hidden = m.at("hidden");
    c.moe_norm_topk = m.value("norm_topk", true);
    c.moe_shared_hidden = m.value("shared_hidden", int64_t{0});
  }
  c.head_size = j.value("head_size", c.head_size);
  c.attention_bias = j.value("attention_bias", c.attention_bias);
  c.mlp_bias = j.value("mlp_bias", c.mlp_bias);
  c.qk_norm = j.value("qk_norm", c.qk_norm);
  c.norm_placement = j.value("norm_placement", c.norm_placement);
  c.norm_plus_one = j.value("norm_plus_one", c.norm_plus_one);
  c.embed_scale = j.value("embed_scale", c.embed_scale);
  c.attn_softcap = j.value("attn_softcap", c.attn_softcap);
  c.logit_softcap = j.value("logit_softcap", c.logit_softcap);
  c.query_scale = j.value("query_scale", c.query_scale);
  c.sliding_window = j.value("sliding_window", c.sliding_window);
  c.sliding_every = j.value("sliding_every", c.sliding_every);
  c.rope_scaling = j.value("rope_scaling", c.rope_scaling);
  c.rope_factor = j.value("rope_factor", c.rope_factor);
  c.rope_original_context = j.value("rope_original_context", c.rope_original_context);
  c.rope_low_freq_factor = j.value("rope_low_freq_factor", c.rope_low_freq_factor);
  c.rope_high_freq_factor = j.value("rope_high_freq_factor", c.rope_high_freq_factor);
  c.rope_beta_fast = j.value("rope_beta_fast", c.rope_beta_fast);
  c.rope_beta_slow = j.value("rope_beta_slow", c.rope_beta_slow);
  c.rope_attention_factor = j.value("rope_attention_factor", c.rope_attention_factor);
  c.rotary_fraction = j.value("rotary_fraction", c.rotary_fraction);
  c.validate();
  return c;
}

}  // namespace meshtrain::model
