#include "meshtrain/fl/coordinator.h"

#include <algorithm>
#include <iomanip>
#include <random>
#include <sstream>

namespace meshtrain::fl {
namespace {

constexpr auto kLiveness = std::chrono::seconds(30);  // a client silent this long is gone
constexpr auto kLongPoll = std::chrono::seconds(1);

bool valid_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

std::string new_session() {
  static std::mt19937_64 rng(std::random_device{}());
  std::ostringstream s;  // fixed length: a result's size does not depend on its session
  s << std::hex << std::setfill('0') << std::setw(16) << rng() << std::setw(16) << rng();
  return s.str();
}

const char* kind_name(wire::Task::Kind kind) { return wire::Task::Kind_Name(kind).c_str(); }

}  // namespace

bool Coordinator::live(const Client& c, Clock::time_point now) const { return !c.left && now - c.seen < kLiveness; }

std::string Coordinator::check_session(const std::string& id, const std::string& session) {
  auto it = clients_.find(id);
  if (it == clients_.end() || it->second.session != session)
    return "unknown client or session '" + id + "': call Join first";
  if (it->second.left) return "the session of '" + id + "' has ended (it left, or its connection broke): call Join again";
  it->second.seen = Clock::now();
  return {};
}

// Note [Client sessions]
// Join hands out a random 128-bit session that every later call quotes. An id
// whose session is live (not left, heard from within 30 s, its Presence call
// unbroken) cannot be taken by another Join: without mutual TLS an id proves
// nothing, and replacing the session would cancel the live client's round.
// A client rejoining after a lost link quotes its old session; under mutual
// TLS the certificate proves the name, so a new Join replaces the session (a
// restarted process). A client whose Presence call breaks is gone at once:
// the round in progress stops waiting for it. The server holds a Presence
// call without a thread (Note [Calls without threads] in server_calls.h).
std::string Coordinator::join(const wire::JoinRequest& request, const std::string& peer_name, const std::string& address,
                              std::string* session, Refusal* refusal) {
  *refusal = Refusal::kDenied;
  const std::string& id = request.client_id();
  if (!valid_id(id)) return "client id '" + id + "': use 1 to 128 letters, digits, '_', '-' or '.'";
  uint64_t examples = request.tokens() > 0 ? (request.tokens() - 1) / static_cast<uint64_t>(std::max<int64_t>(1, context_))
                                            : request.examples();
  if (examples == 0)
    return "client '" + id + "' declares 0 training sequences of " + std::to_string(context_) +
           " tokens: it has nothing to train on";
  if (!allow_.empty() && std::find(allow_.begin(), allow_.end(), peer_name) == allow_.end())
    return "client certificate '" + peer_name + "' is not on the server's allow list";
  if (mutual_ && peer_name != id) return "client id '" + id + "' differs from its certificate's name '" + peer_name + "'";
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return "the federation has finished";
  const auto now = Clock::now();
  if (auto it = clients_.find(id); it != clients_.end() && live(it->second, now) && !mutual_ &&
                                   request.resume_session() != it->second.session) {
    *refusal = Refusal::kInUse;
    const auto quiet = std::chrono::duration_cast<std::chrono::seconds>(now - it->second.seen).count();
    return "client id '" + id + "' belongs to a live session (heard from " + std::to_string(quiet) +
           " s ago): use another id, or join again once that client has left or been silent for " +
           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kLiveness).count()) +
           " s (under mutual TLS the certificate proves the id and the new session replaces the old)";
  }
  // A rejoin (the old session quoted) cannot raise the examples declared (Note [Client bounds]).
  const auto known = clients_.find(id);
  const bool rejoin = known != clients_.end() && request.resume_session() == known->second.session;
  if (rejoin) examples = std::min(examples, known->second.examples);
  // Note [Admission without mutual TLS]: live ids per source address.
  if (ids_per_address_ > 0 && !(known != clients_.end() && live(known->second, now))) {
    int64_t from_there = 0;
    for (const auto& [other, c] : clients_) from_there += c.address == address && live(c, now);
    if (from_there >= ids_per_address_) {
      *refusal = Refusal::kBusy;
      return std::to_string(from_there) + " live clients have joined from " + address +
             ", fl.server.ids_per_address = " + std::to_string(ids_per_address_) + ": join again once one leaves";
    }
  }
  forget_idle(now);
  Client& c = clients_[id];
  c = Client{new_session(), now, false, false, examples, address};
  *session = c.session;
  changed_.notify_all();
  return {};
}

