#include "meshtrain/fl/secagg.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <random>

namespace meshtrain::fl::secagg {
namespace {

constexpr size_t kKey = 32, kNonce = 12, kTag = 16;

void check(int ok, const char* what) {
  if (ok != 1) throw SecAggError(std::string("OpenSSL: ") + what + " failed");
}

using PkeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using PkeyCtxPtr = std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)>;
using CipherCtxPtr = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

const unsigned char* bytes_of(const Bytes& b) { return reinterpret_cast<const unsigned char*>(b.data()); }

Bytes sha256(const Bytes& data) {
  Bytes out(kKey, '\0');
  unsigned int len = 0;
  check(EVP_Digest(data.data(), data.size(), reinterpret_cast<unsigned char*>(out.data()), &len, EVP_sha256(), nullptr),
        "SHA-256");
  return out;
}

// GF(2^8) with the AES polynomial x^8 + x^4 + x^3 + x + 1; 3 generates it.
struct Field {
  std::array<uint8_t, 512> exp{};
  std::array<uint8_t, 256> log{};
  Field() {
    unsigned x = 1;
    for (int i = 0; i < 255; ++i) {
      exp[i] = static_cast<uint8_t>(x);
      log[x] = static_cast<uint8_t>(i);
      x ^= (x << 1) ^ ((x & 0x80) ? 0x11b : 0);  // x·3
      x &= 0xff;
    }
    for (int i = 255; i < 512; ++i) exp[i] = exp[i - 255];
  }
  uint8_t mul(uint8_t a, uint8_t b) const { return (a == 0 || b == 0) ? 0 : exp[log[a] + log[b]]; }
  uint8_t div(uint8_t a, uint8_t b) const { return a == 0 ? 0 : exp[log[a] + 255 - log[b]]; }
};
const Field& field() {
  static const Field f;
  return f;
}

Bytes seal(const Bytes& key, const Bytes& aad, const Bytes& plain, Bytes* nonce) {
  *nonce = random_bytes(kNonce);
  CipherCtxPtr ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  check(EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, bytes_of(key), bytes_of(*nonce)), "AES-GCM init");
  int len = 0;
  check(EVP_EncryptUpdate(ctx.get(), nullptr, &len, bytes_of(aad), static_cast<int>(aad.size())), "AES-GCM aad");
  Bytes out(plain.size() + kTag, '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  check(EVP_EncryptUpdate(ctx.get(), o, &len, bytes_of(plain), static_cast<int>(plain.size())), "AES-GCM encrypt");
  check(EVP_EncryptFinal_ex(ctx.get(), o + len, &len), "AES-GCM final");
  check(EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTag, o + plain.size()), "AES-GCM tag");
  return out;
}

Bytes open(const Bytes& key, const Bytes& aad, const Bytes& nonce, const Bytes& sealed) {
  if (sealed.size() < kTag || nonce.size() != kNonce) throw SecAggError("sealed share: malformed");
  CipherCtxPtr ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  check(EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, bytes_of(key), bytes_of(nonce)), "AES-GCM init");
  int len = 0;
  check(EVP_DecryptUpdate(ctx.get(), nullptr, &len, bytes_of(aad), static_cast<int>(aad.size())), "AES-GCM aad");
  const size_t body = sealed.size() - kTag;
  Bytes out(body, '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  check(EVP_DecryptUpdate(ctx.get(), o, &len, bytes_of(sealed), static_cast<int>(body)), "AES-GCM decrypt");
  Bytes tag = sealed.substr(body);
  check(EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTag, tag.data()), "AES-GCM tag");
  if (EVP_DecryptFinal_ex(ctx.get(), o + len, &len) != 1)
    throw SecAggError("sealed share: authentication failed (tampered, or sealed for another client)");
  return out;
}

void add_prg(std::vector<uint32_t>& y, const Bytes& seed, bool subtract) {
  const std::vector<uint32_t> p = prg(seed, y.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = subtract ? y[i] - p[i] : y[i] + p[i];
}

Bytes aad_of(const std::string& from, const std::string& to) { return from + '\0' + to; }

}  // namespace

