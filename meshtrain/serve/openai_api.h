// The OpenAI API's JSON (and vLLM's extensions clients rely on): requests
// read and checked, responses, stream chunks and errors written.
// https://platform.openai.com/docs/api-reference/completions and /chat
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshtrain/serve/completion.h"

namespace meshtrain::serve {

using ojson = nlohmann::ordered_json;

// A request the API answers with an error: HTTP status, OpenAI's error type
// ("invalid_request_error", ...) and the parameter at fault.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "", std::string type = "invalid_request_error")
      : std::runtime_error(message), status(status), param(std::move(param)), type(std::move(type)) {}
  int status;
  std::string param, type;
};

// One prompt as a request gave it: text, or token ids.
struct PromptInput {
  std::string text;
  std::vector<int64_t> ids;
  bool is_ids = false;
};

// What the completions and chat endpoints share.
struct GenerationRequestBody {
  CompletionParams params;  // prompt fields empty; seed the first choice's
  int64_t n = 1;            // choices per prompt (seeds seed, seed + 1, ...)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
};

// POST /v1/completions. prompt: a string, a list of strings, a list of ids,
// or a list of id lists (one choice group each); max_tokens (0 with echo and
// logprobs scores the prompt); logprobs 0-20 with echo gives the prompt's
// too; logit_bias, presence / frequency penalty, n, best_of = n, stop,
// seed, stream (+ stream_options), top_k and add_special_tokens (vLLM's).
struct CompletionRequest : GenerationRequestBody {
  std::vector<PromptInput> prompts;
  bool echo = false;
  bool add_special_tokens = true;
};

// POST /v1/chat/completions: messages through the model's chat template;
// logprobs (bool) + top_logprobs 0-20; max_completion_tokens or max_tokens;
// tools (to the template), chat_template_kwargs and add_generation_prompt
// (vLLM's).
struct ChatRequest : GenerationRequestBody {
  ojson messages;
  ojson tools;
  ojson template_kwargs;
  bool add_generation_prompt = true;
  bool logprobs = false;
};

// POST /tokenize (vLLM's shape): {prompt, add_special_tokens} or {messages,
// add_generation_prompt}; POST /detokenize: {tokens}.
struct TokenizeRequest {
  std::string prompt;
  ojson messages;  // null unless a conversation is tokenized
  bool add_special_tokens = true;
  bool add_generation_prompt = true;
  bool return_token_strs = false;  // each id's vocabulary string beside the ids
};

// Each throws ApiError: 400 naming the field (an unknown one included), 404
// for another model's name.
CompletionRequest parse_completion_request(const std::string& body, const std::string& served_model);
ChatRequest parse_chat_request(const std::string& body, const std::string& served_model);
TokenizeRequest parse_tokenize_request(const std::string& body, const std::string& served_model);
std::vector<int64_t> parse_detokenize_request(const std::string& body, const std::string& served_model);

// One choice of an answer, or of a stream chunk (finish_reason empty: not yet).
struct Choice {
  int64_t index = 0;
  std::string text;
  std::string finish_reason;
  ojson logprobs;  // null, or the endpoint's logprobs object
};

std::string completion_response(const std::string& id, int64_t created, const std::string& model,
                                 const std::vector<Choice>& choices, int64_t prompt_tokens, int64_t completion_tokens);
std::string completion_chunk(const std::string& id, int64_t created, const std::string& model, const Choice& choice);
std::string chat_response(const std::string& id, int64_t created, const std::string& model,
                          const std::vector<Choice>& choices, int64_t prompt_tokens, int64_t completion_tokens);
// A chat chunk: `role` set on a choice's first chunk, the text as delta content.
std::string chat_chunk(const std::string& id, int64_t created, const std::string& model, const Choice& choice,
                       bool role);
// The last chunk of a stream with include_usage: no choices, the usage.
std::string usage_chunk(const std::string& id, int64_t created, const std::string& model, const std::string& object,
                        int64_t prompt_tokens, int64_t completion_tokens);
std::string models_response(const std::string& model, int64_t created);
std::string model_response(const std::string& model, int64_t created);
std::string error_response(const std::string& message, const std::string& type, const std::string& param);
// JSON text for a response: invalid UTF-8 (a character cut by max_tokens) becomes U+FFFD.
std::string dump(const ojson& j);

namespace api_detail {
// The field readers both parse files use.
ojson parse_body(const std::string& text, const std::string& served_model, const std::vector<std::string>& known);
ApiError bad(const std::string& param, const std::string& message);
void read_sampling(const ojson& body, GenerationRequestBody& r, const char* max_tokens_field, int64_t max_tokens_default);
bool flag(const ojson& body, const char* name, bool fallback);
}  // namespace api_detail

}  // namespace meshtrain::serve
