#include "meshtrain/model/config_json.h"

#include "meshtrain/model/gpt_config_keys.h"

#include <nlohmann/json.hpp>

#include <stdexcept>

namespace meshtrain::model {

using config::Kind;
using config::Value;
using Stored = ModelKey::Stored;

nlohmann::json json_of(const ModelKey& k, const GptConfig& c) {
  const Value v = k.get(c);
  switch (k.key.kind) {
    case Kind::kInt: return v.i;
    case Kind::kFloat: return v.f;
    case Kind::kBool: return v.b;
    default: return v.s;
  }
}

void read_json(const ModelKey& k, const nlohmann::json& j, GptConfig& c, const std::string& named) {
  Value v;
  const bool ok = k.key.kind == Kind::kInt     ? j.is_number_integer()
                  : k.key.kind == Kind::kFloat ? j.is_number()
                  : k.key.kind == Kind::kBool  ? j.is_boolean()
                                               : j.is_string();
  if (!ok) throw std::invalid_argument(named + " = " + j.dump() + " must be " + config::kind_name(k.key.kind));
  switch (k.key.kind) {
    case Kind::kInt: v.i = j.get<int64_t>(); break;
    case Kind::kFloat: v.f = j.get<double>(); break;
    case Kind::kBool: v.b = j.get<bool>(); break;
    default: v.s = j.get<std::string>(); break;
  }
  k.key.set(c, v);
}

namespace {

// The keys stored where they differ from their defaults (Note [Model keys]) that do; for the
// fingerprint, only those that change what the model computes (not model.init_std).
nlohmann::json keys_when_set(const GptConfig& c, bool computing_only) {
  nlohmann::json j = nlohmann::json::object();
  const GptConfig defaults;
  for (const ModelKey& k : model_keys()) {
    if (computing_only && !k.computes) continue;
    if (k.stored == Stored::kWhenSet && differs(k, c, defaults)) j[k.json] = json_of(k, c);
  }
  return j;
}

}  // namespace

std::string to_json(const GptConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const ModelKey& k : model_keys()) {
    if (k.stored == Stored::kRequired || k.stored == Stored::kAlways) j[k.json] = json_of(k, c);
    if ((k.stored == Stored::kExperts || k.stored == Stored::kExpertsOptional) && c.moe()) j["moe"][k.json] = json_of(k, c);
  }
  // The families' keys (Note [Model families]), written only where they differ
  // from the defaults, so older readers still read a plain model.
  j.update(keys_when_set(c, false));
  return j.dump();
}

std::string fingerprint(const GptConfig& m) {
  const nlohmann::json families = keys_when_set(m, true);
  return "gpt layers=" + std::to_string(m.layers) + " heads=" + std::to_string(m.heads) + " width=" +
         std::to_string(m.width) + " context=" + std::to_string(m.context) + " vocab=" + std::to_string(m.vocab_size) +
         " " + name(m.norm) + "/" + name(m.position) + "/" + name(m.mlp) + (m.tie_embeddings ? "/tied" : "/untied") +
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
  if (!j.is_object()) throw std::invalid_argument("model config: not a JSON object");
  // Keys added since the format's first version are optional: absent, they keep their defaults.
  GptConfig c;
  for (const ModelKey& k : model_keys()) {
    const bool expert = k.stored == Stored::kExperts || k.stored == Stored::kExpertsOptional;
    if (expert && !j.contains("moe")) continue;
    const nlohmann::json& where = expert ? j.at("moe") : j;
    if (where.contains(k.json)) {
      read_json(k, where.at(k.json), c, "model config: " + k.json);
    } else if (k.stored == Stored::kRequired || k.stored == Stored::kExperts) {
      throw std::invalid_argument("model config: " + std::string(expert ? "moe." : "") + k.json + " is missing");
    }
  }
  c.validate();
  return c;
}

}  // namespace meshtrain::model
