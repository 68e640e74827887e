// Instruction and chat records made into tokens with a loss mask: the
// model's chat template renders a conversation, and only what the assistant
// says counts toward the loss (Note [Assistant mask]).
#pragma once

#include "meshtrain/text/chat_template.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/train/data_options.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

struct MaskedTokens {
  std::vector<int64_t> ids;
  std::vector<int64_t> mask;  // 1: predicting this token counts toward the loss
};

class ChatRenderer {
 public:
  // Throws DataError when the tokenizer's chat template does not parse.
  ChatRenderer(const text::Tokenizer& tokenizer, LossOn loss_on);
  bool has_template() const { return template_ != nullptr; }
  // `record`: {"messages": [{"role", "content"}, ...]} (OpenAI / Hugging Face
  // chat format) or {"prompt": ..., "completion": ...}. `where` starts error
  // messages. Throws DataError for a record of neither shape, a role or
  // content of the wrong type, a conversation without an assistant turn, or a
  // template error.
  MaskedTokens render(const nlohmann::ordered_json& record, const std::string& where) const;

 private:
  MaskedTokens render_conversation(const nlohmann::ordered_json& messages, const std::string& where) const;
  MaskedTokens render_plain(const std::string& prompt, const std::string& completion) const;

  const text::Tokenizer& tokenizer_;
  LossOn loss_on_;
  std::unique_ptr<text::ChatTemplate> template_;
};

}  // namespace meshtrain::train
