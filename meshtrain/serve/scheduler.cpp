#include "meshtrain/serve/scheduler.h"

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/text_stream.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>

namespace meshtrain::serve {

namespace {

std::string c10_message(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

// What a client is told: the cause, without the advice for training runs that follows it.
std::string first_sentence(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  const size_t end = line.find(". ");
  return end == std::string::npos ? line : line.substr(0, end);
}

}  // namespace

struct Scheduler::Turn {
  bool stop = false;
  std::vector<uint64_t> cancel;
  std::vector<GenerationRequest> admit;

  std::string to_json() const {
    nlohmann::json j = {{"stop", stop}, {"cancel", cancel}, {"admit", nlohmann::json::array()}};
    for (const GenerationRequest& r : admit) {
      j["admit"].push_back({{"id", r.id},
                            {"prompt", r.prompt},
                            {"tokens", r.options.tokens},
                            {"temperature", r.options.temperature},
                            {"top_k", r.options.top_k},
                            {"top_p", r.options.top_p},
                            {"seed", r.options.seed},
                            {"logprobs", r.extras.logprobs},
                            {"prompt_logprobs", r.extras.prompt_logprobs},
                            {"logit_bias", r.extras.logit_bias},
                            {"presence_penalty", r.extras.presence_penalty},
                            {"frequency_penalty", r.extras.frequency_penalty}});
    }
    return j.dump();
  }
  static Turn from_json(const std::string& text) {
    const nlohmann::json j = nlohmann::json::parse(text);
    Turn turn;
    turn.stop = j.at("stop");
    turn.cancel = j.at("cancel").get<std::vector<uint64_t>>();
    for (const nlohmann::json& a : j.at("admit")) {
      GenerationRequest r;
      r.id = a.at("id");
      r.prompt = a.at("prompt").get<std::vector<int64_t>>();
      r.options.tokens = a.at("tokens");
      r.options.temperature = a.at("temperature");
      r.options.top_k = a.at("top_k");
      r.options.top_p = a.at("top_p");
      r.options.seed = a.at("seed");
      r.extras.logprobs = a.at("logprobs");
      r.extras.prompt_logprobs = a.at("prompt_logprobs");
      r.extras.logit_bias = a.at("logit_bias").get<std::vector<std::pair<int64_t, double>>>();
      r.extras.presence_penalty = a.at("presence_penalty");
      r.extras.frequency_penalty = a.at("frequency_penalty");
      turn.admit.push_back(std::move(r));
    }
    return turn;
  }
};

struct Scheduler::Live {
  std::shared_ptr<CompletionJob> job;
  model::TextStream text;
  int64_t made = 0;
  bool ended = false;  // answered (stop string) or abandoned: to be cancelled in the engine
};

Scheduler::Scheduler(InferenceModel& model, parallel::CommPtr group, SchedulerOptions options)
    : model_(model), group_(std::move(group)), options_(options), engine_(model, options.max_batch) {
  if (options_.queue < 0) throw std::invalid_argument("the queue length must be >= 0");
}

Scheduler::~Scheduler() = default;

namespace {

GenerationRequest request_of(const CompletionParams& p) {
  GenerationRequest r;
  r.prompt = p.prompt_ids;
  r.options.tokens = p.max_tokens;
  r.options.temperature = p.temperature;
  r.options.top_k = p.top_k;
  r.options.top_p = p.top_p;
  r.options.seed = p.seed;
  r.extras = p.extras;
  return r;
}

}  // namespace

void Scheduler::check(const CompletionJob& job) const { engine_.check(request_of(job.params())); }

Submitted Scheduler::submit(std::vector<std::shared_ptr<CompletionJob>> jobs) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (draining_) return Submitted::kDraining;
  // All or none, and together: one request's generations share a prefill.
  if (static_cast<int64_t>(jobs.size()) > options_.queue) return Submitted::kTooLarge;
  if (static_cast<int64_t>(queue_.size() + jobs.size()) > options_.queue) return Submitted::kQueueFull;
  for (auto& job : jobs) queue_.push_back(std::move(job));
  wake_.notify_all();
  return Submitted::kQueued;
}

void Scheduler::drain() {
  std::lock_guard<std::mutex> lock(mutex_);
  draining_ = true;
  wake_.notify_all();
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return draining_;
}

Scheduler::Turn Scheduler::next_turn() {
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, std::chrono::milliseconds(500),
                 [&] { return !queue_.empty() || !live_.empty() || draining_; });
  Turn turn;
  for (auto it = live_.begin(); it != live_.end();) {
    Live& live = *it->second;
    if (!live.ended && live.job->abandoned) {
      live.ended = true;
      live.job->fail("the client went away");
    }
    if (!live.ended) {
      ++it;
      continue;
    }
    turn.cancel.push_back(it->first);
    it = live_.erase(it);
  }
  int64_t room = engine_.room() + static_cast<int64_t>(turn.cancel.size());
  while (room > 0 && !queue_.empty()) {
    std::shared_ptr<CompletionJob> job = std::move(queue_.front());
    queue_.pop_front();
    if (job->abandoned) {
      job->fail("the client went away");
      continue;
    }
    GenerationRequest request = request_of(job->params());
    request.id = next_id_++;
    auto decode = model_.continuation(job->params().prompt_ids, job->params().skip_special_tokens);
    live_[request.id] = std::make_unique<Live>(
        Live{job, model::TextStream(decode, job->params().stop, model_.tokenizer().stop_ids())});
    turn.admit.push_back(std::move(request));
    --room;
  }
  turn.stop = draining_ && queue_.empty() && live_.empty();
  return turn;
}

