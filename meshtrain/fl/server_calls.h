// The federation server's calls that last, Presence, PollChunks and
// SubmitChunks, as gRPC callback reactors: an open call is a few bytes, not a
// thread (Note [Calls without threads]).
#pragma once

#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace meshtrain::fl {

// Note [Calls without threads]
// A client holds a Presence call open for as long as it runs and a long poll
// (PollChunks) while it waits for a task. Held by the synchronous API, each
// took a server thread: two per client. As callback reactors they take none.
// A Sweep is the one thread for each kind: it looks at its waiting calls
// every period, or at once when the coordinator opens a phase or stops, and
// acts on those that are due outside its lock (gRPC 1.51 runs reactions on
// its own threads, but nothing here relies on that). A call is counted (hold/release): gRPC holds it until
// OnDone, the sweep while it is in its set, so OnDone takes no lock.
class SweptCall {
 public:
  virtual ~SweptCall() = default;
  void hold() { ++refs_; }
  void release() {
    if (--refs_ == 0) delete this;
  }
  void done() {  // gRPC's OnDone: it will not call again
    done_ = true;
    release();
  }
  bool is_done() const { return done_; }

 private:
  std::atomic<int> refs_{1};
  std::atomic<bool> done_{false};
};

class Sweep {
 public:
  // `due`, under the lock: whether a call is to be taken out and acted on;
  // `act`, outside it.
  Sweep(std::chrono::milliseconds period, std::function<bool(SweptCall*)> due, std::function<void(SweptCall*)> act);
  ~Sweep();
  void add(SweptCall* call);
  void wake();  // from any thread, taking no lock (a wake lost to a race costs one period)

 private:
  void run();

  std::chrono::milliseconds period_;
  std::function<bool(SweptCall*)> due_;
  std::function<void(SweptCall*)> act_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> woken_{false};
  std::set<SweptCall*> calls_;
  bool stopping_ = false;
  std::thread thread_;
};

// Note [Client sessions]: ends when its session ends (the sweep) or its
// connection breaks (OnCancel: the client is gone).
class PresenceCall final : public grpc::ServerWriteReactor<wire::Ack>, public SweptCall {
 public:
  PresenceCall(Coordinator& coordinator, wire::PollRequest request);
  bool ended_session() { return coordinator_.ended(request_.client_id(), request_.session()); }
  void end(const grpc::Status& status);
  void OnCancel() override;
  void OnDone() override;

 private:
  Coordinator& coordinator_;
  const wire::PollRequest request_;
  std::atomic<bool> ended_{false};
};

// A long poll: answered with the client's task as it is opened, STOP, the
// refusal of its session, or WAIT after the long-poll time; the task's
// serialized bytes are written as chunks, one at a time.
class PollCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public SweptCall {
 public:
  PollCall(Coordinator& coordinator, wire::PollRequest request);
  // Whether the call has its answer now (the coordinator's task taken); then answer() sends it.
  bool ready();
  void answer();
  void refuse(const grpc::Status& status);  // a request that is no PollRequest
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  void write_next();  // with mutex_ held
  void finish(const grpc::Status& status);  // with mutex_ held

  Coordinator& coordinator_;
  const wire::PollRequest request_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::recursive_mutex mutex_;  // recursive in case a reaction ever runs on the thread that starts it
  std::string refusal_;
  std::shared_ptr<const std::string> task_;
  std::shared_ptr<const std::vector<std::string>> chunks_;  // the task's, serialized (shared by every poll of a FIT task)
  size_t next_ = 0;                                         // the next chunk to write
  grpc::ByteBuffer buffer_;
  bool started_writing_ = false, ended_ = false, cancelled_ = false;  // once writing, completions drive the end
};

// An upload (SubmitChunks): each chunk read as it comes and refused where it
// shows the result cannot be taken (Note [Messages in chunks]); the result,
// once whole, handed to the coordinator.
class SubmitCall final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  SubmitCall(Coordinator& coordinator, int64_t cap, grpc::ByteBuffer* response);
  void OnReadDone(bool ok) override;
  void OnDone() override;

 private:
  void end(const grpc::Status& status);
  void refuse(const grpc::Status& status);  // end, said in the server's log

  Coordinator& coordinator_;
  ChunkAssembler assembler_;
  grpc::ByteBuffer buffer_;
  std::string id_, session_;
  bool registered_ = false;  // the coordinator counts this upload as in progress
};

// `bytes` as `message`; false if they are not one.
bool parse_message(const grpc::ByteBuffer& bytes, google::protobuf::MessageLite* message);

}  // namespace meshtrain::fl