Bytes random_bytes(size_t n) {
  Bytes out(n, '\0');
  check(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)), "RAND_bytes");
  return out;
}

KeyPair generate_keypair() {
  PkeyCtxPtr ctx(EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, nullptr), EVP_PKEY_CTX_free);
  check(ctx ? 1 : 0, "X25519 context");
  check(EVP_PKEY_keygen_init(ctx.get()), "X25519 keygen init");
  EVP_PKEY* raw = nullptr;
  check(EVP_PKEY_keygen(ctx.get(), &raw), "X25519 keygen");
  PkeyPtr key(raw, EVP_PKEY_free);
  KeyPair pair;
  pair.secret.assign(kKey, '\0');
  pair.public_key.assign(kKey, '\0');
  size_t len = kKey;
  check(EVP_PKEY_get_raw_private_key(key.get(), reinterpret_cast<unsigned char*>(pair.secret.data()), &len),
        "X25519 private key");
  len = kKey;
  check(EVP_PKEY_get_raw_public_key(key.get(), reinterpret_cast<unsigned char*>(pair.public_key.data()), &len),
        "X25519 public key");
  return pair;
}

Bytes agree(const Bytes& secret, const Bytes& peer_public, const std::string& label) {
  if (secret.size() != kKey || peer_public.size() != kKey) throw SecAggError("X25519 key of the wrong size");
  PkeyPtr mine(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, bytes_of(secret), kKey), EVP_PKEY_free);
  PkeyPtr theirs(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, bytes_of(peer_public), kKey), EVP_PKEY_free);
  check(mine && theirs ? 1 : 0, "X25519 key import");
  PkeyCtxPtr ctx(EVP_PKEY_CTX_new(mine.get(), nullptr), EVP_PKEY_CTX_free);
  check(EVP_PKEY_derive_init(ctx.get()), "X25519 derive init");
  check(EVP_PKEY_derive_set_peer(ctx.get(), theirs.get()), "X25519 peer");
  Bytes shared(kKey, '\0');
  size_t len = kKey;
  check(EVP_PKEY_derive(ctx.get(), reinterpret_cast<unsigned char*>(shared.data()), &len), "X25519 derive");
  return sha256(label + '\0' + shared);
}

std::vector<Share> shamir_split(const Bytes& secret, int n, int t) {
  if (t < 1 || t > n || n > 255) throw SecAggError("Shamir: need 1 <= t <= n <= 255");
  std::vector<Share> shares(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    shares[i].x = static_cast<uint8_t>(i + 1);
    shares[i].y.assign(secret.size(), '\0');
  }
  const Field& f = field();
  for (size_t b = 0; b < secret.size(); ++b) {
    // p(x) = secret + c1·x + ... + c_{t-1}·x^{t-1}, evaluated by Horner.
    const Bytes coefficients = random_bytes(static_cast<size_t>(t - 1));
    for (auto& share : shares) {
      uint8_t y = 0;
      for (int k = t - 2; k >= 0; --k) y = f.mul(y, share.x) ^ static_cast<uint8_t>(coefficients[k]);
      y = f.mul(y, share.x) ^ static_cast<uint8_t>(secret[b]);
      share.y[b] = static_cast<char>(y);
    }
  }
  return shares;
}

Bytes shamir_combine(const std::vector<Share>& shares) {
  if (shares.empty()) throw SecAggError("Shamir: no shares");
  const Field& f = field();
  Bytes secret(shares[0].y.size(), '\0');
  for (size_t i = 0; i < shares.size(); ++i) {
    // Lagrange basis at 0: Π_{j≠i} x_j / (x_j - x_i); subtraction is XOR.
    uint8_t basis = 1;
    for (size_t j = 0; j < shares.size(); ++j) {
      if (j == i) continue;
      if (shares[j].x == shares[i].x || shares[j].x == 0) throw SecAggError("Shamir: repeated or zero share point");
      basis = f.mul(basis, f.div(shares[j].x, shares[j].x ^ shares[i].x));
    }
    if (shares[i].y.size() != secret.size()) throw SecAggError("Shamir: shares of different lengths");
    for (size_t b = 0; b < secret.size(); ++b)
      secret[b] = static_cast<char>(static_cast<uint8_t>(secret[b]) ^ f.mul(basis, static_cast<uint8_t>(shares[i].y[b])));
  }
  return secret;
}

