// What a tokenizer's companion files say (tokenizer_config.json,
// special_tokens_map.json), for the tokenizer and its chat template alike.
#pragma once

#include "meshtrain/text/tokenizer.h"

#include <nlohmann/json.hpp>

#include <string>

namespace meshtrain::text {

// The companion file `name` parsed as JSON: null when the tokenizer has none,
// discarded (is_discarded()) when it is not JSON.
nlohmann::json companion_json(const Tokenizer& tokenizer, const std::string& name);

// A token's text as tokenizer_config.json writes it: a string or an AddedToken
// object ({"content": ...}); "" for anything else.
std::string token_text(const nlohmann::json& j);

}  // namespace meshtrain::text
