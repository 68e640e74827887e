#include "meshtrain/fl/strategy.h"

#include <ATen/core/grad_mode.h>

#include <stdexcept>

namespace meshtrain::fl {

void StrategyConfig::validate() const {
  if (name != "fedavg" && name != "fedprox" && name != "fedadam" && name != "fedyogi")
    throw std::invalid_argument("[fl] strategy = \"" + name + "\": use fedavg, fedprox, fedadam or fedyogi");
  if (!(server_lr > 0)) throw std::invalid_argument("[fl] server_lr must be positive");
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    throw std::invalid_argument("[fl] beta1 and beta2 must be in [0, 1)");
  if (!(tau > 0)) throw std::invalid_argument("[fl] tau must be positive");
  if (prox_mu < 0) throw std::invalid_argument("[fl] prox_mu must be >= 0");
  if (name == "fedprox" && prox_mu == 0) throw std::invalid_argument("[fl] strategy fedprox needs prox_mu > 0");
}

std::vector<at::Tensor> weighted_mean(const std::vector<std::vector<at::Tensor>>& updates,
                                      const std::vector<double>& weights) {
  if (updates.empty()) throw std::invalid_argument("weighted_mean: no updates");
  double total = 0;
  for (double w : weights) total += w;
  std::vector<at::Tensor> mean;
  for (size_t p = 0; p < updates[0].size(); ++p) {
    at::Tensor sum = at::zeros_like(updates[0][p]);
    for (size_t c = 0; c < updates.size(); ++c) sum.add_(updates[c][p], weights[c] / total);
    mean.push_back(sum);
  }
  return mean;
}

void Strategy::apply(std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& delta) {
  at::NoGradGuard no_grad;
  const bool adaptive = config_.name == "fedadam" || config_.name == "fedyogi";
  if (!adaptive) {
    for (size_t i = 0; i < weights.size(); ++i) weights[i].add_(delta[i], config_.server_lr);
    return;
  }
  if (m_.empty()) {
    for (const auto& w : weights) {
      m_.push_back(at::zeros_like(w));
      // Reddi et al. start v at τ²: the first steps are not divided by ~0.
      v_.push_back(at::full_like(w, config_.tau * config_.tau));
    }
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    m_[i].mul_(config_.beta1).add_(delta[i], 1 - config_.beta1);
    const at::Tensor d2 = delta[i] * delta[i];
    if (config_.name == "fedadam") {
      v_[i].mul_(config_.beta2).add_(d2, 1 - config_.beta2);
    } else {  // Yogi: v -= (1-β2)·Δ²·sign(v - Δ²)
      v_[i].sub_(d2 * at::sign(v_[i] - d2), 1 - config_.beta2);
    }
    weights[i].add_(m_[i] / (v_[i].sqrt() + config_.tau), config_.server_lr);
  }
}

}  // namespace meshtrain::fl