namespace {

// A forward that threw (out of memory, most likely) fails the requests it
// served and no others (Note [Forward failures]); a communication failure
// ends the loop, since the ranks no longer agree on what they run.
template <typename Forward>
std::vector<TokenEvent> contained(Forward forward, const std::function<std::vector<uint64_t>()>& failed,
                                  const char* what, bool leader) {
  try {
    return forward();
  } catch (const comm::CommError&) {
    throw;
  } catch (const std::exception& e) {
    const std::string message = c10_message(e);
    if (leader) std::fprintf(stderr, "meshtrain serve: %s failed; its requests fail, the server goes on: %s\n", what,
                             message.c_str());
    std::vector<TokenEvent> events;
    for (uint64_t id : failed()) {
      TokenEvent event;
      event.id = id, event.last = true;
      event.error = std::string("the server could not run this request's ") + what + ": " + first_sentence(message);
      events.push_back(std::move(event));
    }
    return events;
  }
}

}  // namespace

// Note [Forward failures]
// A forward can throw for one batch's sake alone: a long prompt, scored with
// logprobs over a large vocabulary, may need more memory than the limit
// (memory.limit_mb) allows. A prefill that throws leaves the running batch as
// it was (BatchEngine::prefill puts back its cache and rows, whichever step
// threw): the requests it admitted fail. A decoding step that throws leaves the cache in an unknown state: the
// running requests fail and the engine starts again empty. Either way the
// others queued go on, and the loop too. Under tensor parallel every rank
// does the same, which holds when the failure is the same on every rank (the
// same shapes, the same limit); a failure on one rank alone leaves the others
// in a collective, which the communicator's watchdog ends with the server.
void Scheduler::apply(const Turn& turn) {
  const bool leader = !group_ || group_->rank() == 0;
  for (uint64_t id : turn.cancel) engine_.cancel(id);
  std::vector<TokenEvent> events = contained([&] { return engine_.admit(turn.admit); },
                                             [&] {
                                               std::vector<uint64_t> ids;
                                               for (const GenerationRequest& r : turn.admit) ids.push_back(r.id);
                                               return ids;
                                             },
                                             "prompt processing (prefill)", leader);
  const std::vector<TokenEvent> stepped =
      contained([&] { return engine_.step(); }, [&] { return engine_.reset(); }, "decoding step", leader);
  events.insert(events.end(), stepped.begin(), stepped.end());
  if (leader) deliver(events);
}

void Scheduler::deliver(const std::vector<TokenEvent>& events) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const TokenEvent& e : events) {
    auto it = live_.find(e.id);
    if (it == live_.end()) continue;
    Live& live = *it->second;
    if (live.ended) {  // its cancel goes out next turn
      if (e.last) live_.erase(it);
      continue;
    }
    if (!e.error.empty()) {  // this request alone failed; it has left the batch
      live.job->fail(e.error);
      live_.erase(it);
      continue;
    }
    if (live.made == 0 && live.job->params().extras.prompt_logprobs) live.job->set_prompt_logprobs(e.prompt);
    if (e.token < 0) {  // the prompt scored, nothing generated
      live.job->finish("length", 0);
      live_.erase(it);
      continue;
    }
    try {
      const size_t before = live.text.tokens().size();
      const std::string piece = live.text.push(e.token);
      // An end token is not part of the text, nor of its logprobs.
      const bool kept = live.text.tokens().size() > before && live.job->params().extras.logprobs >= 0;
      live.job->push(piece, kept ? &e.logprob : nullptr);
      ++live.made;
      if (live.text.stopped()) {
        live.job->finish("stop", live.made);
        live.ended = true;
      } else if (e.last) {
        live.job->push(live.text.finish());
        live.job->finish("length", live.made);
      }
    } catch (const std::exception& error) {  // on rank 0 alone: cancelled on every rank next turn
      live.job->fail(std::string("the generated text cannot be decoded: ") + error.what());
      live.ended = true;
    }
    if (e.last && (live.ended || live.job->done())) live_.erase(it);
  }
}

void Scheduler::fail_all(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, live] : live_) live->job->fail(message);
  for (auto& job : queue_) job->fail(message);
  live_.clear();
  queue_.clear();
  draining_ = true;
}

void Scheduler::run() {
  const bool leader = !group_ || group_->rank() == 0;
  const bool split = group_ && group_->size() > 1;
  while (true) {
    Turn turn;
    try {
      if (leader) turn = next_turn();
      if (split) {  // rank 0's turn to the group: its length, then its bytes
        std::string bytes = leader ? turn.to_json() : std::string();
        at::Tensor length = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
        group_->broadcast(length, 0).wait();
        at::Tensor buffer = at::empty({length.item<int64_t>()}, at::kByte);
        if (leader) std::memcpy(buffer.data_ptr(), bytes.data(), bytes.size());
        group_->broadcast(buffer, 0).wait();
        if (!leader) turn = Turn::from_json(std::string(static_cast<const char*>(buffer.data_ptr()), buffer.numel()));
      }
      if (turn.stop) return;
      apply(turn);
    } catch (const std::exception& e) {
      if (leader) fail_all(std::string("the server failed: ") + e.what());
      throw;
    }
  }
}

}  // namespace meshtrain::serve