std::vector<uint32_t> prg(const Bytes& seed, size_t n) {
  if (seed.size() != kKey) throw SecAggError("PRG seed must be 32 bytes");
  std::vector<uint32_t> out(n, 0);
  CipherCtxPtr ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  const unsigned char iv[16] = {};
  check(EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_ctr(), nullptr, bytes_of(seed), iv), "AES-CTR init");
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  int len = 0;
  // Encrypting zeros in place gives the key stream.
  check(EVP_EncryptUpdate(ctx.get(), o, &len, o, static_cast<int>(n * sizeof(uint32_t))), "AES-CTR");
  return out;
}

std::vector<uint32_t> quantise_ring(const std::vector<float>& x, float clip, int bits, uint64_t seed) {
  const double levels = static_cast<double>((uint64_t{1} << bits) - 1);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<uint32_t> q(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) throw SecAggError("the update holds a non-finite value; this client sits the round out");
    const double v = std::clamp(static_cast<double>(x[i]), -static_cast<double>(clip), static_cast<double>(clip));
    const double t = (v + clip) / (2.0 * clip) * levels;
    const double lo = std::floor(t);
    q[i] = static_cast<uint32_t>(std::min(levels, lo + (uniform(rng) < t - lo ? 1.0 : 0.0)));
  }
  return q;
}

std::vector<float> dequantise_ring_sum(const std::vector<uint32_t>& sum, int count, float clip, int bits) {
  const double levels = static_cast<double>((uint64_t{1} << bits) - 1);
  std::vector<float> out(sum.size());
  for (size_t i = 0; i < sum.size(); ++i)
    out[i] = static_cast<float>(static_cast<double>(sum[i]) * 2.0 * clip / levels - count * static_cast<double>(clip));
  return out;
}

std::vector<uint32_t> weight_by_examples(std::vector<uint32_t> x, uint32_t examples) {
  for (auto& v : x) v *= examples;  // in Z_2^32, as the masks
  x.push_back(examples);
  return x;
}

std::vector<float> weighted_mean_from_sum(const std::vector<uint32_t>& sum, float clip, int bits) {
  if (sum.empty() || sum.back() == 0) throw SecAggError("secure aggregation: the sum holds no examples");
  const uint64_t examples = sum.back();
  if (examples * ((uint64_t{1} << bits) - 1) >= (uint64_t{1} << 32))
    throw SecAggError("secure aggregation: " + std::to_string(examples) + " examples times 2^" + std::to_string(bits) +
                      " levels could wrap the ring Z_2^32; lower fl.secagg.bits");
  std::vector<float> mean = dequantise_ring_sum({sum.begin(), sum.end() - 1}, static_cast<int>(examples), clip, bits);
  for (float& v : mean) v /= static_cast<float>(examples);
  return mean;
}

// ---- client ----

ClientSession::ClientSession(std::string id, int threshold)
    : id_(std::move(id)), threshold_(threshold), cipher_(generate_keypair()), mask_(generate_keypair()),
      self_seed_(random_bytes(kKey)) {}

wire::PeerKeys ClientSession::keys() const {
  wire::PeerKeys k;
  k.set_client_id(id_);
  k.set_cipher_public(cipher_.public_key);
  k.set_mask_public(mask_.public_key);
  return k;
}

