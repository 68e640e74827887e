// POST /v1/chat/completions' request: the conversation, checked.
#include "meshtrain/serve/openai_api.h"

namespace meshtrain::serve {

using api_detail::bad;

namespace {

void check_messages(const ojson& messages) {
  if (!messages.is_array() || messages.empty()) throw bad("messages", "'messages' must be a non-empty list of messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw bad("messages", where + " must be an object with a role and content");
    if (!m.contains("role") || !m["role"].is_string()) throw bad("messages", where + " has no role (a string)");
    const bool has_calls = m.contains("tool_calls") && m["tool_calls"].is_array();
    if (!m.contains("content") && !has_calls) throw bad("messages", where + " has no content");
    if (m.contains("content") && !m["content"].is_null() && !m["content"].is_string() && !m["content"].is_array()) {
      throw bad("messages", where + ".content must be a string or a list of parts");
    }
  }
}

}  // namespace

ChatRequest parse_chat_request(const std::string& text, const std::string& served_model) {
  const ojson body = api_detail::parse_body(
      text, served_model,
      {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stream",
       "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
       "seed", "user", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
       "response_format", "skip_special_tokens"});
  ChatRequest r;
  if (!body.contains("messages")) throw bad("messages", "'messages' is required");
  check_messages(body["messages"]);
  r.messages = body["messages"];
  const bool newer = body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null();
  // Unset (-1): up to the end of the context.
  api_detail::read_sampling(body, r, newer ? "max_completion_tokens" : "max_tokens", -1);
  if (r.params.max_tokens == 0) throw bad(newer ? "max_completion_tokens" : "max_tokens", "a chat answer needs max_tokens >= 1");
  r.logprobs = api_detail::flag(body, "logprobs", false);
  if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
    const ojson& k = body["top_logprobs"];
    if (!k.is_number_integer() || k.get<int64_t>() < 0 || k.get<int64_t>() > 20) {
      throw bad("top_logprobs", "'top_logprobs' must be an integer between 0 and 20");
    }
    if (!r.logprobs) throw bad("top_logprobs", "'top_logprobs' needs logprobs: true");
    r.params.extras.logprobs = k.get<int64_t>();
  } else if (r.logprobs) {
    r.params.extras.logprobs = 0;
  }
  if (body.contains("tools") && !body["tools"].is_null()) {
    if (!body["tools"].is_array()) throw bad("tools", "'tools' must be a list of tool schemas");
    r.tools = body["tools"];
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& c = body["tool_choice"];
    if (!c.is_string() || (c != "none" && c != "auto")) {
      throw bad("tool_choice", "tool_choice may be \"none\" or \"auto\"; forcing a tool call is not supported");
    }
    if (c == "none") r.tools = nullptr;  // the model is not to call tools: the template does not offer them
  }
  if (body.contains("parallel_tool_calls") && !body["parallel_tool_calls"].is_null()) {
    throw bad("parallel_tool_calls", "parallel_tool_calls is not supported: tools reach the chat template, but tool "
                                     "calls are not parsed out of the answer");
  }
  if (body.contains("response_format") && !body["response_format"].is_null()) {
    const ojson& f = body["response_format"];
    if (!f.is_object() || f.value("type", "") != "text") {
      throw bad("response_format", "only response_format {\"type\": \"text\"} is supported");
    }
  }
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object()) throw bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    r.template_kwargs = body["chat_template_kwargs"];
  }
  r.add_generation_prompt = api_detail::flag(body, "add_generation_prompt", true);
  return r;
}

}  // namespace meshtrain::serve
