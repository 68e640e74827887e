// A model's chat template (Jinja, from tokenizer_config.json or
// chat_template.jinja) turning a conversation into the text the model was
// trained on, as transformers' apply_chat_template does.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>

#include "meshtrain/text/jinja/template.h"
#include "meshtrain/text/tokenizer.h"

namespace meshtrain::text {

class ChatTemplate {
 public:
  // The template a tokenizer's companion files carry (chat_template.jinja,
  // else tokenizer_config.json's chat_template, the "default" of a named
  // list), or nullptr. Throws TokenizerError for one that does not parse.
  static std::unique_ptr<ChatTemplate> of(const Tokenizer& tokenizer);

  // `special_tokens`: bos_token, eos_token, ... as the template sees them.
  ChatTemplate(const std::string& source, std::map<std::string, std::string> special_tokens);

  // `messages`: [{"role": ..., "content": ...}, ...]; `tools`: a list of tool
  // schemas or null; `extra`: further variables (an object, or null).
  // Throws jinja::Error (raise_exception's message, a template error).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& tools = nullptr, const nlohmann::ordered_json& extra = nullptr) const;

  const std::map<std::string, std::string>& special_tokens() const { return special_tokens_; }

 private:
  jinja::Template template_;
  std::map<std::string, std::string> special_tokens_;
};

}  // namespace meshtrain::text
