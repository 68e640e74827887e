#include "meshtrain/fl/chunks.h"

#include "meshtrain/util/memory.h"

#include <google/protobuf/io/zero_copy_stream.h>

#include <algorithm>
#include <deque>
#include <cstdio>

namespace meshtrain::fl {
namespace {

// The received chunks as one input to the parser; each is freed once the
// parser has moved past it (Note [Messages in chunks]).
class ChunkInput final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit ChunkInput(std::deque<std::string> chunks) : chunks_(std::move(chunks)) {}

  bool Next(const void** data, int* size) override {
    while (!chunks_.empty() && offset_ == chunks_.front().size()) {  // the parser is past it
      chunks_.pop_front();
      offset_ = 0;
    }
    if (chunks_.empty()) return false;
    *data = chunks_.front().data() + offset_;
    *size = static_cast<int>(chunks_.front().size() - offset_);
    offset_ = chunks_.front().size();
    read_ += *size;
    return true;
  }
  void BackUp(int count) override {
    offset_ -= count;
    read_ -= count;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0 && Next(&data, &size)) {
      const int used = std::min(count, size);
      BackUp(size - used);
      count -= used;
    }
    return count == 0;
  }
  int64_t ByteCount() const override { return read_; }

 private:
  std::deque<std::string> chunks_;
  size_t offset_ = 0;  // in the front chunk: what the parser has been given
  int64_t read_ = 0;
};

}  // namespace

std::string protocol_error(uint32_t client_protocol) {
  return "this server speaks federation protocol " + std::to_string(kProtocol) +
         " (tasks and results in chunks of 1 MiB); the client speaks protocol " +
         std::to_string(client_protocol == 0 ? 1 : client_protocol) +
         ": run the same meshtrain version on the server and its clients";
}

bool write_chunks(const google::protobuf::MessageLite& message, const std::string& id, const std::string& session,
                  const std::function<bool(const wire::Chunk&)>& write) {
  return write_chunks(message.SerializeAsString(), id, session, write);
}

wire::Chunk chunk_at(const std::string& bytes, size_t* at, const std::string& id, const std::string& session) {
  wire::Chunk chunk;
  if (*at == 0) {
    chunk.set_total(bytes.size());
    chunk.set_client_id(id);
    chunk.set_session(session);
  }
  const size_t n = std::min<size_t>(kChunkBytes, bytes.size() - *at);
  chunk.set_data(bytes.data() + *at, n);
  *at += n;
  return chunk;
}

bool write_chunks(const std::string& bytes, const std::string& id, const std::string& session,
                  const std::function<bool(const wire::Chunk&)>& write) {
  size_t at = 0;
  do {  // an empty message is one empty chunk
    if (!write(chunk_at(bytes, &at, id, session))) return false;
  } while (at < bytes.size());
  return true;
}

bool write_result_chunks(const wire::Result& result, const std::function<bool(const wire::Chunk&)>& write) {
  const std::string bytes = result.SerializeAsString();
  size_t at = 0;
  do {
    const bool first = at == 0;
    wire::Chunk chunk = chunk_at(bytes, &at, result.client_id(), result.session());
    if (first) {
      chunk.set_round(result.round());
      chunk.set_kind(result.kind());
    }
    if (!write(chunk)) return false;
  } while (at < bytes.size());
  return true;
}

ChunkAssembler::ChunkAssembler(int64_t cap, std::string what) : cap_(cap), what_(std::move(what)) {}

grpc::Status ChunkAssembler::add(wire::Chunk&& chunk) {
  if (!started_) {
    started_ = true;
    total_ = chunk.total();
    if (total_ > static_cast<uint64_t>(cap_)) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, what_ + " of " + memory::format_mib(static_cast<int64_t>(total_)) +
                                                                    " is over the limit of " + memory::format_mib(cap_) +
                                                                    " (fl.max_message_mb): refused unread");
    }
  }
  received_ += chunk.data().size();
  if (received_ > total_) {  // total <= cap: an upload past the cap ends here too
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        what_ + ": more bytes came than the " + std::to_string(total_) + " its first chunk declared");
  }
  chunks_.push_back(std::move(*chunk.mutable_data()));
  return grpc::Status::OK;
}

grpc::Status ChunkAssembler::ended_early() const {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what_ + ": the stream ended after " + std::to_string(received_) +
                                                              " of its " + std::to_string(total_) + " bytes");
}

grpc::Status ChunkAssembler::parse(google::protobuf::MessageLite* message) {
  ChunkInput input(std::move(chunks_));
  chunks_.clear();
  if (!message->ParseFromZeroCopyStream(&input)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what_ + ": the bytes are not a valid " +
                                                                message->GetTypeName() + " message (federation.proto)");
  }
  return grpc::Status::OK;
}

grpc::Status read_chunks(wire::Chunk chunk, const std::function<bool(wire::Chunk*)>& read, int64_t cap,
                         const char* what, google::protobuf::MessageLite* message) {
  ChunkAssembler assembler(cap, what);
  while (true) {
    if (grpc::Status added = assembler.add(std::move(chunk)); !added.ok()) return added;
    if (assembler.complete()) return assembler.parse(message);
    if (!read(&chunk)) return assembler.ended_early();
  }
}

}  // namespace meshtrain::fl
