// A federation client speaking the protocol by hand, for tests that need
// results the built-in client would never send.
#pragma once

#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/federation.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace meshtrain::fl {

// Uploads `result` in chunks (Note [Messages in chunks]).
inline grpc::Status submit(wire::Federation::Stub& stub, const wire::Result& result) {
  grpc::ClientContext context;
  wire::Ack ack;
  auto writer = stub.SubmitChunks(&context, &ack);
  write_result_chunks(result, [&](const wire::Chunk& chunk) { return writer->Write(chunk); });
  writer->WritesDone();
  return writer->Finish();
}

struct RawClient {
  explicit RawClient(int port)
      : stub(wire::Federation::NewStub(
            grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()))) {}
  grpc::Status join(const std::string& id, uint64_t examples, const std::string& resume = "",
                    const std::string& token = "") {
    grpc::ClientContext context;
    wire::JoinRequest j;
    j.set_client_id(id);
    j.set_examples(examples);
    j.set_resume_session(resume);
    j.set_protocol(kProtocol);
    j.set_join_token(token);
    wire::JoinReply reply;
    const grpc::Status s = stub->Join(&context, j, &reply);
    if (s.ok()) session = reply.session();
    return s;
  }
  grpc::Status poll(const std::string& id, wire::Task* task) {
    grpc::ClientContext context;
    wire::PollRequest p;
    p.set_client_id(id);
    p.set_session(session);
    auto reader = stub->PollChunks(&context, p);
    std::string bytes;
    for (wire::Chunk chunk; reader->Read(&chunk);) bytes += chunk.data();
    const grpc::Status status = reader->Finish();
    if (status.ok() && !task->ParseFromString(bytes)) return grpc::Status(grpc::StatusCode::INTERNAL, "not a Task");
    return status;
  }
  grpc::Status leave(const std::string& id) {
    grpc::ClientContext context;
    wire::LeaveRequest l;
    l.set_client_id(id);
    l.set_session(session);
    wire::Ack ack;
    return stub->Leave(&context, l, &ack);
  }
  std::unique_ptr<wire::Federation::Stub> stub;
  std::string session;
};

}  // namespace meshtrain::fl
