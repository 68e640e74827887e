// The OpenAI completions API's JSON: requests read and checked, responses,
// stream chunks and errors written. https://platform.openai.com/docs/api-reference/completions
#pragma once

#include "meshtrain/serve/completion.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace meshtrain::serve {

// A request the API answers with an error: HTTP status, OpenAI's error type
// ("invalid_request_error", ...) and the parameter at fault.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "", std::string type = "invalid_request_error")
      : std::runtime_error(message), status(status), param(std::move(param)), type(std::move(type)) {}
  int status;
  std::string param, type;
};

// POST /v1/completions' body. Supported: model, prompt (a string, or a list
// of one), max_tokens, temperature, top_p, top_k (an extension), seed, stop
// (a string or up to 4), stream, echo, n = 1, best_of = 1, logprobs null.
// Throws ApiError 400 naming the field (404 for another model's name).
CompletionParams parse_completion_request(const std::string& body, const std::string& served_model);

std::string completion_response(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                                const std::string& finish_reason, int64_t prompt_tokens, int64_t completion_tokens);
// One server-sent event's data: a piece of text, or (finish_reason set) the end.
std::string completion_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                             const std::string& finish_reason);
std::string models_response(const std::string& model, int64_t created);
std::string error_response(const std::string& message, const std::string& type, const std::string& param);

}  // namespace meshtrain::serve
