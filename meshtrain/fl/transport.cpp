#include "meshtrain/fl/transport.h"

#include "meshtrain/util/files.h"

#include <grpcpp/security/server_credentials.h>

#include <stdexcept>

namespace meshtrain::fl {
namespace {

std::string read_pem(const std::string& path, const std::string& what) {
  if (path.empty()) return {};
  if (!util::is_regular_file(path)) throw std::runtime_error(what + " '" + path + "' does not exist");
  return util::read_text_file(path);
}

}  // namespace

std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsConfig& tls, const std::string& listen) {
  if (tls.insecure) {
    if (!is_loopback_address(listen))
      throw std::runtime_error("plaintext is only allowed on a loopback address, not " + listen);
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions options(tls.mutual ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                       : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = read_pem(tls.ca, "client CA");
  options.pem_key_cert_pairs.push_back({read_pem(tls.key, "server key"), read_pem(tls.cert, "server certificate")});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsConfig& tls, const std::string& server) {
  if (tls.insecure) {
    if (!is_loopback_address(server))
      throw std::runtime_error("--insecure: plaintext is only allowed to a loopback address, not " + server);
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = read_pem(tls.ca, "server CA");
  options.pem_private_key = read_pem(tls.key, "client key");
  options.pem_cert_chain = read_pem(tls.cert, "client certificate");
  return grpc::SslCredentials(options);
}

std::string peer_common_name(const grpc::ServerContextBase& context) {
  const auto auth = context.auth_context();
  if (!auth) return {};
  const auto names = auth->FindPropertyValues("x509_common_name");
  return names.empty() ? std::string() : std::string(names.front().data(), names.front().size());
}

}  // namespace meshtrain::fl
