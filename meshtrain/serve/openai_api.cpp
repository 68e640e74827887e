#include "meshtrain/serve/openai_api.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace meshtrain::serve {

using api_detail::bad;

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

namespace api_detail {

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, message, param); }

ojson parse_body(const std::string& text, const std::string& served_model, const std::vector<std::string>& known) {
  ojson body;
  try {
    body = ojson::parse(text);
  } catch (const ojson::exception& e) {  // a syntax error, or a number out of range (1e999)
    throw bad("", std::string("the body is not valid JSON (") + e.what() + "); send a JSON object");
  }
  if (!body.is_object()) throw bad("", "the body must be a JSON object");
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) != known.end()) continue;
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
    throw bad(it.key(), "unknown field '" + it.key() + "'; this endpoint takes " + list);
  }
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) throw bad("model", "'model' must be a string");
    const std::string model = body["model"];
    if (model != served_model) {
      throw ApiError(404, "the model '" + model + "' does not exist; this server serves '" + served_model + "'", "model",
                     "model_not_found");
    }
  }
  return body;
}

bool flag(const ojson& body, const char* name, bool fallback) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  if (!body[name].is_boolean()) throw bad(name, std::string("'") + name + "' must be true or false");
  return body[name].get<bool>();
}

}  // namespace api_detail

namespace {

using api_detail::flag;

template <typename T>
T number(const ojson& body, const char* name, T fallback, T lowest, T highest, const std::string& range) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  const ojson& v = body[name];
  if (!v.is_number()) throw bad(name, std::string("'") + name + "' must be a number " + range);
  if (std::is_integral<T>::value && !v.is_number_integer()) {
    throw bad(name, std::string("'") + name + "' must be an integer " + range);
  }
  const double d = v.get<double>();
  if (!std::isfinite(d) || !(d >= static_cast<double>(lowest) && d <= static_cast<double>(highest))) {
    throw bad(name, std::string("'") + name + "' is " + v.dump() + "; it must be " + range);
  }
  return v.get<T>();
}

std::vector<std::string> stop_strings(const ojson& body) {
  std::vector<std::string> stop;
  if (!body.contains("stop") || body["stop"].is_null()) return stop;
  const ojson& s = body["stop"];
  if (s.is_string()) return {s.get<std::string>()};
  // OpenAI takes 4; evaluation tasks (lm-eval's until) often name more.
  if (!s.is_array() || s.size() > 32) throw bad("stop", "'stop' must be a string or a list of up to 32 strings");
  for (const ojson& one : s) {
    if (!one.is_string()) throw bad("stop", "'stop' must be a string or a list of up to 32 strings");
    stop.push_back(one.get<std::string>());
  }
  return stop;
}

std::vector<std::pair<int64_t, double>> logit_bias(const ojson& body) {
  std::vector<std::pair<int64_t, double>> bias;
  if (!body.contains("logit_bias") || body["logit_bias"].is_null()) return bias;
  const ojson& b = body["logit_bias"];
  if (!b.is_object()) throw bad("logit_bias", "'logit_bias' must map token ids (as strings) to numbers in [-100, 100]");
  for (auto it = b.begin(); it != b.end(); ++it) {
    int64_t id = -1;
    try {
      size_t used = 0;
      id = std::stoll(it.key(), &used);
      if (used != it.key().size()) id = -1;
    } catch (const std::exception&) {
    }
    if (id < 0) throw bad("logit_bias", "logit_bias key '" + it.key() + "' is not a token id");
    if (!it->is_number() || !(std::fabs(it->get<double>()) <= 100)) {
      throw bad("logit_bias", "logit_bias values must be numbers in [-100, 100]");
    }
    bias.emplace_back(id, it->get<double>());
  }
  return bias;
}

}  // namespace

