#include "meshtrain/fl/server.h"

#include "meshtrain/fl/coordinator.h"
#include "meshtrain/fl/server_rounds.h"
#include "meshtrain/fl/transport.h"

#include <cstdio>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

grpc::Status refused(const std::string& why) {
  return why.empty() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why);
}

// The RPCs: each checks its request and hands it to the coordinator.
class FederationService final : public wire::Federation::Service {
 public:
  explicit FederationService(Coordinator& coordinator) : coordinator_(coordinator) {}

  grpc::Status Join(grpc::ServerContext* context, const wire::JoinRequest* request, wire::JoinReply* reply) override {
    std::string session;
    const std::string why = coordinator_.join(*request, peer_common_name(*context), &session);
    if (!why.empty()) {
      std::fprintf(stderr, "fl server: refused client '%s': %s\n", request->client_id().c_str(), why.c_str());
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, why);
    }
    std::fprintf(stderr, "fl server: client '%s' joined (%llu examples)\n", request->client_id().c_str(),
                 static_cast<unsigned long long>(request->examples()));
    reply->set_session(session);
    return grpc::Status::OK;
  }
  grpc::Status Poll(grpc::ServerContext*, const wire::PollRequest* request, wire::Task* task) override {
    return refused(coordinator_.poll(*request, task));
  }
  grpc::Status Submit(grpc::ServerContext*, const wire::Result* result, wire::Ack*) override {
    return refused(coordinator_.submit(*result));
  }
  grpc::Status Leave(grpc::ServerContext*, const wire::LeaveRequest* request, wire::Ack*) override {
    std::fprintf(stderr, "fl server: client '%s' left\n", request->client_id().c_str());
    return refused(coordinator_.leave(*request));
  }

 private:
  Coordinator& coordinator_;
};

}  // namespace

Server::Server(FlConfig config)
    : config_(std::move(config)),
      coordinator_(std::make_unique<Coordinator>(config_.tls.mutual,
                                                 config_.tls.mutual ? config_.tls.allow : std::vector<std::string>{})),
      service_(std::make_unique<FederationService>(*coordinator_)),
      rounds_(std::make_unique<Rounds>(config_, *coordinator_)) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config_.listen, server_credentials(config_.tls, config_.listen), &port_);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
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
