#include "meshtrain/fl/admission.h"

#include "meshtrain/util/files.h"

#include <algorithm>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

constexpr size_t kForgetAbove = 4096;  // buckets kept before full (idle) ones are dropped

// Equal without an early exit: the time taken does not tell how much of a guess was right.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

}  // namespace

std::string Admission::admit(const std::string& address, const std::string& token, bool* busy) {
  *busy = false;
  if (!token_.empty() && !same_secret(token, token_))
    return token.empty() ? "this federation needs a join token: pass the one its operator gave you with "
                           "--join-token-file FILE"
                         : "the join token is wrong: check --join-token-file against the one the federation's "
                           "operator gave you";
  if (rate_ <= 0) return {};
  std::lock_guard<std::mutex> lock(mutex_);
  const Clock::time_point now = Clock::now();
  auto refill = [&](Bucket& b) {
    b.tokens = std::min(rate_, b.tokens + rate_ * std::chrono::duration<double>(now - b.at).count() / 60.0);
    b.at = now;
  };
  if (buckets_.size() > kForgetAbove) {
    for (auto it = buckets_.begin(); it != buckets_.end();) {
      refill(it->second);
      it = it->second.tokens >= rate_ ? buckets_.erase(it) : std::next(it);
    }
  }
  auto [it, fresh] = buckets_.try_emplace(address, Bucket{rate_, now});
  refill(it->second);
  if (it->second.tokens < 1) {
    *busy = true;
    return "too many joins from " + address + ": at most fl.server.joins_per_minute = " +
           std::to_string(static_cast<long long>(rate_)) + " a minute from one address";
  }
  it->second.tokens -= 1;
  return {};
}

std::string peer_ip(const std::string& peer) {
  std::string rest;
  if (peer.rfind("ipv4:", 0) == 0) rest = peer.substr(5);
  else if (peer.rfind("ipv6:", 0) == 0) rest = peer.substr(5);
  else return peer;
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    return close == std::string::npos ? rest : rest.substr(1, close - 1);
  }
  const size_t colon = rest.rfind(':');
  return colon == std::string::npos ? rest : rest.substr(0, colon);
}

std::string read_join_token(const std::string& path) {
  if (!util::is_regular_file(path)) throw std::runtime_error("join token file " + path + ": does not exist");
  std::string token = util::read_text_file(path);
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  token.erase(token.begin(), std::find_if_not(token.begin(), token.end(), space));
  token.erase(std::find_if_not(token.rbegin(), token.rend(), space).base(), token.end());
  if (token.empty()) throw std::runtime_error("join token file " + path + ": holds no token");
  return token;
}

}  // namespace meshtrain::fl
