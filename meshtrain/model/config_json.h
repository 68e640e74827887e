// A model's shape as JSON (what checkpoints, exports and the federated
// protocol carry) and as one line (recorded in checkpoints and compared on
// resume).
#pragma once

#include "meshtrain/model/gpt_config.h"
#include "meshtrain/model/gpt_config_keys.h"
#include "meshtrain/model/lora.h"

#include <nlohmann/json.hpp>

#include <optional>

#include <string>

namespace meshtrain::model {

std::string to_json(const GptConfig& config);
// The shape `text` describes, validated; keys added since the first version
// take their defaults when absent. Throws std::invalid_argument.
GptConfig config_from_json(const std::string& text);
// One key's value as JSON, and set from JSON; the latter throws
// std::invalid_argument("<named> = <value> must be <kind>") for a wrong type,
// and what the key's own rule throws for a value it does not allow.
nlohmann::json json_of(const ModelKey& key, const GptConfig& config);
void read_json(const ModelKey& key, const nlohmann::json& value, GptConfig& config, const std::string& named);
// "gpt layers=4 heads=4 width=256 context=128 vocab=256 layernorm/learned/gelu/tied/bias".
std::string fingerprint(const GptConfig& config);

// A checkpoint of LoRA adapters (Note [LoRA]) records their config, and the
// checkpoint of the base they adapt ("" if none), under "lora" in its model config.
struct LoraSection {
  LoraConfig config;
  std::string base;
};
std::string with_lora(const std::string& model_json, const LoraSection& lora);
std::optional<LoraSection> lora_of(const std::string& model_json);  // none: a whole model

}  // namespace meshtrain::model