std::vector<wire::SealedShares> ClientSession::share(const std::vector<wire::PeerKeys>& peers) {
  if (static_cast<int>(peers.size()) < threshold_)
    throw SecAggError("secure aggregation: " + std::to_string(peers.size()) + " clients sent keys, fewer than the "
                      "threshold t = " + std::to_string(threshold_));
  peers_.clear();
  for (const auto& p : peers) peers_[p.client_id()] = p;
  if (!peers_.count(id_)) throw SecAggError("secure aggregation: this client is missing from the key list");
  const int n = static_cast<int>(peers_.size());
  const std::vector<Share> seed_shares = shamir_split(self_seed_, n, threshold_);
  const std::vector<Share> key_shares = shamir_split(mask_.secret, n, threshold_);
  std::vector<wire::SealedShares> out;
  int i = 0;
  for (const auto& [peer, keys] : peers_) {
    const Share& a = seed_shares[i];
    const Share& b = key_shares[i];
    ++i;
    if (peer == id_) {
      held_[id_] = Held{a.x, a.y, b.y};
      continue;
    }
    const Bytes plain = Bytes(1, static_cast<char>(a.x)) + a.y + b.y;
    wire::SealedShares s;
    s.set_from(id_);
    s.set_to(peer);
    Bytes nonce;
    s.set_ciphertext(seal(agree(cipher_.secret, keys.cipher_public(), "seal"), aad_of(id_, peer), plain, &nonce));
    s.set_nonce(nonce);
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<uint32_t> ClientSession::mask(const std::vector<uint32_t>& x,
                                          const std::vector<wire::SealedShares>& received) {
  std::vector<uint32_t> y = x;
  add_prg(y, self_seed_, false);
  for (const auto& s : received) {
    const std::string& v = s.from();
    auto peer = peers_.find(v);
    if (s.to() != id_ || peer == peers_.end() || v == id_)
      throw SecAggError("secure aggregation: a share from '" + v + "' that is not for this round's peers");
    const Bytes plain =
        open(agree(cipher_.secret, peer->second.cipher_public(), "seal"), aad_of(v, id_), s.nonce(), s.ciphertext());
    if (plain.size() != 1 + 2 * kKey) throw SecAggError("secure aggregation: a share of the wrong size from " + v);
    held_[v] = Held{static_cast<uint8_t>(plain[0]), plain.substr(1, kKey), plain.substr(1 + kKey)};
    add_prg(y, agree(mask_.secret, peer->second.mask_public(), "mask"), id_ > v);
  }
  return y;
}

std::vector<wire::Revealed> ClientSession::reveal(const std::vector<std::string>& survivors,
                                                  const std::vector<std::string>& dropped) const {
  for (const auto& d : dropped) {
    if (std::find(survivors.begin(), survivors.end(), d) != survivors.end())
      throw SecAggError("secure aggregation: the server asked for both secrets of '" + d + "'; refusing");
  }
  std::vector<wire::Revealed> out;
  auto emit = [&](const std::string& owner, bool mask_key) {
    auto held = held_.find(owner);
    if (held == held_.end()) throw SecAggError("secure aggregation: no share held of '" + owner + "'");
    wire::Revealed r;
    r.set_owner(owner);
    r.set_mask_key(mask_key);
    r.set_share(mask_key ? held->second.mask_key_share : held->second.self_seed_share);
    r.set_x(held->second.x);
    out.push_back(std::move(r));
  };
  for (const auto& s : survivors) emit(s, false);
  for (const auto& d : dropped) emit(d, true);
  return out;
}

// ---- server ----

ServerSession::ServerSession(int threshold) : threshold_(threshold) {}

void ServerSession::add_keys(const std::string& id, const wire::PeerKeys& keys) {
  if (keys.client_id() != id || keys.cipher_public().size() != kKey || keys.mask_public().size() != kKey)
    throw SecAggError("secure aggregation: malformed keys from '" + id + "'");
  keys_[id] = keys;
}

std::vector<wire::PeerKeys> ServerSession::peers() const {
  if (static_cast<int>(keys_.size()) < threshold_)
    throw SecAggError("secure aggregation failed: " + std::to_string(keys_.size()) +
                      " clients sent keys, fewer than the threshold t = " + std::to_string(threshold_));
  std::vector<wire::PeerKeys> out;
  for (const auto& [id, k] : keys_) out.push_back(k);
  return out;
}

void ServerSession::add_shares(const std::string& from, const std::vector<wire::SealedShares>& shares) {
  if (!keys_.count(from)) throw SecAggError("secure aggregation: shares from '" + from + "', who sent no keys");
  for (const auto& s : shares) {
    if (s.from() != from || !keys_.count(s.to()))
      throw SecAggError("secure aggregation: a share from '" + from + "' with a bad sender or receiver");
  }
  shares_from_[from] = shares;
}

std::vector<wire::SealedShares> ServerSession::shares_for(const std::string& to) const {
  if (static_cast<int>(shares_from_.size()) < threshold_)
    throw SecAggError("secure aggregation failed: " + std::to_string(shares_from_.size()) +
                      " clients sent shares, fewer than the threshold t = " + std::to_string(threshold_));
  std::vector<wire::SealedShares> out;
  for (const auto& [from, shares] : shares_from_) {
    if (from == to) continue;
    for (const auto& s : shares)
      if (s.to() == to) out.push_back(s);
  }
  return out;
}

void ServerSession::add_masked(const std::string& id, const std::vector<uint32_t>& y) {
  if (!shares_from_.count(id)) throw SecAggError("secure aggregation: a masked update from '" + id + "', who sent no shares");
  if (!masked_.empty() && masked_.begin()->second.size() != y.size())
    throw SecAggError("secure aggregation: masked update of '" + id + "' has the wrong length");
  masked_[id] = y;
}

std::vector<std::string> ServerSession::survivors() const {
  std::vector<std::string> out;
  for (const auto& [id, y] : masked_) out.push_back(id);
  return out;
}

std::vector<std::string> ServerSession::dropped() const {
  std::vector<std::string> out;
  for (const auto& [id, s] : shares_from_)
    if (!masked_.count(id)) out.push_back(id);
  return out;
}

void ServerSession::add_revealed(const std::string& from, const std::vector<wire::Revealed>& revealed) {
  if (!masked_.count(from)) throw SecAggError("secure aggregation: shares revealed by '" + from + "', not a survivor");
  revealed_[from] = revealed;
}

std::vector<uint32_t> ServerSession::sum() const {
  if (static_cast<int>(masked_.size()) < threshold_ || static_cast<int>(revealed_.size()) < threshold_)
    throw SecAggError("secure aggregation failed: " + std::to_string(masked_.size()) + " masked updates and " +
                      std::to_string(revealed_.size()) + " unmasking answers, fewer than the threshold t = " +
                      std::to_string(threshold_) + "; the round is discarded");
  auto rebuild = [&](const std::string& owner, bool mask_key) {
    std::vector<Share> shares;
    for (const auto& [from, list] : revealed_) {
      for (const auto& r : list) {
        if (r.owner() == owner && r.mask_key() == mask_key) shares.push_back(Share{static_cast<uint8_t>(r.x()), r.share()});
      }
      if (static_cast<int>(shares.size()) == threshold_) break;
    }
    if (static_cast<int>(shares.size()) < threshold_)
      throw SecAggError("secure aggregation failed: only " + std::to_string(shares.size()) + " shares of '" + owner +
                        "' revealed, threshold t = " + std::to_string(threshold_));
    return shamir_combine(shares);
  };
  std::vector<uint32_t> total(masked_.begin()->second.size(), 0);
  for (const auto& [id, y] : masked_)
    for (size_t i = 0; i < y.size(); ++i) total[i] += y[i];
  for (const auto& [id, y] : masked_) add_prg(total, rebuild(id, false), true);
  for (const std::string& v : dropped()) {
    const Bytes secret = rebuild(v, true);
    for (const auto& [u, y] : masked_) {
      // u added +PRG(s_uv) when u < v and -PRG when u > v; take it out again.
      add_prg(total, agree(secret, keys_.at(u).mask_public(), "mask"), u < v);
    }
  }
  return total;
}

}  // namespace meshtrain::fl::secagg
