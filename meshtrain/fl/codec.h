// Communication-efficient updates (Konečný et al. 2016, "Federated Learning:
// Strategies for Improving Communication Efficiency").
//
// Note [Update encoding]
// A client's update of one parameter tensor W travels in two stages.
//  1. Structure: what the client trains. "none": the whole update ΔW.
//     "low_rank": ΔW = A·B with A [m, k] drawn from the round's seed (entries
//     N(0, 1/m): columns nearly orthonormal, so a step on B moves W by about
//     the gradient projected on A's k columns) and only B [k, n] trained and
//     sent; tensors
//     that are not matrices wider than k go whole. "mask": a seeded random
//     mask keeps each entry with probability p, and only the kept entries are
//     trained and sent. The payload is the trained vector (ΔW flattened, B,
//     or the masked entries); Structure maps between payload and ΔW.
//  2. Sketch: what is sent of the payload. Optionally rotated (x -> H·D·x/√N
//     over the payload zero-padded to N = 2^j, D seeded ±1, H Walsh-Hadamard:
//     orthogonal, and inverted exactly by D·H/√N), then subsampled (each entry
//     kept with probability q from a seed, scaled by 1/q), then quantised to b
//     bits between the values' min and max with stochastic rounding. Each step
//     is unbiased, so the decoded update is an unbiased estimate of the payload.
// The wire (wire::EncodedTensor) carries the sketch seed, the payload length,
// the range and the values: no indices, no masks, no matrices A.
#pragma once

#include "meshtrain/fl/federation.pb.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::fl {

struct CompressionSpec {
  std::string structure = "none";  // "none" | "low_rank" | "mask"
  int64_t rank = 4;
  double mask_fraction = 0.25;
  bool rotate = false;
  double keep = 1.0;  // subsampling probability
  int64_t bits = 0;   // 0: float32

  bool sketched() const { return rotate || keep < 1.0 || bits > 0; }
  void validate() const;  // throws std::invalid_argument naming the key
  static CompressionSpec from_wire(const wire::Compression& c);
  wire::Compression to_wire() const;
  std::string describe() const;  // "low_rank(4)+rotate+keep(0.25)+2bit"
};

// splitmix64 of (a, b): independent seeds for each purpose and tensor.
uint64_t mix_seed(uint64_t a, uint64_t b);
// 64-bit FNV-1a of a client id: the same in every implementation of the
// protocol (a client's own sketch seeds and data order derive from it).
uint64_t fnv1a(const std::string& text);

// The structure of one parameter tensor's update for a round.
class Structure {
 public:
  Structure(const CompressionSpec& spec, at::IntArrayRef shape, uint64_t seed);
  int64_t payload_size() const { return payload_size_; }
  at::Tensor expand(const at::Tensor& payload) const;  // payload -> ΔW of the tensor's shape
  at::Tensor project(const at::Tensor& grad) const;    // dL/dW -> dL/dpayload (chain rule)
  const char* kind() const;

 private:
  enum class Kind { kFull, kLowRank, kMask } kind_ = Kind::kFull;
  std::vector<int64_t> shape_;
  at::Tensor a_;     // low rank: [m, k]
  at::Tensor mask_;  // mask: bool, flattened
  int64_t payload_size_ = 0;
};

// The rotation on its own (exposed for tests): y = H·D·pad(x)/√N and back.
at::Tensor rotate(const at::Tensor& x, uint64_t seed);
at::Tensor unrotate(const at::Tensor& y, uint64_t seed, int64_t length);

// Rotation and subsampling: payload -> the values to send (float32), and back.
at::Tensor sketch_values(const at::Tensor& payload, const CompressionSpec& spec, uint64_t seed);
at::Tensor unsketch_values(const at::Tensor& values, const CompressionSpec& spec, uint64_t seed, int64_t length);

// Unbiased stochastic b-bit quantisation between lo and hi, packed little-endian.
struct Quantised {
  std::string packed;
  float lo = 0, hi = 0;
};
Quantised quantise(const at::Tensor& values, int64_t bits, at::Generator& rng);
at::Tensor dequantise(const std::string& packed, int64_t count, int64_t bits, float lo, float hi);

// The whole client side and server side of one tensor (structure excluded).
// `rng` draws the quantiser's rounding, which must differ between clients.
wire::EncodedTensor encode(const at::Tensor& payload, const CompressionSpec& spec, uint64_t seed, uint32_t index,
                           at::Generator& rng);
// Throws std::runtime_error (naming the tensor) on a message inconsistent with the spec.
at::Tensor decode(const wire::EncodedTensor& encoded, const CompressionSpec& spec, int64_t expected_length);

// Bytes of values an encoding of `length` payload entries sends (kept entries
// times bits, or 4 bytes each), excluding the message's framing.
int64_t expected_value_bytes(int64_t kept, int64_t bits);
// Entries the subsampling keeps for (seed, padded length) — what decode expects.
int64_t kept_entries(const CompressionSpec& spec, uint64_t seed, int64_t length);

}  // namespace meshtrain::fl
