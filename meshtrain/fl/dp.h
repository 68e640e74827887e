// Differential privacy for the federation: DP-FedAvg's noise and the privacy
// accountant that says what (ε, δ) the rounds run so far have cost.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::fl {

// Note [Differential privacy]
// DP-FedAvg (McMahan et al. 2018): each round every sampled client's update
// is clipped to the global L2 norm S (fl.clip_norm), the clipped updates are
// summed with weight 1 each, Gaussian noise N(0, z²S²) is added to every
// coordinate of the sum (z = fl.dp.noise_multiplier) and the sum is divided
// by m, the clients sampled. One client changes the sum by at most S, so a
// round is the sampled Gaussian mechanism at the client level.
// The accountant: RDP of the sampled Gaussian mechanism at integer orders
// α = 2..256 (Mironov, Talwar and Zhang 2019):
//   RDP(α) = log Σ_{k=0..α} C(α,k) (1−q)^(α−k) q^k exp((k²−k)/(2z²)) / (α−1),
// q the sampling rate (fl.fraction; Poisson sampling assumed, while the
// server samples a fixed number of clients), composed over T rounds by
// addition and converted to (ε, δ) by (Balle et al. 2020)
//   ε = min_α T·RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1),
// the conversion Opacus uses. At q = 1, RDP(α) = α/(2z²) exactly.
// The server samples a fixed number m of the n connected clients, with the
// operating system's randomness under DP (a seeded choice anyone with the
// config could repeat amplifies nothing); each round is accounted with its
// own q = m/n, as Poisson sampling at that rate (an approximation of
// sampling without replacement that is common practice).
// Distributed DP under secure aggregation: the server never sees one update,
// so each client adds N(0, z²S²/m) to its own clipped update; the sum holds
// N(0, z²S²) when all m survive. Dropped clients take their share of the
// noise with them: with m' of m in the sum, the round is accounted at
// z·√(m'/m), the noise the sum actually holds.
double rdp_sampled_gaussian(double q, double z, int alpha);
double dp_epsilon(double q, double z, int64_t rounds, double delta);

// The rounds that touched client data, each with its sampling rate q and
// noise multiplier z, and what they cost together.
struct PrivacyLedger {
  std::vector<std::pair<double, double>> rounds;  // (q, z)
  double epsilon(double delta) const;
  std::string to_json() const;
  static PrivacyLedger from_json(const std::string& text);  // throws std::runtime_error
};

// Adds N(0, stddev²) to every entry of `tensors`, from a generator seeded
// by the operating system (noise an observer could predict protects nothing).
void add_gaussian_noise(std::vector<at::Tensor>& tensors, double stddev);

}  // namespace meshtrain::fl