void api_detail::read_sampling(const ojson& body, GenerationRequestBody& r, const char* max_tokens_field,
                               int64_t max_tokens_default) {
  CompletionParams& p = r.params;
  p.max_tokens = number<int64_t>(body, max_tokens_field, max_tokens_default, 0, int64_t{1} << 40, "0 or more");
  p.temperature = number<double>(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2");
  p.top_p = number<double>(body, "top_p", 1.0, 0.0, 1.0, "in (0, 1]");
  if (p.top_p == 0) throw bad("top_p", "'top_p' is 0; it must be in (0, 1]");
  p.top_k = number<int64_t>(body, "top_k", 0, -1, int64_t{1} << 40, "0 or -1 (off) or more");
  if (p.top_k < 0) p.top_k = 0;
  if (body.contains("seed") && !body["seed"].is_null()) {
    p.seed = static_cast<uint64_t>(number<int64_t>(body, "seed", 0, INT64_MIN, INT64_MAX, "an integer"));
  } else {
    p.seed = std::random_device{}();
  }
  p.stop = stop_strings(body);
  p.skip_special_tokens = flag(body, "skip_special_tokens", true);
  p.extras.presence_penalty = number<double>(body, "presence_penalty", 0.0, -2.0, 2.0, "between -2 and 2");
  p.extras.frequency_penalty = number<double>(body, "frequency_penalty", 0.0, -2.0, 2.0, "between -2 and 2");
  p.extras.logit_bias = logit_bias(body);
  r.n = number<int64_t>(body, "n", 1, 1, 128, "between 1 and 128");
  r.stream = flag(body, "stream", false);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const ojson& o = body["stream_options"];
    if (!o.is_object()) throw bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad("stream_options", "'stream_options' is only for stream: true");
    for (auto it = o.begin(); it != o.end(); ++it) {
      if (it.key() != "include_usage" && it.key() != "continuous_usage_stats") {
        throw bad("stream_options", "unknown stream option '" + it.key() + "'; it takes include_usage");
      }
    }
    r.include_usage = flag(o, "include_usage", false);
    if (flag(o, "continuous_usage_stats", false)) {
      throw bad("stream_options", "stream_options.continuous_usage_stats is not supported; include_usage gives the "
                                  "usage once, in the last chunk");
    }
  }
}

namespace {

std::vector<int64_t> token_ids(const ojson& list, const char* param) {
  std::vector<int64_t> ids;
  for (const ojson& t : list) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0) throw bad(param, std::string("'") + param + "' token ids must be integers >= 0");
    ids.push_back(t.get<int64_t>());
  }
  return ids;
}

std::vector<PromptInput> prompts_of(const ojson& prompt) {
  const char* shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists";
  std::vector<PromptInput> out;
  if (prompt.is_string()) return {PromptInput{prompt.get<std::string>(), {}, false}};
  if (!prompt.is_array() || prompt.empty()) throw bad("prompt", shape);
  if (prompt[0].is_number()) return {PromptInput{"", token_ids(prompt, "prompt"), true}};
  for (const ojson& p : prompt) {
    if (p.is_string()) {
      out.push_back(PromptInput{p.get<std::string>(), {}, false});
    } else if (p.is_array()) {
      out.push_back(PromptInput{"", token_ids(p, "prompt"), true});
    } else {
      throw bad("prompt", shape);
    }
  }
  return out;
}

}  // namespace

CompletionRequest parse_completion_request(const std::string& text, const std::string& served_model) {
  const ojson body = api_detail::parse_body(
      text, served_model,
      {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stream", "stream_options",
       "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "suffix",
       "add_special_tokens", "skip_special_tokens"});
  CompletionRequest r;
  if (!body.contains("prompt")) throw bad("prompt", "'prompt' is required");
  r.prompts = prompts_of(body["prompt"]);
  api_detail::read_sampling(body, r, "max_tokens", 16);
  r.echo = flag(body, "echo", false);
  r.add_special_tokens = flag(body, "add_special_tokens", true);
  const int64_t best_of = number<int64_t>(body, "best_of", r.n, 1, 128, "between 1 and 128");
  if (best_of != r.n) throw bad("best_of", "best_of must equal n (choices are not ranked)");
  r.params.extras.logprobs = number<int64_t>(body, "logprobs", -1, 0, 20, "between 0 and 20");
  r.params.extras.prompt_logprobs = r.echo && r.params.extras.logprobs >= 0;
  if (r.params.max_tokens == 0 && !r.echo) {
    throw bad("max_tokens", "max_tokens 0 generates nothing; with echo (and logprobs) it scores the prompt");
  }
  if (body.contains("suffix") && !body["suffix"].is_null()) throw bad("suffix", "suffix is not supported");
  if (r.stream && r.params.max_tokens == 0) throw bad("stream", "a request that only scores its prompt cannot stream");
  return r;
}