// Note [Admission without mutual TLS]: ids neither live nor awaited, once
// they outnumber the live ones by 4,096.
void Coordinator::forget_idle(Clock::time_point now) {
  constexpr size_t kSlack = 4096;
  if (clients_.size() < kSlack) return;
  size_t alive = 0;
  for (const auto& [id, c] : clients_) alive += live(c, now);
  if (clients_.size() < alive + kSlack) return;
  std::set<std::string> buffered;
  for (const wire::Result& r : buffer_) buffered.insert(r.client_id());
  for (auto it = clients_.begin(); it != clients_.end();) {
    const std::string& id = it->first;
    const bool awaited = expected_.count(id) || results_.count(id) || in_flight_.count(id) || uploading_.count(id) ||
                         buffered.count(id);
    if (live(it->second, now) || awaited) {
      ++it;
      continue;
    }
    last_version_.erase(id);
    it = clients_.erase(it);
  }
}

std::string Coordinator::poll(const wire::PollRequest& request, Clock::time_point since,
                              std::shared_ptr<const std::string>* task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::string e = check_session(request.client_id(), request.session()); !e.empty()) return e;
  const std::string& id = request.client_id();
  task->reset();
  auto it = pending_.find(id);
  if (it != pending_.end()) {
    *task = std::move(it->second);
    pending_.erase(it);
    traffic_[id].down += static_cast<int64_t>((*task)->size());
    return {};
  }
  if (assign_async(id)) {
    *task = async_task_;
    traffic_[id].down += static_cast<int64_t>((*task)->size());
    return {};
  }
  wire::Task answer;
  if (stopping_) {
    answer.set_kind(wire::Task::STOP);
    answer.set_message(stop_message_);
    clients_[id].stopped = true;
    changed_.notify_all();
  } else if (Clock::now() - since >= kLongPoll) {
    answer.set_kind(wire::Task::WAIT);
  } else {
    return {};  // no answer yet
  }
  *task = std::make_shared<const std::string>(answer.SerializeAsString());
  return {};
}

void Coordinator::on_change(std::function<void()> listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.push_back(std::move(listener));
}

void Coordinator::changed() {
  changed_.notify_all();
  for (const auto& listener : listeners_) listener();
}

bool Coordinator::awaits(const std::string& id) const {
  if (async_) return phase_open_ && !stopping_ && in_flight_.count(id);
  return phase_open_ && expected_.count(id) && !results_.count(id) && results_.size() < enough_;
}

std::string Coordinator::refusal(const std::string& id) {
  if (async_ && !stopping_ && last_version_.count(id) && !in_flight_.count(id) &&
      round_ - last_version_[id] > max_staleness_) {
    too_stale_.push_back(id);
    return "result refused as too stale: '" + id + "' trained from model version " +
           std::to_string(last_version_[id]) + ", the server is at version " + std::to_string(round_) +
           ", more than fl.async.max_staleness = " + std::to_string(max_staleness_) + " behind";
  }
  return std::string("result refused: the server awaits none from '") + id + "' now; it is at round " +
         std::to_string(round_) + " " + kind_name(kind_) + (phase_open_ ? "" : " (closed)");
}

bool Coordinator::assign_async(const std::string& id) {
  if (!async_ || !phase_open_ || stopping_ || !async_task_ || in_flight_.count(id) || in_flight_.size() >= concurrency_ ||
      buffer_.size() >= async_buffer_)  // the version is full: the next one is coming
    return false;
  if (auto it = last_version_.find(id); it != last_version_.end() && it->second == round_) return false;
  for (const wire::Result& r : buffer_)  // its last result not yet aggregated: one per aggregation
    if (r.client_id() == id) return false;
  in_flight_[id] = round_;
  last_version_[id] = round_;
  assigned_.push_back(id);
  return true;
}

