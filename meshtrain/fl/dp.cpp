#include "meshtrain/fl/dp.h"

#include <ATen/CPUGeneratorImpl.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

double log_add(double a, double b) {
  if (a == -std::numeric_limits<double>::infinity()) return b;
  if (b == -std::numeric_limits<double>::infinity()) return a;
  const double hi = std::max(a, b), lo = std::min(a, b);
  return hi + std::log1p(std::exp(lo - hi));
}

}  // namespace

// Note [Differential privacy]: the sum in log space, term by term.
double rdp_sampled_gaussian(double q, double z, int alpha) {
  if (!(q >= 0 && q <= 1) || !(z > 0) || alpha < 2) throw std::invalid_argument("rdp_sampled_gaussian: bad arguments");
  if (q == 0) return 0;
  if (q == 1) return alpha / (2 * z * z);
  double log_a = -std::numeric_limits<double>::infinity();
  for (int k = 0; k <= alpha; ++k) {
    const double log_binomial = std::lgamma(alpha + 1.0) - std::lgamma(k + 1.0) - std::lgamma(alpha - k + 1.0);
    const double term = log_binomial + k * std::log(q) + (alpha - k) * std::log1p(-q) +
                        (static_cast<double>(k) * k - k) / (2 * z * z);
    log_a = log_add(log_a, term);
  }
  return log_a / (alpha - 1);
}

namespace {

// min over α of Σ RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1), the rounds grouped by (q, z).
double epsilon_of(const std::map<std::pair<double, double>, int64_t>& counts, double delta) {
  if (counts.empty()) return 0;
  double best = std::numeric_limits<double>::infinity();
  for (int alpha = 2; alpha <= 256; ++alpha) {
    const double a = alpha;
    double rdp = 0;
    for (const auto& [qz, n] : counts) {
      if (!(qz.second > 0)) return std::numeric_limits<double>::infinity();
      rdp += static_cast<double>(n) * rdp_sampled_gaussian(qz.first, qz.second, alpha);
    }
    best = std::min(best, rdp + std::log((a - 1) / a) - (std::log(delta) + std::log(a)) / (a - 1));
  }
  return std::max(0.0, best);
}

}  // namespace

double dp_epsilon(double q, double z, int64_t rounds, double delta) {
  if (rounds == 0) return 0;
  return epsilon_of({{{q, z}, rounds}}, delta);
}

double PrivacyLedger::epsilon(double delta) const {
  std::map<std::pair<double, double>, int64_t> counts;
  for (const auto& qz : rounds) ++counts[qz];
  return epsilon_of(counts, delta);
}

std::string PrivacyLedger::to_json() const {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [q, z] : rounds) j.push_back({q, z});
  return nlohmann::json{{"rounds_q_z", j}}.dump();
}

PrivacyLedger PrivacyLedger::from_json(const std::string& text) {
  PrivacyLedger ledger;
  try {
    for (const auto& r : nlohmann::json::parse(text).at("rounds_q_z"))
      ledger.rounds.emplace_back(r.at(0).get<double>(), r.at(1).get<double>());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("not a privacy ledger: ") + e.what());
  }
  return ledger;
}

void add_gaussian_noise(std::vector<at::Tensor>& tensors, double stddev) {
  if (!(stddev > 0)) return;
  std::random_device device;
  const uint64_t seed = (static_cast<uint64_t>(device()) << 32) ^ device();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (at::Tensor& t : tensors) {
    const at::Tensor noise = at::normal(0.0, stddev, t.sizes(), generator, at::TensorOptions().dtype(at::kDouble));
    t = (t.to(at::kDouble) + noise).to(t.scalar_type());
  }
}

}  // namespace meshtrain::fl