TokenizeRequest parse_tokenize_request(const std::string& text, const std::string& served_model) {
  const ojson body = api_detail::parse_body(
      text, served_model, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"});
  TokenizeRequest r;
  if (body.contains("messages") && !body["messages"].is_null()) {
    if (!body["messages"].is_array()) throw bad("messages", "'messages' must be a list of messages");
    r.messages = body["messages"];
    r.add_special_tokens = flag(body, "add_special_tokens", false);
  } else {
    if (!body.contains("prompt") || !body["prompt"].is_string()) throw bad("prompt", "'prompt' (a string) is required");
    r.prompt = body["prompt"].get<std::string>();
    r.add_special_tokens = flag(body, "add_special_tokens", true);
  }
  r.add_generation_prompt = flag(body, "add_generation_prompt", true);
  r.return_token_strs = flag(body, "return_token_strs", false);
  return r;
}

std::vector<int64_t> parse_detokenize_request(const std::string& text, const std::string& served_model) {
  const ojson body = api_detail::parse_body(text, served_model, {"model", "tokens"});
  if (!body.contains("tokens") || !body["tokens"].is_array()) throw bad("tokens", "'tokens' (a list of ids) is required");
  return token_ids(body["tokens"], "tokens");
}

namespace {

ojson usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

ojson reason(const std::string& finish_reason) { return finish_reason.empty() ? ojson(nullptr) : ojson(finish_reason); }

}  // namespace

std::string completion_response(const std::string& id, int64_t created, const std::string& model,
                                 const std::vector<Choice>& choices, int64_t prompt_tokens, int64_t completion_tokens) {
  ojson list = ojson::array();
  for (const Choice& c : choices) {
    list.push_back({{"text", c.text}, {"index", c.index}, {"logprobs", c.logprobs}, {"finish_reason", reason(c.finish_reason)}});
  }
  return dump({{"id", id},
               {"object", "text_completion"},
               {"created", created},
               {"model", model},
               {"choices", list},
               {"usage", usage(prompt_tokens, completion_tokens)}});
}

std::string completion_chunk(const std::string& id, int64_t created, const std::string& model, const Choice& c) {
  return dump({{"id", id},
               {"object", "text_completion"},
               {"created", created},
               {"model", model},
               {"choices", ojson::array({{{"text", c.text},
                                          {"index", c.index},
                                          {"logprobs", c.logprobs},
                                          {"finish_reason", reason(c.finish_reason)}}})}});
}

std::string chat_response(const std::string& id, int64_t created, const std::string& model,
                          const std::vector<Choice>& choices, int64_t prompt_tokens, int64_t completion_tokens) {
  ojson list = ojson::array();
  for (const Choice& c : choices) {
    list.push_back({{"index", c.index},
                    {"message", {{"role", "assistant"}, {"content", c.text}}},
                    {"logprobs", c.logprobs},
                    {"finish_reason", reason(c.finish_reason)}});
  }
  return dump({{"id", id},
               {"object", "chat.completion"},
               {"created", created},
               {"model", model},
               {"choices", list},
               {"usage", usage(prompt_tokens, completion_tokens)}});
}

std::string chat_chunk(const std::string& id, int64_t created, const std::string& model, const Choice& c, bool role) {
  ojson delta = ojson::object();
  if (role) delta["role"] = "assistant";
  if (!c.text.empty() || (role && c.finish_reason.empty())) delta["content"] = c.text;
  return dump({{"id", id},
               {"object", "chat.completion.chunk"},
               {"created", created},
               {"model", model},
               {"choices", ojson::array({{{"index", c.index},
                                          {"delta", delta},
                                          {"logprobs", c.logprobs},
                                          {"finish_reason", reason(c.finish_reason)}}})}});
}

std::string usage_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& object,
                        int64_t prompt_tokens, int64_t completion_tokens) {
  return dump({{"id", id},
               {"object", object},
               {"created", created},
               {"model", model},
               {"choices", ojson::array()},
               {"usage", usage(prompt_tokens, completion_tokens)}});
}

std::string model_response(const std::string& model, int64_t created) {
  return dump({{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "meshtrain"}});
}

std::string models_response(const std::string& model, int64_t created) {
  return dump({{"object", "list"}, {"data", ojson::array({ojson::parse(model_response(model, created))})}});
}

std::string error_response(const std::string& message, const std::string& type, const std::string& param) {
  return dump({{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? ojson(nullptr) : ojson(param)},
                 {"code", nullptr}}}});
}

}  // namespace meshtrain::serve