std::string Coordinator::may_submit(const std::string& id, const std::string& session, bool first, uint64_t round,
                                    wire::Task::Kind kind) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (first) {
    if (std::string e = check_session(id, session); !e.empty()) return e;
    if (awaits(id) && uploading_.count(id)) return "result refused: '" + id + "' is uploading one already";
  }
  if (!awaits(id)) return refusal(id);
  if (first && round != 0) {  // what the result answers, from its first chunk (checked again whole, in submit)
    if (async_ && round != in_flight_[id])
      return "result for version " + std::to_string(round) + " refused: '" + id + "' was handed version " +
             std::to_string(in_flight_[id]);
    if (!async_ && (round != round_ || kind != kind_))
      return "result for round " + std::to_string(round) + " " + kind_name(kind) + " refused: the server is at round " +
             std::to_string(round_) + " " + kind_name(kind_);
  }
  uploading_.insert(id);
  return {};
}

void Coordinator::upload_ended(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  uploading_.erase(id);
}

std::string Coordinator::submit(wire::Result&& result) {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::string id = result.client_id();
  if (std::string e = check_session(id, result.session()); !e.empty()) return e;
  if (async_) {  // Note [Buffered asynchronous rounds]
    if (!awaits(id)) return refusal(id);
    if (result.kind() != wire::Task::FIT || result.round() != in_flight_[id])
      return "result for version " + std::to_string(result.round()) + " refused: '" + id + "' was handed version " +
             std::to_string(in_flight_[id]);
    in_flight_.erase(id);
    traffic_[id].up += static_cast<int64_t>(result.ByteSizeLong());
    buffer_.push_back(std::move(result));
    changed();  // a slot is free: a waiting poll may take it
    return {};
  }
  if (!awaits(id) || result.round() != round_ || result.kind() != kind_) {
    std::ostringstream why;
    why << "result for round " << result.round() << " " << kind_name(result.kind()) << " refused: the server is at round "
        << round_ << " " << kind_name(kind_) << (phase_open_ ? "" : " (closed)");
    return why.str();
  }
  traffic_[id].up += static_cast<int64_t>(result.ByteSizeLong());
  if (sink_ && kind_ == wire::Task::FIT) {  // Note [Streaming the mean]
    wire::Result& kept = results_[id];       // counted now, its update handed on
    kept.set_client_id(id);
    kept.set_round(result.round());
    kept.set_kind(result.kind());
    kept.set_examples(result.examples());
    kept.set_train_loss(result.train_loss());
    const Sink sink = sink_;
    ++sinking_;
    lock.unlock();
    try {
      sink(id, result);
    } catch (...) {
      lock.lock();
      --sinking_;
      changed_.notify_all();
      throw;
    }
    lock.lock();
    --sinking_;
    changed_.notify_all();
    return {};
  }
  results_[id] = std::move(result);
  changed_.notify_all();
  return {};
}

void Coordinator::stream_results(Sink sink) {
  std::lock_guard<std::mutex> lock(mutex_);
  sink_ = std::move(sink);
}

std::string Coordinator::leave(const wire::LeaveRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::string e = check_session(request.client_id(), request.session()); !e.empty()) return e;
  clients_[request.client_id()].left = true;
  if (in_flight_.erase(request.client_id())) changed();
  changed_.notify_all();
  return {};
}

std::string Coordinator::presence(const wire::PollRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  return check_session(request.client_id(), request.session());
}

bool Coordinator::ended(const std::string& id, const std::string& session) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = clients_.find(id);
  return stopping_ || it == clients_.end() || it->second.session != session || it->second.left;
}

void Coordinator::gone(const std::string& id, const std::string& session) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = clients_.find(id);
  if (it == clients_.end() || it->second.session != session || it->second.left) return;
  it->second.left = true;
  if (in_flight_.erase(id)) changed();
  changed_.notify_all();
}

uint64_t Coordinator::declared_examples(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = clients_.find(id);
  return it == clients_.end() ? 0 : it->second.examples;
}

