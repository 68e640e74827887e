#include "meshtrain/fl/server.h"

#include "meshtrain/fl/admission.h"
#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/coordinator.h"
#include "meshtrain/fl/server_calls.h"
#include "meshtrain/fl/server_rounds.h"
#include "meshtrain/fl/transport.h"

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

grpc::Status refused(const std::string& why) {
  return why.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why);
}

// Reads a unary call's request itself, so that bytes that are no message of
// the method's type get a status that says so (gRPC's own parse answers
// INTERNAL with an empty message). A callback method (Note [Calls without
// threads]): no thread waits on it.
template <typename Request, typename Reply, typename Handle>
grpc::ServerUnaryReactor* serve_unary(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                                      grpc::ByteBuffer* response, const char* method, Handle handle) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Request request;
  if (!parse_message(*bytes, &request)) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(method) + ": the request is not a valid " +
                                                                         Request::descriptor()->full_name() +
                                                                         " message (federation.proto)"));
    return reactor;
  }
  Reply reply;
  const grpc::Status status = handle(request, reply);
  grpc::Slice serialized(reply.SerializeAsString());
  *response = grpc::ByteBuffer(&serialized, 1);
  reactor->Finish(status);
  return reactor;
}

// Every call a callback but version 1's Poll and Submit, which are refused
// unread (a callback method reads the request first).
using Methods = wire::Federation::WithCallbackMethod_Presence<wire::Federation::WithRawCallbackMethod_Join<
    wire::Federation::WithStreamedUnaryMethod_Poll<wire::Federation::WithStreamedUnaryMethod_Submit<
        wire::Federation::WithRawCallbackMethod_Leave<wire::Federation::WithRawCallbackMethod_PollChunks<
            wire::Federation::WithRawCallbackMethod_SubmitChunks<wire::Federation::Service>>>>>>>;


