#include "meshtrain/fl/server_calls.h"

#include "meshtrain/fl/chunks.h"

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace meshtrain::fl {

Sweep::Sweep(std::chrono::milliseconds period, std::function<bool(SweptCall*)> due, std::function<void(SweptCall*)> act)
    : period_(period), due_(std::move(due)), act_(std::move(act)), thread_([this] { run(); }) {}

Sweep::~Sweep() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (SweptCall* call : calls_) call->release();
}

void Sweep::add(SweptCall* call) {
  call->hold();
  std::lock_guard<std::mutex> lock(mutex_);
  calls_.insert(call);
}

void Sweep::wake() {
  woken_ = true;
  wake_.notify_all();
}

void Sweep::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait_for(lock, period_, [&] { return stopping_ || woken_.load(); });
    if (stopping_) return;
    woken_ = false;
    std::vector<SweptCall*> due, gone;
    for (auto it = calls_.begin(); it != calls_.end();) {
      if ((*it)->is_done()) {
        gone.push_back(*it);
      } else if (due_(*it)) {
        due.push_back(*it);
      } else {
        ++it;
        continue;
      }
      it = calls_.erase(it);
    }
    lock.unlock();
    for (SweptCall* call : due) act_(call);
    for (SweptCall* call : due) call->release();
    for (SweptCall* call : gone) call->release();
    lock.lock();
  }
}

PresenceCall::PresenceCall(Coordinator& coordinator, wire::PollRequest request)
    : coordinator_(coordinator), request_(std::move(request)) {}

void PresenceCall::end(const grpc::Status& status) {
  if (!ended_.exchange(true)) Finish(status);
}

void PresenceCall::OnCancel() {
  if (ended_) return;  // ended by the server first: nothing was lost
  std::fprintf(stderr, "fl server: client '%s' disconnected\n", request_.client_id().c_str());
  coordinator_.gone(request_.client_id(), request_.session());
  end(grpc::Status::CANCELLED);
}

void PresenceCall::OnDone() { done(); }

PollCall::PollCall(Coordinator& coordinator, wire::PollRequest request)
    : coordinator_(coordinator), request_(std::move(request)) {}

bool PollCall::ready() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (ended_) return true;  // cancelled while it waited: answer() does nothing
  refusal_ = coordinator_.poll(request_, started_, &task_);
  return !refusal_.empty() || task_ != nullptr;
}

void PollCall::answer() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (ended_) return;
  if (!refusal_.empty()) return finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, refusal_));
  write_next();
}

void PollCall::refuse(const grpc::Status& status) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  finish(status);
}

namespace {

using Chunks = std::vector<std::string>;  // serialized Chunk messages

Chunks serialized_chunks(const std::string& bytes) {
  Chunks out;
  size_t at = 0;
  do {  // an empty message is one empty chunk
    out.push_back(chunk_at(bytes, &at, "", "").SerializeAsString());
  } while (at < bytes.size());
  return out;
}

// Note [Messages in chunks]: a FIT task, one string every sampled client
// shares, is cut into chunks once, and every poll that sends it sends those
// bytes (a thousand copies of the model would be a thousand models). Small
// answers (WAIT, STOP, a secure round's tasks) are cut per call.
std::shared_ptr<const Chunks> chunks_of(const std::shared_ptr<const std::string>& task) {
  constexpr size_t kShared = 64 << 10;
  if (task->size() < kShared) return std::make_shared<const Chunks>(serialized_chunks(*task));
  static std::mutex mutex;
  static std::map<const std::string*, std::pair<std::weak_ptr<const std::string>, std::weak_ptr<const Chunks>>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = cache.begin(); it != cache.end();)  // tasks no poll sends any more
    it = it->second.second.expired() || it->second.first.expired() ? cache.erase(it) : std::next(it);
  auto& [known, chunks] = cache[task.get()];
  if (auto shared = chunks.lock(); shared && known.lock() == task) return shared;
  auto made = std::make_shared<const Chunks>(serialized_chunks(*task));
  known = task;
  chunks = made;
  return made;
}

