// gRPC credentials for the federation: TLS with a server certificate, mutual
// TLS (client certificates from a CA, optionally an allowlist of common
// names), or plaintext when explicitly configured on a loopback address.
#pragma once

#include "meshtrain/fl/config.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace meshtrain::fl {

std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsConfig& tls, const std::string& listen);
std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsConfig& tls, const std::string& server);
// The verified client certificate's common name ("" without mutual TLS).
std::string peer_common_name(const grpc::ServerContextBase& context);

}  // namespace meshtrain::fl
