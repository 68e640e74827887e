#include "meshtrain/text/chat_template.h"

#include "meshtrain/text/tokenizer_config.h"

namespace meshtrain::text {

using json = nlohmann::json;

std::unique_ptr<ChatTemplate> ChatTemplate::of(const Tokenizer& tokenizer) {
  const json config = companion_json(tokenizer, "tokenizer_config.json");
  std::string source;
  auto file = tokenizer.companions().find("chat_template.jinja");
  if (file != tokenizer.companions().end()) {
    source = file->second;
  } else if (config.is_object() && config.contains("chat_template")) {
    const json& t = config["chat_template"];
    if (t.is_string()) source = t.get<std::string>();
    for (const json& named : t.is_array() ? t : json::array()) {
      if (named.value("name", "") == "default") source = named.value("template", "");
    }
  }
  if (source.empty()) return nullptr;
  // The special tokens the template may name, as transformers' special_tokens_map.
  std::map<std::string, std::string> specials;
  const json map = companion_json(tokenizer, "special_tokens_map.json");
  for (const json* from : {&map, &config}) {
    if (!from->is_object()) continue;
    for (const char* name : {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}) {
      if (from->contains(name) && !token_text((*from)[name]).empty()) specials[name] = token_text((*from)[name]);
    }
  }
  try {
    return std::make_unique<ChatTemplate>(source, std::move(specials));
  } catch (const jinja::Error& e) {
    throw TokenizerError(std::string("the chat template does not parse: ") + e.what());
  }
}

ChatTemplate::ChatTemplate(const std::string& source, std::map<std::string, std::string> special_tokens)
    : template_(source), special_tokens_(std::move(special_tokens)) {}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                 const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const {
  jinja::Dict globals;
  for (const auto& [name, text] : special_tokens_) globals.emplace_back(name, jinja::Value(text));
  globals.emplace_back("messages", jinja::Value::from_json(messages));
  globals.emplace_back("tools", jinja::Value::from_json(tools));
  globals.emplace_back("documents", jinja::Value::none());
  globals.emplace_back("add_generation_prompt", jinja::Value(add_generation_prompt));
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) globals.emplace_back(it.key(), jinja::Value::from_json(it.value()));
  }
  return template_.render(globals);
}

}  // namespace meshtrain::text
