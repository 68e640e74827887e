// Who may join a federation without mutual TLS (Note [Admission without mutual TLS]).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace meshtrain::fl {

// Note [Admission without mutual TLS]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under mutual TLS a client's id is its certificate's name, signed by the
// federation's CA. Without it an id proves nothing, and one process could
// join under as many ids as it likes (a Sybil attack) and outweigh the
// honest clients. Three bounds, each off by default:
// - fl.server.join_token_file: a Join must quote the secret this file holds
//   (compared in constant time); a client passes it with --join-token-file.
//   The operator hands the token to the clients it admits, as it would sign
//   their certificates, and replaces the file to revoke it (at a restart).
// - fl.server.joins_per_minute: Joins from one source address, as a bucket
//   of that many refilled over a minute; one past it is refused with
//   RESOURCE_EXHAUSTED, which a client retries until its connect timeout.
// - fl.server.ids_per_address: live ids (Note [Client sessions]) from one
//   source address; a Join of one more is refused (RESOURCE_EXHAUSTED) until
//   one of them leaves or falls silent.
// The source address is the connection's IP as gRPC reports it: behind a
// proxy or NAT, clients share one, and the limits must allow for that. The
// server forgets ids that are neither live nor awaited once it holds 4,096
// more than are live (Coordinator::forget_idle), so that a churn of new ids
// does not grow its memory.
class Admission {
 public:
  using Clock = std::chrono::steady_clock;
  // `token`: "" for none; `joins_per_minute`: 0 for no limit.
  Admission(std::string token, double joins_per_minute) : token_(std::move(token)), rate_(joins_per_minute) {}
  // "" or why a Join from `address` quoting `token` is refused; `*busy`: the
  // refusal is temporary (the rate), a retry later may pass.
  std::string admit(const std::string& address, const std::string& token, bool* busy);

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point at;
  };
  std::string token_;
  double rate_;
  std::mutex mutex_;
  std::map<std::string, Bucket> buckets_;  // per source address
};

// The IP of a gRPC peer string ("ipv4:10.0.0.5:41234" -> "10.0.0.5",
// "ipv6:[::1]:5000" -> "::1"); the string itself when it has another form.
std::string peer_ip(const std::string& peer);
// The token a file holds, surrounding whitespace dropped; throws std::runtime_error naming the file when it
// cannot be read or holds nothing.
std::string read_join_token(const std::string& path);

}  // namespace meshtrain::fl
