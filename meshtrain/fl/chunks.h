// A Task or a Result as a stream of Chunk messages (federation.proto), and
// back, with a cap on what is taken.
#pragma once

#include "meshtrain/fl/federation.pb.h"

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

namespace meshtrain::fl {

// Note [Messages in chunks]
// gRPC (1.51) checks a message's size against its limit only once it has
// received the whole message: a 900 MiB Result sent to a server whose limit
// was the cap grew the server's memory by 900 MiB before it was refused. So a Task
// and a Result are sent as chunks of at most kChunkBytes of their serialized
// bytes, gRPC's own limit on one message is a chunk (kWireMessageBytes), and
// the server counts an upload as it comes: it refuses one whose declared
// total, or whose running count, passes fl.max_message_mb at that chunk, and
// one from a client that has no result to give, or whose first chunk says it
// answers another round or phase (a client that does not say is checked once
// the result is whole). An upload it takes costs the
// chunks held until the last arrives, then the parsed Result, which is built
// while the chunks it has read are freed: at most the cap plus a chunk.
// Version 1's whole-message Poll and Submit are refused without being read,
// and a client that does not say protocol 2 at Join is refused there, with
// the reason, before it sends anything large. A message sent whole past the
// protocol, one 900 MiB chunk, would still be buffered by gRPC before its
// limit is checked: gRPC's memory quota (fl.server.grpc_memory_mb) bounds
// that, and gRPC resets the stream when the message would pass it.
constexpr uint32_t kProtocol = 2;
constexpr int64_t kChunkBytes = int64_t{1} << 20;
constexpr int kWireMessageBytes = static_cast<int>(kChunkBytes + (64 << 10));  // a chunk and its fields
// The error a version 1 client gets (at Join, or from its Poll and Submit).
std::string protocol_error(uint32_t client_protocol);

// Serializes `message` and hands its chunks to `write` in order (the first
// carries the total, `id` and `session`); false as soon as `write` is.
bool write_chunks(const google::protobuf::MessageLite& message, const std::string& id, const std::string& session,
                  const std::function<bool(const wire::Chunk&)>& write);
// The chunk of `bytes` that starts at `*at` (the first carries the total, `id`
// and `session`); moves `*at` past it. An empty message is one empty chunk.
wire::Chunk chunk_at(const std::string& bytes, size_t* at, const std::string& id, const std::string& session);

// A Result's chunks: the first also names the round and phase it answers.
bool write_result_chunks(const wire::Result& result, const std::function<bool(const wire::Chunk&)>& write);

// The same as write_chunks for a message serialized already.
bool write_chunks(const std::string& bytes, const std::string& id, const std::string& session,
                  const std::function<bool(const wire::Chunk&)>& write);

// One message's chunks as they come: each refused where it shows the message
// cannot be taken (Note [Messages in chunks]).
class ChunkAssembler {
 public:
  ChunkAssembler(int64_t cap, std::string what);  // `what` names the message in errors
  grpc::Status add(wire::Chunk&& chunk);
  bool complete() const { return started_ && received_ == total_; }
  grpc::Status ended_early() const;  // the error for a stream that ended before complete()
  // Once complete: the message, built while the chunks it has read are freed.
  grpc::Status parse(google::protobuf::MessageLite* message);

 private:
  int64_t cap_;
  std::string what_;
  bool started_ = false;
  uint64_t total_ = 0, received_ = 0;
  std::deque<std::string> chunks_;
};

// Reads one message's chunks: `first` has been read already, `read` gives the
// next (false: the stream ended); a chunk past the declared total is refused. More than `cap` bytes, declared or sent, is
// refused (RESOURCE_EXHAUSTED) at the chunk that passes it; `what` names the
// message in errors. On success `*message` holds it.
grpc::Status read_chunks(wire::Chunk first, const std::function<bool(wire::Chunk*)>& read, int64_t cap,
                         const char* what, google::protobuf::MessageLite* message);

}  // namespace meshtrain::fl
