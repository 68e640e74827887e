// POST /v1/completions and /v1/chat/completions: requests into jobs (n per
// prompt), jobs into answers or server-sent events.
#include <algorithm>

#include "meshtrain/serve/client_stream.h"
#include "meshtrain/serve/frontend_impl.h"
#include "meshtrain/serve/logprobs.h"

namespace meshtrain::serve {

namespace {

// The prompt's ids and text (the text, when the prompt came as ids, for echo).
void prompt_of(const PromptInput& p, bool add_special_tokens, bool need_text, const text::Tokenizer& tokenizer,
               CompletionParams& params) {
  if (p.is_ids) {
    params.prompt_ids = p.ids;
    if (need_text) params.prompt = tokenizer.decode(p.ids);
    return;
  }
  params.prompt = p.text;
  params.prompt_ids = tokenizer.encode(p.text);
  if (add_special_tokens) params.prompt_ids = tokenizer.with_special_tokens(std::move(params.prompt_ids));
}

void add_choices(Generation& g, const CompletionParams& params, int64_t n, const std::string& prefix) {
  for (int64_t i = 0; i < n; ++i) {
    CompletionParams one = params;
    one.seed = params.seed + static_cast<uint64_t>(i);
    Generation::One choice;
    choice.job = std::make_shared<CompletionJob>(std::move(one));
    choice.index = static_cast<int64_t>(g.ones.size());
    choice.prefix = prefix;
    g.ones.push_back(std::move(choice));
  }
  g.prompt_tokens += static_cast<int64_t>(params.prompt_ids.size());
}

void abandon(Generation& g) {
  for (Generation::One& one : g.ones) one.job->abandoned = true;
}

}  // namespace

void HttpFrontend::Impl::completions(const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& content) {
  std::string body;
  if (!read_body(req, content, body, res)) return;
  CompletionRequest r;
  try {
    r = parse_completion_request(body, model.name);
  } catch (const ApiError& e) {
    return send_error(res, e.status, e.what(), e.type, e.param);
  }
  auto g = std::make_shared<Generation>();
  g->echo = r.echo;
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    CompletionParams params = r.params;
    try {
      prompt_of(r.prompts[i], r.add_special_tokens, r.echo, *model.tokenizer, params);
    } catch (const text::TokenizerError& e) {
      const std::string which = r.prompts.size() > 1 ? "prompt " + std::to_string(i) : "the prompt";
      return send_error(res, 400, which + " cannot be tokenized: " + e.what(), "invalid_request_error", "prompt");
    }
    add_choices(*g, params, r.n, r.echo ? params.prompt : "");
  }
  if (!start(*g, res)) return;
  if (r.stream) return stream(g, r.include_usage, res);
  answer(*g, res);
}

void HttpFrontend::Impl::chat(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& content) {
  std::string body;
  if (!read_body(req, content, body, res)) return;
  ChatRequest r;
  try {
    r = parse_chat_request(body, model.name);
  } catch (const ApiError& e) {
    return send_error(res, e.status, e.what(), e.type, e.param);
  }
  if (!model.chat) {
    return send_error(res, 400, "this model has no chat template (tokenizer_config.json's chat_template); use /v1/completions",
                      "invalid_request_error", "messages");
  }
  CompletionParams params = r.params;
  try {
    params.prompt = model.chat->render(r.messages, r.add_generation_prompt, r.tools, r.template_kwargs);
    params.prompt_ids = model.tokenizer->encode(params.prompt);  // the template wrote the special tokens
  } catch (const text::jinja::Error& e) {
    return send_error(res, 400, std::string("the chat template refused the conversation: ") + e.what(),
                      "invalid_request_error", "messages");
  } catch (const text::TokenizerError& e) {
    return send_error(res, 400, std::string("the conversation cannot be tokenized: ") + e.what(), "invalid_request_error",
                      "messages");
  }
  if (params.max_tokens < 0) {  // unset: the rest of the context
    params.max_tokens = model.context - static_cast<int64_t>(params.prompt_ids.size());
    if (params.max_tokens < 1) {
      return send_error(res, 400, "the conversation (" + std::to_string(params.prompt_ids.size()) +
                                      " tokens) fills the model's context of " + std::to_string(model.context) + " tokens",
                        "invalid_request_error", "messages");
    }
  }
  auto g = std::make_shared<Generation>();
  g->chat = true;
  add_choices(*g, params, r.n, "");
  if (!start(*g, res)) return;
  if (r.stream) return stream(g, r.include_usage, res);
  answer(*g, res);
}

bool HttpFrontend::Impl::start(Generation& g, httplib::Response& res) {
  for (const Generation::One& one : g.ones) {
    try {
      callbacks.check(*one.job);
    } catch (const std::invalid_argument& e) {
      send_error(res, 400, e.what(), "invalid_request_error");
      return false;
    }
  }
  std::vector<std::shared_ptr<CompletionJob>> jobs;
  for (const Generation::One& one : g.ones) jobs.push_back(one.job);
  ++in_flight;
  const Submitted submitted = callbacks.submit(jobs);
  if (submitted == Submitted::kQueued) return true;
  --in_flight;
  if (submitted == Submitted::kQueueFull) {
    res.set_header("Retry-After", "1");
    send_error(res, 429, "the server is busy: its queue is full; retry in a moment", "rate_limit_error");
  } else if (submitted == Submitted::kTooLarge) {
    send_error(res, 400, "this request asks for " + std::to_string(jobs.size()) +
                             " generations (prompts x n), more than the server queues (--queue)", "invalid_request_error", "n");
  } else {
    send_error(res, 503, "the server is shutting down", "server_error");
  }
  return false;
}

