// Secure aggregation (Bonawitz et al. 2017, "Practical Secure Aggregation for
// Privacy-Preserving Machine Learning"; the protocol behind Flower's SecAgg+).
//
// Note [Secure aggregation]
// Each client u holds an integer vector x_u in Z_2^32 (its update, clipped and
// quantised: quantise_ring; times its example count with the count appended:
// weight_by_examples). One round, after training:
//  1. keys:   u makes two X25519 key pairs (c_u for encryption, s_u for masks)
//             and sends both public keys. U1 = those who did.
//  2. shares: u draws a self-mask seed b_u, splits b_u and s_u's secret key
//             into t-of-|U1| Shamir shares (GF(256), byte-wise), and seals
//             each peer's pair with AES-256-GCM under KDF(c_u, c_v).
//             U2 = those who sent shares; the server routes them.
//  3. mask:   u sends y_u = x_u + PRG(b_u) + Σ_{v∈U2, v≠u} ±PRG(KDF(s_u, s_v))
//             (+ when u < v, − when u > v): pairwise masks cancel in the sum.
//             U3 = those who sent y_u.
//  4. unmask: each survivor reveals its shares of b_u for u ∈ U3 and of s_v's
//             secret key for v ∈ U2 \ U3 (never both for one client). With t
//             of them the server rebuilds each b_u and each dropped s_v and
//             removes what did not cancel: Σ_{U3} y_u − Σ PRG(b_u) ∓ the masks
//             between survivors and the dropped = Σ_{U3} x_u.
// The server sees only masked vectors and the sum. Fewer than t clients at
// any step fails the round (SecAggError) rather than weakening the threshold.
#pragma once

#include "meshtrain/fl/federation.pb.h"

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::fl::secagg {

class SecAggError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Bytes = std::string;  // raw bytes, as protobuf holds them

struct KeyPair {
  Bytes secret, public_key;  // X25519, 32 bytes each
};
KeyPair generate_keypair();
// SHA-256 of the X25519 shared secret with a purpose label: a 32-byte key.
Bytes agree(const Bytes& secret, const Bytes& peer_public, const std::string& label);
Bytes random_bytes(size_t n);

// Shamir's t-of-n over GF(2^8), byte by byte; shares at x = 1..n.
struct Share {
  uint8_t x = 0;
  Bytes y;
};
std::vector<Share> shamir_split(const Bytes& secret, int n, int t);
Bytes shamir_combine(const std::vector<Share>& shares);  // needs t distinct shares

// n uint32 words from AES-256-CTR keyed by `seed` (32 bytes).
std::vector<uint32_t> prg(const Bytes& seed, size_t n);

// Fixed-range quantisation into the ring: clip to [-clip, clip], levels
// 2^bits - 1, stochastic rounding (unbiased inside the range).
std::vector<uint32_t> quantise_ring(const std::vector<float>& x, float clip, int bits, uint64_t seed);
// The sum of `count` quantised vectors back to the sum of the values.
std::vector<float> dequantise_ring_sum(const std::vector<uint32_t>& sum, int count, float clip, int bits);

// FedAvg's weights inside the ring: every quantised entry times the client's
// example count, and the count appended, so the secure sum carries Σ nᵢ·xᵢ
// and Σ nᵢ. The server then divides: the weighted mean, and nothing per client.
std::vector<uint32_t> weight_by_examples(std::vector<uint32_t> x, uint32_t examples);
// Throws SecAggError when Σ nᵢ·(2^bits - 1) reaches 2^32 (the sum could have wrapped).
std::vector<float> weighted_mean_from_sum(const std::vector<uint32_t>& sum, float clip, int bits);

// One client's side of one round.
class ClientSession {
 public:
  ClientSession(std::string id, int threshold);
  wire::PeerKeys keys() const;
  // Step 2: `peers` is U1 (with this client). Throws SecAggError if |U1| < t.
  std::vector<wire::SealedShares> share(const std::vector<wire::PeerKeys>& peers);
  // Step 3: `received` are the shares sealed for this client by U2 \ {u}.
  std::vector<uint32_t> mask(const std::vector<uint32_t>& x, const std::vector<wire::SealedShares>& received);
  // Step 4. Throws SecAggError when asked to reveal both secrets of a client
  // or about clients it holds no share of.
  std::vector<wire::Revealed> reveal(const std::vector<std::string>& survivors,
                                     const std::vector<std::string>& dropped) const;

 private:
  std::string id_;
  int threshold_;
  KeyPair cipher_, mask_;
  Bytes self_seed_;
  std::map<std::string, wire::PeerKeys> peers_;  // U1
  struct Held {
    uint8_t x = 0;
    Bytes self_seed_share, mask_key_share;
  };
  std::map<std::string, Held> held_;  // shares of U2's secrets (own included)
};

// The server's side: collects each step's messages and computes the sum.
class ServerSession {
 public:
  explicit ServerSession(int threshold);
  void add_keys(const std::string& id, const wire::PeerKeys& keys);
  // U1 in id order; throws SecAggError if fewer than t.
  std::vector<wire::PeerKeys> peers() const;
  void add_shares(const std::string& from, const std::vector<wire::SealedShares>& shares);
  bool sent_shares(const std::string& id) const { return shares_from_.count(id) > 0; }
  // Shares sealed for `to` by U2 (throws if |U2| < t).
  std::vector<wire::SealedShares> shares_for(const std::string& to) const;
  void add_masked(const std::string& id, const std::vector<uint32_t>& y);
  std::vector<std::string> survivors() const;  // U3
  std::vector<std::string> dropped() const;    // U2 \ U3
  void add_revealed(const std::string& from, const std::vector<wire::Revealed>& revealed);
  // Σ_{U3} x_u. Throws SecAggError naming what is missing when fewer than t
  // clients revealed or a secret cannot be rebuilt.
  std::vector<uint32_t> sum() const;
  int threshold() const { return threshold_; }

 private:
  int threshold_;
  std::map<std::string, wire::PeerKeys> keys_;                          // U1
  std::map<std::string, std::vector<wire::SealedShares>> shares_from_;  // U2
  std::map<std::string, std::vector<uint32_t>> masked_;                 // U3
  std::map<std::string, std::vector<wire::Revealed>> revealed_;
};

}  // namespace meshtrain::fl::secagg