std::vector<std::string> Coordinator::wait_for_clients(size_t count, double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  std::vector<std::string> ids;
  auto enough = [&] {
    ids.clear();
    const auto now = Clock::now();
    for (const auto& [id, c] : clients_)
      if (live(c, now)) ids.push_back(id);
    return ids.size() >= count;
  };
  changed_.wait_for(lock, std::chrono::duration<double>(seconds), enough);
  enough();
  return ids;
}

void Coordinator::open(uint64_t round, wire::Task::Kind kind, std::map<std::string, wire::Task> tasks) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_ = round;
  kind_ = kind;
  phase_open_ = true;
  expected_.clear();
  results_.clear();
  pending_.clear();
  enough_ = SIZE_MAX;
  for (auto& [id, task] : tasks) {
    task.set_round(round);
    task.set_kind(kind);
    expected_.insert(id);
    pending_[id] = std::make_shared<const std::string>(task.SerializeAsString());
  }
  changed();
}

void Coordinator::open(uint64_t round, wire::Task task, const std::vector<std::string>& ids, size_t enough) {
  task.set_round(round);
  const auto bytes = std::make_shared<const std::string>(task.SerializeAsString());
  std::lock_guard<std::mutex> lock(mutex_);
  round_ = round;
  kind_ = task.kind();
  phase_open_ = true;
  expected_ = std::set<std::string>(ids.begin(), ids.end());
  results_.clear();
  pending_.clear();
  for (const auto& id : ids) pending_[id] = bytes;
  enough_ = enough;
  changed();
}

std::map<std::string, wire::Result> Coordinator::close(double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  changed_.wait_until(lock, deadline, [&] {
    if (results_.size() == expected_.size() || results_.size() >= enough_) return true;
    // A client that left cannot answer: do not wait for it.
    for (const auto& id : expected_)
      if (!results_.count(id) && !clients_[id].left) return false;
    return true;
  });
  phase_open_ = false;
  pending_.clear();
  changed_.wait(lock, [&] { return sinking_ == 0; });  // the results taken have all been streamed
  return std::move(results_);
}

void Coordinator::open_async(uint64_t version, wire::Task task, size_t buffer, size_t concurrency,
                             uint64_t max_staleness) {
  task.set_round(version);
  task.set_kind(wire::Task::FIT);
  auto bytes = std::make_shared<const std::string>(task.SerializeAsString());
  std::lock_guard<std::mutex> lock(mutex_);
  async_ = true;
  phase_open_ = true;
  round_ = version;
  kind_ = wire::Task::FIT;
  async_buffer_ = buffer;
  concurrency_ = concurrency == 0 ? SIZE_MAX : concurrency;
  max_staleness_ = max_staleness;
  async_task_ = std::move(bytes);
  for (auto it = in_flight_.begin(); it != in_flight_.end();)  // too old to count: the slot is free
    it = version - it->second > max_staleness ? in_flight_.erase(it) : std::next(it);
  changed();
}

Coordinator::Buffered Coordinator::take_buffered(size_t count, double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  changed_.wait_until(lock, deadline, [&] { return buffer_.size() >= count || stopping_; });
  Buffered out;
  async_task_.reset();  // until the next version opens
  const size_t n = std::min(count, buffer_.size());
  out.results.assign(std::make_move_iterator(buffer_.begin()), std::make_move_iterator(buffer_.begin() + n));
  buffer_.erase(buffer_.begin(), buffer_.begin() + n);
  out.assigned = std::exchange(assigned_, {});
  out.too_stale = std::exchange(too_stale_, {});
  std::sort(out.too_stale.begin(), out.too_stale.end());  // refused at each chunk it sent: once each
  out.too_stale.erase(std::unique(out.too_stale.begin(), out.too_stale.end()), out.too_stale.end());
  return out;
}

std::map<std::string, Traffic> Coordinator::take_traffic() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(traffic_, {});
}

void Coordinator::stop(const std::string& message, double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  stopping_ = true;
  stop_message_ = message;
  changed();
  changed_.wait_for(lock, std::chrono::duration<double>(seconds), [&] {
    const auto now = Clock::now();
    for (const auto& [id, c] : clients_)
      if (live(c, now) && !c.stopped) return false;
    return true;
  });
}

}  // namespace meshtrain::fl