ojson HttpFrontend::Impl::logprobs_of(const Generation& g, const Generation::One& one,
                                      const std::vector<TokenLogprob>& tokens, bool with_prompt) const {
  const CompletionParams& params = one.job->params();
  if (params.extras.logprobs < 0) return nullptr;
  const TokenSpeller speller(*model.tokenizer);
  if (g.chat) return chat_logprobs(speller, tokens, params.prompt_ids);
  std::vector<TokenLogprob> all;
  std::vector<int64_t> before = params.prompt_ids;
  if (with_prompt) {
    all = one.job->prompt_logprobs();
    before.clear();
  }
  all.insert(all.end(), tokens.begin(), tokens.end());
  return completion_logprobs(speller, all, before, 0);
}

void HttpFrontend::Impl::answer(Generation& g, httplib::Response& res) {
  const int client = current_client();
  for (Generation::One& one : g.ones) {
    std::string piece;
    std::vector<TokenLogprob> tokens;
    while (one.job->next(piece, tokens, kPoll)) {
      one.text += piece;
      one.tokens.insert(one.tokens.end(), tokens.begin(), tokens.end());
      if (client >= 0 && !one.job->abandoned && client_gone(client)) abandon(g);  // nobody waits for the answer
    }
  }
  --in_flight;
  if (std::any_of(g.ones.begin(), g.ones.end(), [](const Generation::One& o) { return o.job->abandoned.load(); })) {
    res.status = 499;  // nobody reads this; 499 (client closed request) shows in the log
    return;
  }
  std::vector<Choice> choices;
  int64_t made = 0;
  for (const Generation::One& one : g.ones) {
    if (!one.job->error().empty()) return send_error(res, 500, one.job->error(), "server_error");
    choices.push_back(Choice{one.index, one.prefix + one.text, one.job->finish_reason(), logprobs_of(g, one, one.tokens, g.echo)});
    made += one.job->completion_tokens();
  }
  const std::string id = (g.chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  res.set_content(g.chat ? chat_response(id, now, model.name, choices, g.prompt_tokens, made)
                         : completion_response(id, now, model.name, choices, g.prompt_tokens, made),
                  "application/json");
}

namespace {

// A choice's next stretch of a stream, its logprobs spelled after what was sent before.
struct StreamState {
  std::vector<int64_t> seen;  // tokens before the next chunk's
  int64_t offset = 0;         // characters sent
};

}  // namespace

void HttpFrontend::Impl::stream(std::shared_ptr<Generation> g, bool include_usage, httplib::Response& res) {
  const std::string id = (g->chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  auto states = std::make_shared<std::vector<StreamState>>(g->ones.size());
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, g, id, now, include_usage, states](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& data) {
          if (sink.write(data.data(), data.size())) return true;
          abandon(*g);  // the client went away
          return false;
        };
        auto chunk = [&](const Choice& c, bool role) {
          return event(g->chat ? chat_chunk(id, now, model.name, c, role) : completion_chunk(id, now, model.name, c));
        };
        const auto wait = std::max(std::chrono::milliseconds(10), kPoll / static_cast<int>(g->ones.size()));
        for (size_t k = 0; k < g->ones.size(); ++k) {
          Generation::One& one = g->ones[k];
          StreamState& state = (*states)[k];
          if (one.finished) continue;
          std::string piece;
          std::vector<TokenLogprob> tokens;
          const bool more = one.job->next(piece, tokens, wait);
          if (!one.started && (!piece.empty() || !tokens.empty() || !more)) {
            one.started = true;  // a choice opens with its role (chat) or its echoed prompt
            state.seen = one.job->params().prompt_ids;
            ojson echoed = g->echo ? logprobs_of(*g, one, {}, true) : ojson();
            state.offset = characters(one.prefix);
            if ((g->chat || g->echo) && !send(chunk(Choice{one.index, one.prefix, "", echoed}, true))) return false;
          }
          if (!piece.empty() || !tokens.empty()) {
            ojson lp = nullptr;
            if (one.job->params().extras.logprobs >= 0) {
              const TokenSpeller speller(*model.tokenizer);
              lp = g->chat ? chat_logprobs(speller, tokens, state.seen)
                           : completion_logprobs(speller, tokens, state.seen, state.offset);
              for (const TokenLogprob& t : tokens) state.seen.push_back(t.token);
            }
            state.offset += characters(piece);
            if (!send(chunk(Choice{one.index, piece, "", lp}, false))) return false;
          }
          if (more) continue;
          one.finished = true;
          if (!one.job->error().empty()) {  // the stream ends with the error
            if (!send(event(error_response(one.job->error(), "server_error", ""))) || !send(event("[DONE]"))) return false;
            abandon(*g);
            sink.done();
            return true;
          }
          if (!send(chunk(Choice{one.index, "", one.job->finish_reason(), nullptr}, false))) return false;
        }
        if (!std::all_of(g->ones.begin(), g->ones.end(), [](const Generation::One& o) { return o.finished; })) return true;
        if (include_usage) {
          int64_t made = 0;
          for (const Generation::One& one : g->ones) made += one.job->completion_tokens();
          const char* object = g->chat ? "chat.completion.chunk" : "text_completion";
          if (!send(event(usage_chunk(id, now, model.name, object, g->prompt_tokens, made)))) return false;
        }
        if (!send(event("[DONE]"))) return false;
        sink.done();
        return true;
      },
      [this, g](bool success) {
        if (!success) abandon(*g);
        --in_flight;
      });
}

}  // namespace meshtrain::serve