class FederationService final : public Methods {
 public:
  // `cap`: the most bytes of one result (Note [Messages in chunks]).
  // `admission`: the bounds on who joins without mutual TLS (Note [Admission without mutual TLS]).
  FederationService(Coordinator& coordinator, int64_t cap, std::unique_ptr<Admission> admission)
      : coordinator_(coordinator), cap_(cap), admission_(std::move(admission)) {
    coordinator_.on_change([this] {  // a phase opened or the federation stops: answer at once
      polls_.wake();
      presences_.wake();
    });
  }

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override {
    return serve_unary<wire::JoinRequest, wire::JoinReply>(context, request, response, "Join",
                                                           [&](const wire::JoinRequest& request, wire::JoinReply& reply) {
      if (request.protocol() != kProtocol) {
        std::fprintf(stderr, "fl server: refused client '%s': it speaks federation protocol %u\n",
                     request.client_id().c_str(), request.protocol() == 0 ? 1u : request.protocol());
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, protocol_error(request.protocol()));
      }
      const std::string address = peer_ip(context->peer());
      bool busy = false;
      if (std::string why = admission_->admit(address, request.join_token(), &busy); !why.empty()) {
        std::fprintf(stderr, "fl server: refused client '%s' from %s: %s\n", request.client_id().c_str(),
                     address.c_str(), why.c_str());
        return grpc::Status(busy ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::PERMISSION_DENIED, why);
      }
      std::string session;
      Coordinator::Refusal refusal;
      const std::string why = coordinator_.join(request, peer_common_name(*context), address, &session, &refusal);
      if (!why.empty()) {
        std::fprintf(stderr, "fl server: refused client '%s' from %s: %s\n", request.client_id().c_str(),
                     address.c_str(), why.c_str());
        return grpc::Status(refusal == Coordinator::Refusal::kInUse  ? grpc::StatusCode::ALREADY_EXISTS
                            : refusal == Coordinator::Refusal::kBusy ? grpc::StatusCode::RESOURCE_EXHAUSTED
                                                                     : grpc::StatusCode::PERMISSION_DENIED,
                            why);
      }
      std::fprintf(stderr, "fl server: client '%s' joined (%llu examples)\n", request.client_id().c_str(),
                   static_cast<unsigned long long>(coordinator_.declared_examples(request.client_id())));
      reply.set_session(session);
      return grpc::Status::OK;
    });
  }
  // Version 1's calls: refused before a byte of the message is read.
  grpc::Status StreamedPoll(grpc::ServerContext*, grpc::ServerUnaryStreamer<wire::PollRequest, wire::Task>*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "Poll: " + protocol_error(1));
  }
  grpc::Status StreamedSubmit(grpc::ServerContext*, grpc::ServerUnaryStreamer<wire::Result, wire::Ack>*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "Submit: " + protocol_error(1));
  }
  // Note [Calls without threads]: a long poll waits in polls_, not on a thread.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PollChunks(grpc::CallbackServerContext*, const grpc::ByteBuffer* bytes) override {
    wire::PollRequest request;
    const bool parsed = parse_message(*bytes, &request);
    auto* call = new PollCall(coordinator_, std::move(request));
    if (!parsed) {
      call->refuse(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "PollChunks: the request is not a valid "
                                "meshtrain.fl.wire.PollRequest message (federation.proto)"));
    } else if (call->ready()) {
      call->answer();
    } else {
      polls_.add(call);
    }
    return call;
  }
  // Note [Messages in chunks]: refused at the first chunk that shows it cannot be taken.
  grpc::ServerReadReactor<grpc::ByteBuffer>* SubmitChunks(grpc::CallbackServerContext*, grpc::ByteBuffer* ack) override {
    return new SubmitCall(coordinator_, cap_, ack);
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override {
    return serve_unary<wire::LeaveRequest, wire::Ack>(context, request, response, "Leave",
                                                      [&](const wire::LeaveRequest& request, wire::Ack&) {
      std::fprintf(stderr, "fl server: client '%s' left\n", request.client_id().c_str());
      return refused(coordinator_.leave(request));
    });
  }
  // Note [Client sessions]: held until the session ends; a broken call means the client is gone.
  grpc::ServerWriteReactor<wire::Ack>* Presence(grpc::CallbackServerContext*, const wire::PollRequest* request) override {
    auto* call = new PresenceCall(coordinator_, *request);
    if (std::string why = coordinator_.presence(*request); !why.empty()) {
      call->end(refused(why));
    } else {
      presences_.add(call);
    }
    return call;
  }

 private:
  Coordinator& coordinator_;
  int64_t cap_;
  std::unique_ptr<Admission> admission_;
  // Note [Calls without threads]: the open Presence calls, ended with their session; the waiting polls.
  Sweep presences_{std::chrono::milliseconds(200),
                   [](SweptCall* call) { return static_cast<PresenceCall*>(call)->ended_session(); },
                   [](SweptCall* call) { static_cast<PresenceCall*>(call)->end(grpc::Status::OK); }};
  Sweep polls_{std::chrono::milliseconds(100), [](SweptCall* call) { return static_cast<PollCall*>(call)->ready(); },
               [](SweptCall* call) { static_cast<PollCall*>(call)->answer(); }};
};

}  // namespace

Server::Server(FlConfig config)
    : config_(std::move(config)),
      coordinator_(std::make_unique<Coordinator>(config_.tls.mutual,
                                                 config_.tls.mutual ? config_.tls.allow : std::vector<std::string>{},
                                                 config_.model.context)),
      service_(std::make_unique<FederationService>(
          *coordinator_, config_.max_message_bytes(),
          std::make_unique<Admission>(config_.join_token_file.empty() ? "" : read_join_token(config_.join_token_file),
                                      config_.joins_per_minute))),
      rounds_(std::make_unique<Rounds>(config_, *coordinator_)) {
  coordinator_->limit_ids_per_address(config_.ids_per_address);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config_.listen, server_credentials(config_.tls, config_.listen), &port_);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(kWireMessageBytes);  // a chunk (Note [Messages in chunks])
  // Pings on every connection: a client cut off by a partition has its Presence call
  // broken within ~15 s rather than at the 30 s liveness limit (Note [Client sessions]).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.SetMaxSendMessageSize(kWireMessageBytes);
  // Note [Messages in chunks]: what bounds a message sent whole, past the per-message limit.
  grpc::ResourceQuota quota("meshtrain-fl");
  quota.Resize(static_cast<size_t>(config_.grpc_memory_mb * (1 << 20)));
  builder.SetResourceQuota(quota);
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0)
    throw std::runtime_error("fl server: cannot listen on " + config_.listen + " (address in use or invalid)");
}

Server::~Server() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

int Server::run() { return rounds_->run(); }

std::vector<at::Tensor> Server::weights() const { return rounds_->weights(); }

}  // namespace meshtrain::fl
