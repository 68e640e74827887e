// Server-side aggregation strategies: FedAvg (McMahan et al. 2017), FedProx
// (Li et al. 2020: FedAvg's aggregation, a proximal term on the clients),
// FedAdam and FedYogi (Reddi et al. 2021, "Adaptive Federated Optimization":
// the averaged update is a pseudo-gradient for a server-side optimizer).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace meshtrain::fl {

struct StrategyConfig {
  std::string name = "fedavg";  // "fedavg" | "fedprox" | "fedadam" | "fedyogi"
  double server_lr = 1.0;       // FedAvg/FedProx: w += server_lr · Δ; FedAdam/Yogi: η
  double beta1 = 0.9;
  double beta2 = 0.99;
  double tau = 1e-3;            // adaptivity ε of FedAdam/Yogi
  double prox_mu = 0.0;         // FedProx: μ, sent to the clients
  void validate() const;
};

class Strategy {
 public:
  explicit Strategy(StrategyConfig config) : config_(std::move(config)) { config_.validate(); }
  // Applies the round's mean update (one tensor per parameter) to `weights` in place.
  void apply(std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& mean_update);
  const StrategyConfig& config() const { return config_; }
  // The server optimizer's moments (empty for FedAvg/FedProx), for checkpoints.
  std::vector<at::Tensor>& first_moment() { return m_; }
  std::vector<at::Tensor>& second_moment() { return v_; }
  const std::vector<at::Tensor>& first_moment() const { return m_; }
  const std::vector<at::Tensor>& second_moment() const { return v_; }

 private:
  StrategyConfig config_;
  std::vector<at::Tensor> m_, v_;
};

// Σ wᵢ·Δᵢ / Σ wᵢ over clients (each a list of tensors in parameter order).
std::vector<at::Tensor> weighted_mean(const std::vector<std::vector<at::Tensor>>& updates,
                                      const std::vector<double>& weights);

}  // namespace meshtrain::fl