// A slice over one of `chunks`' strings, which it keeps alive until gRPC is done with it.
grpc::Slice slice_of(const std::shared_ptr<const Chunks>& chunks, size_t index) {
  const std::string& bytes = (*chunks)[index];
  auto* keep = new std::shared_ptr<const Chunks>(chunks);
  return grpc::Slice(const_cast<char*>(bytes.data()), bytes.size(),
                     [](void* kept) { delete static_cast<std::shared_ptr<const Chunks>*>(kept); }, keep);
}

}  // namespace

void PollCall::write_next() {
  if (cancelled_) return finish(grpc::Status::CANCELLED);
  if (!chunks_) chunks_ = chunks_of(task_);
  if (next_ >= chunks_->size()) return finish(grpc::Status::OK);
  grpc::Slice slice = slice_of(chunks_, next_++);
  buffer_ = grpc::ByteBuffer(&slice, 1);
  started_writing_ = true;
  StartWrite(&buffer_);
}

void PollCall::OnWriteDone(bool ok) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (ended_) return;
  if (!ok) return finish(grpc::Status::CANCELLED);  // the client went away mid-task
  write_next();
}

void PollCall::OnCancel() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  cancelled_ = true;
  // A write in flight completes (not ok) and finishes the call; one that waits is finished here.
  if (!started_writing_ && !ended_) finish(grpc::Status::CANCELLED);
}

void PollCall::OnDone() { done(); }

void PollCall::finish(const grpc::Status& status) {
  if (ended_) return;
  ended_ = true;
  Finish(status);
}

bool parse_message(const grpc::ByteBuffer& bytes, google::protobuf::MessageLite* message) {
  std::vector<grpc::Slice> slices;
  if (!bytes.Dump(&slices).ok()) return false;
  std::string data;
  for (const grpc::Slice& slice : slices) data.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return message->ParseFromString(data);
}

SubmitCall::SubmitCall(Coordinator& coordinator, int64_t cap, grpc::ByteBuffer* response)
    : coordinator_(coordinator), assembler_(cap, "a result") {
  grpc::Slice empty("");  // the Ack: no fields
  *response = grpc::ByteBuffer(&empty, 1);
  StartRead(&buffer_);
}

void SubmitCall::OnDone() {
  if (registered_) coordinator_.upload_ended(id_);  // a call gRPC ended itself
  delete this;
}

// The upload is over before the client hears so: its next upload (the next
// phase's) must not find this one still in progress.
void SubmitCall::end(const grpc::Status& status) {
  if (registered_) coordinator_.upload_ended(id_);
  registered_ = false;
  Finish(status);
}

void SubmitCall::refuse(const grpc::Status& status) {
  std::fprintf(stderr, "fl server: refused a result from '%s': %s\n", id_.c_str(), status.error_message().c_str());
  end(status);
}

void SubmitCall::OnReadDone(bool ok) {
  const bool first = id_.empty() && session_.empty();
  wire::Chunk chunk;
  if (!ok || !parse_message(buffer_, &chunk)) {
    if (ok || first) {
      return end(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "SubmitChunks: no chunk, or bytes that are no "
                                 "meshtrain.fl.wire.Chunk message (federation.proto)"));
    }
    return refuse(assembler_.ended_early());
  }
  if (first) {
    id_ = chunk.client_id();
    session_ = chunk.session();
  }
  // Every chunk: an upload the round no longer awaits (closed, its target in) stops here; the first, one
  // that answers another round or phase than the server awaits of it.
  if (std::string why = coordinator_.may_submit(id_, session_, first, chunk.round(), chunk.kind()); !why.empty())
    return end(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why));
  registered_ = true;
  if (grpc::Status added = assembler_.add(std::move(chunk)); !added.ok()) return refuse(added);
  if (!assembler_.complete()) return StartRead(&buffer_);
  wire::Result result;
  if (grpc::Status parsed = assembler_.parse(&result); !parsed.ok()) return refuse(parsed);
  if (result.client_id() != id_ || result.session() != session_) {
    return end(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                               "the result names client '" + result.client_id() + "', its first chunk '" + id_ + "'"));
  }
  const std::string why = coordinator_.submit(std::move(result));
  end(why.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why));
}

}  // namespace meshtrain::fl
