#include "meshtrain/model/config_json.h"

#include <nlohmann/json.hpp>

namespace meshtrain::model {

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
                {"aux_loss", c.moe_aux_loss},       {"z_loss", c.moe_z_loss}, {"hidden", c.moe_hidden}};
  }
  return j.dump();
}

std::string fingerprint(const GptConfig& m) {
  return "gpt layers=" + std::to_string(m.layers) + " heads=" + std::to_string(m.heads) + " width=" +
         std::to_string(m.width) + " context=" + std::to_string(m.context) + " vocab=" + std::to_string(m.vocab_size) +
         " " + m.norm + "/" + m.position + "/" + m.mlp + (m.tie_embeddings ? "/tied" : "/untied") +
         (m.bias ? "/bias" : m.qkv_bias ? "/qkvbias" : "/nobias") + (m.grouped_query() ? " kv_heads=" + std::to_string(m.kv_heads) : "") +
         (m.ffn_hidden > 0 ? " ffn=" + std::to_string(m.ffn_hidden) : "");
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
  }
  c.validate();
  return c;
}

}  // namespace meshtrain::model
