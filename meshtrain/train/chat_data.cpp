#include "meshtrain/train/chat_data.h"

#include "meshtrain/train/data_error.h"

#include <algorithm>

namespace meshtrain::train {

// Note [Assistant mask]
// The conversation is rendered whole (no generation prompt), as
// transformers' apply_chat_template(tokenize=True) does, and tokenized once.
// For each assistant message i, two more renders find its span: messages
// [0, i) with the generation prompt (where the reply starts) and messages
// [0, i] (where its turn ends, end-of-turn token included). Both must be
// prefixes of the whole text; a template that renders earlier turns
// differently once more follow (some drop reasoning from past turns) is
// refused by name. A prefix's token count is its tokens' common prefix with
// the whole, so a token that straddles a boundary goes to the part it starts
// in. Records of prompt + completion without a chat template are the
// prompt's tokens (with the tokenizer's start token) then the completion's
// and an end-of-text token, the completion alone counting.

namespace {

size_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

std::string text_of(const nlohmann::ordered_json& record, const char* key, const std::string& where) {
  const auto it = record.find(key);
  if (it == record.end() || !it->is_string()) data_error(where, std::string("\"") + key + "\" must be a string");
  return it->get<std::string>();
}

}  // namespace

ChatRenderer::ChatRenderer(const text::Tokenizer& tokenizer, LossOn loss_on) : tokenizer_(tokenizer), loss_on_(loss_on) {
  try {
    template_ = text::ChatTemplate::of(tokenizer);
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("tokenizer: ") + e.what());
  }
}

MaskedTokens ChatRenderer::render(const nlohmann::ordered_json& record, const std::string& where) const {
  // Absent and null are alike (a Parquet table of both shapes has nulls in the other's columns).
  if (record.contains("messages") && !record["messages"].is_null()) {
    const auto& messages = record["messages"];
    if (!messages.is_array() || messages.empty()) data_error(where, "\"messages\" must be a non-empty list of messages");
    for (const auto& m : messages) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        data_error(where, "every message needs a \"role\" string (system, user, assistant, tool)");
      }
      if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null() && !m["content"].is_array()) {
        data_error(where, "a message's \"content\" must be a string, a list of parts, or null");
      }
    }
    if (!template_) {
      data_error(where, "a \"messages\" record needs a chat template, and tokenizer " + tokenizer_.describe() +
                     " has none (name a model folder whose tokenizer_config.json carries chat_template)");
    }
    return render_conversation(messages, where);
  }
  if (record.contains("prompt") || record.contains("completion")) {
    const std::string prompt = text_of(record, "prompt", where), completion = text_of(record, "completion", where);
    if (!template_) return render_plain(prompt, completion);
    const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", prompt}},
                                             {{"role", "assistant"}, {"content", completion}}};
    return render_conversation(messages, where);
  }
  data_error(where, "a chat record needs \"messages\" or \"prompt\" and \"completion\"");
}

MaskedTokens ChatRenderer::render_conversation(const nlohmann::ordered_json& messages, const std::string& where) const {
  auto render = [&](size_t count, bool generation_prompt) {
    nlohmann::ordered_json part = nlohmann::ordered_json::array();
    for (size_t i = 0; i < count; ++i) part.push_back(messages[i]);
    try {
      return template_->render(part, generation_prompt);
    } catch (const std::exception& e) {
      data_error(where, std::string("the chat template failed: ") + e.what());
    }
  };
  const std::string whole = render(messages.size(), false);
  MaskedTokens out;
  try {
    out.ids = tokenizer_.encode(whole);
  } catch (const text::TokenizerError& e) {
    data_error(where, e.what());
  }
  out.mask.assign(out.ids.size(), loss_on_ == LossOn::kAll ? 1 : 0);
  if (loss_on_ == LossOn::kAll) return out;
  auto tokens_before = [&](const std::string& prefix) {
    if (whole.compare(0, prefix.size(), prefix) != 0) {
      data_error(where, "the chat template renders earlier turns differently once later ones follow, so the assistant's "
                 "tokens cannot be found; use data.loss_on = \"all\"");
    }
    return common_prefix(tokenizer_.encode(prefix), out.ids);
  };
  bool any = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i]["role"] != "assistant") continue;
    const size_t begin = tokens_before(render(i, true)), end = tokens_before(render(i + 1, false));
    std::fill(out.mask.begin() + begin, out.mask.begin() + std::max(begin, end), 1);
    any = true;
  }
  if (!any) data_error(where, "the conversation has no assistant message, so nothing would count toward the loss");
  return out;
}

MaskedTokens ChatRenderer::render_plain(const std::string& prompt, const std::string& completion) const {
  MaskedTokens out;
  out.ids = tokenizer_.with_special_tokens(tokenizer_.encode(prompt));
  out.mask.assign(out.ids.size(), loss_on_ == LossOn::kAll ? 1 : 0);
  std::vector<int64_t> reply = tokenizer_.encode(completion);
  if (tokenizer_.end_of_text() >= 0) reply.push_back(tokenizer_.end_of_text());
  out.ids.insert(out.ids.end(), reply.begin(), reply.end());
  out.mask.insert(out.mask.end(), reply.size(), 1);
  return out;
}

}  // namespace meshtrain::train
