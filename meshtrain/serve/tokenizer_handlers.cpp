// The tokenizer over HTTP, in vLLM's shapes: POST /tokenize, POST
// /detokenize, GET /tokenizer_info (what lm-evaluation-harness' remote
// tokenizer reads).
#include "meshtrain/serve/frontend_impl.h"

namespace meshtrain::serve {

namespace {

// A special token's text as the tokenizer's config names it, or null.
ojson special_token(const text::Tokenizer& tokenizer, const char* name, int64_t fallback_id) {
  auto it = tokenizer.companions().find("tokenizer_config.json");
  if (it != tokenizer.companions().end()) {
    const ojson config = ojson::parse(it->second, nullptr, false);
    if (config.is_object() && config.contains(name)) {
      const ojson& t = config[name];
      if (t.is_string()) return t;
      if (t.is_object() && t.contains("content")) return t["content"];
    }
  }
  if (fallback_id >= 0) {
    if (auto text = tokenizer.token_string(fallback_id)) return *text;
  }
  return nullptr;
}

}  // namespace

void HttpFrontend::Impl::tokenize(const httplib::Request& req, httplib::Response& res,
                                  const httplib::ContentReader& content) {
  std::string body;
  if (!read_body(req, content, body, res)) return;
  TokenizeRequest r;
  std::vector<int64_t> ids;
  try {
    r = parse_tokenize_request(body, model.name);
    std::string text = r.prompt;
    if (!r.messages.is_null()) {
      if (!model.chat) throw ApiError(400, "this model has no chat template to tokenize messages with", "messages");
      text = model.chat->render(r.messages, r.add_generation_prompt);
    }
    ids = model.tokenizer->encode(text);
    if (r.add_special_tokens) ids = model.tokenizer->with_special_tokens(std::move(ids));
  } catch (const ApiError& e) {
    return send_error(res, e.status, e.what(), e.type, e.param);
  } catch (const text::jinja::Error& e) {
    return send_error(res, 400, std::string("the chat template refused the conversation: ") + e.what(),
                      "invalid_request_error", "messages");
  } catch (const text::TokenizerError& e) {
    return send_error(res, 400, std::string("the text cannot be tokenized: ") + e.what(), "invalid_request_error", "prompt");
  }
  ojson strings = nullptr;
  if (r.return_token_strs) {
    strings = ojson::array();
    for (int64_t id : ids) {
      const std::optional<std::string> s = model.tokenizer->token_string(id);
      strings.push_back(s ? ojson(*s) : ojson(nullptr));
    }
  }
  res.set_content(dump({{"count", ids.size()}, {"max_model_len", model.context}, {"tokens", ids}, {"token_strs", strings}}),
                  "application/json");
}

void HttpFrontend::Impl::detokenize(const httplib::Request& req, httplib::Response& res,
                                    const httplib::ContentReader& content) {
  std::string body;
  if (!read_body(req, content, body, res)) return;
  try {
    const std::vector<int64_t> ids = parse_detokenize_request(body, model.name);
    res.set_content(dump({{"prompt", model.tokenizer->decode(ids)}}), "application/json");
  } catch (const ApiError& e) {
    send_error(res, e.status, e.what(), e.type, e.param);
  } catch (const text::TokenizerError& e) {
    send_error(res, 400, e.what(), "invalid_request_error", "tokens");
  }
}

void HttpFrontend::Impl::tokenizer_info(httplib::Response& res) {
  const text::Tokenizer& t = *model.tokenizer;
  ojson info = {{"tokenizer_class", t.kind()},
                {"model_max_length", model.context},
                {"vocab_size", t.vocab_size()},
                {"eos_token", special_token(t, "eos_token", t.end_of_text())},
                {"bos_token", special_token(t, "bos_token", -1)},
                {"pad_token", special_token(t, "pad_token", -1)},
                {"chat_template", nullptr}};
  auto file = t.companions().find("chat_template.jinja");
  if (file != t.companions().end()) {
    info["chat_template"] = file->second;
  } else if (auto config = t.companions().find("tokenizer_config.json"); config != t.companions().end()) {
    const ojson c = ojson::parse(config->second, nullptr, false);
    if (c.is_object() && c.contains("chat_template")) info["chat_template"] = c["chat_template"];
  }
  res.set_content(dump(info), "application/json");
}

}  // namespace meshtrain::serve
