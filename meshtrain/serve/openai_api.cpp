#include "meshtrain/serve/openai_api.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <random>

namespace meshtrain::serve {

namespace {

using nlohmann::json;

// Text from a byte-level model may hold invalid UTF-8 (a character cut by
// max_tokens); JSON carries it with U+FFFD in its place.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, message, param); }

template <typename T>
T number(const json& body, const char* name, T fallback, T lowest, T highest, const std::string& range) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  const json& v = body[name];
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

}  // namespace

CompletionParams parse_completion_request(const std::string& text, const std::string& served_model) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // a syntax error, or a number out of range (1e999)
    throw bad("", std::string("the body is not valid JSON (") + e.what() + "); send a JSON object");
  }
  if (!body.is_object()) throw bad("", "the body must be a JSON object");
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) throw bad("model", "'model' must be a string");
    const std::string model = body["model"];
    if (model != served_model) {
      throw ApiError(404, "the model '" + model + "' does not exist; this server serves '" + served_model + "'", "model",
                     "model_not_found");
    }
  }
  CompletionParams p;
  if (!body.contains("prompt")) throw bad("prompt", "'prompt' is required");
  const json& prompt = body["prompt"];
  if (prompt.is_string()) {
    p.prompt = prompt.get<std::string>();
  } else if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_string()) {
    p.prompt = prompt[0].get<std::string>();
  } else if (prompt.is_array() && prompt.size() > 1) {
    throw bad("prompt", "one prompt per request is supported; send the others as separate requests");
  } else {
    throw bad("prompt", "'prompt' must be a string (or a list of one string)");
  }
  p.max_tokens = number<int64_t>(body, "max_tokens", 16, 1, int64_t{1} << 40, "at least 1");
  p.temperature = number<double>(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2");
  p.top_p = number<double>(body, "top_p", 1.0, 0.0, 1.0, "in (0, 1]");
  if (p.top_p == 0) throw bad("top_p", "'top_p' is 0; it must be in (0, 1]");
  p.top_k = number<int64_t>(body, "top_k", 0, 0, int64_t{1} << 40, "0 (off) or more");
  if (body.contains("seed") && !body["seed"].is_null()) {
    p.seed = static_cast<uint64_t>(number<int64_t>(body, "seed", 0, 0, INT64_MAX, "a non-negative integer"));
  } else {
    p.seed = std::random_device{}();
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      p.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= 4) {
      for (const json& s : stop) {
        if (!s.is_string()) throw bad("stop", "'stop' must be a string or a list of up to 4 strings");
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad("stop", "'stop' must be a string or a list of up to 4 strings");
    }
  }
  auto flag = [&](const char* name) {
    if (!body.contains(name) || body[name].is_null()) return false;
    if (!body[name].is_boolean()) throw bad(name, std::string("'") + name + "' must be true or false");
    return body[name].get<bool>();
  };
  p.stream = flag("stream");
  p.echo = flag("echo");
  if (number<int64_t>(body, "n", 1, 1, 1 << 20, "at least 1") != 1) throw bad("n", "only n = 1 is supported");
  if (number<int64_t>(body, "best_of", 1, 1, 1 << 20, "at least 1") != 1) throw bad("best_of", "only best_of = 1 is supported");
  if (body.contains("logprobs") && !body["logprobs"].is_null()) throw bad("logprobs", "logprobs are not supported");
  if (body.contains("suffix") && !body["suffix"].is_null()) throw bad("suffix", "suffix is not supported");
  return p;
}

std::string completion_response(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                                const std::string& finish_reason, int64_t prompt_tokens, int64_t completion_tokens) {
  return dump({{"id", id},
               {"object", "text_completion"},
               {"created", created},
               {"model", model},
               {"choices", json::array({{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}})},
               {"usage",
                {{"prompt_tokens", prompt_tokens},
                 {"completion_tokens", completion_tokens},
                 {"total_tokens", prompt_tokens + completion_tokens}}}});
}

std::string completion_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                             const std::string& finish_reason) {
  const json reason = finish_reason.empty() ? json(nullptr) : json(finish_reason);
  return dump({{"id", id},
               {"object", "text_completion"},
               {"created", created},
               {"model", model},
               {"choices", json::array({{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", reason}}})}});
}

std::string models_response(const std::string& model, int64_t created) {
  return dump({{"object", "list"},
               {"data", json::array({{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "meshtrain"}}})}});
}

std::string error_response(const std::string& message, const std::string& type, const std::string& param) {
  return dump({{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? json(nullptr) : json(param)},
                 {"code", nullptr}}}});
}

}  // namespace meshtrain::serve
