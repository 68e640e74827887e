// A model's shape as JSON (what checkpoints, exports and the federated
// protocol carry) and as one line (recorded in checkpoints and compared on
// resume).
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <string>

namespace meshtrain::model {

std::string to_json(const GptConfig& config);
// The shape `text` describes, validated; keys added since the first version
// take their defaults when absent. Throws std::invalid_argument.
GptConfig config_from_json(const std::string& text);
// "gpt layers=4 heads=4 width=256 context=128 vocab=256 layernorm/learned/gelu/tied/bias".
std::string fingerprint(const GptConfig& config);

}  // namespace meshtrain::model
