// Robust aggregation: what the server makes of the round's client updates
// when some clients may be broken or hostile. FedMedian and FedTrimmedAvg
// (Yin et al. 2018, coordinate-wise median and β-trimmed mean), Krum and
// Multi-Krum (Blanchard et al. 2017). See Note [Robust aggregation].
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace meshtrain::fl {

// Note [Robust aggregation]
// Each client's update is a list of tensors in parameter order; all of them
// are read at once (so none combines with secure aggregation, where the
// server sees only the sum: the config refuses them there).
// - mean: Σ wᵢ·Δᵢ / Σ wᵢ, wᵢ the client's examples (FedAvg's).
// - median: per coordinate, the median of the n values (the mean of the
//   two middle ones when n is even, as numpy's median), unweighted.
// - trimmed_mean: per coordinate, the ⌊β·n⌋ largest and smallest values
//   dropped and the rest averaged, unweighted (β = trim_fraction < 0.5).
// - krum: each client scored by the sum of squared distances to its
//   n − f − 2 nearest others (f = byzantine); the lowest score's update is
//   taken; needs n ≥ 2f + 3. multi_krum: the `keep` lowest-scored updates
//   averaged by examples (keep 0: n − f).
struct Aggregation {
  std::string name = "mean";  // mean | median | trimmed_mean | krum | multi_krum
  double trim_fraction = 0.1;
  int64_t byzantine = 1;
  int64_t keep = 0;
  // Throws std::invalid_argument naming the key.
  void validate() const;
};

// The aggregate of `updates` (one list of tensors per client) with their
// example counts `weights`. Throws std::invalid_argument when there are too
// few clients for the rule (Krum's n ≥ 2f + 3), saying how many it needs.
std::vector<at::Tensor> aggregate(const Aggregation& rule, const std::vector<std::vector<at::Tensor>>& updates,
                                  const std::vector<double>& weights);

// Scales `update` in place so that its global L2 norm (over all its
// tensors) is at most `max_norm` (<= 0: no bound); returns the norm it had.
// The server's bound on any one client (fl.clip_norm): a finite update of
// absurd size moves the aggregate by at most max_norm times its weight's share.
double clip_update(std::vector<at::Tensor>& update, double max_norm);

// Krum's scores, one per client (for tests and the metrics).
std::vector<double> krum_scores(const std::vector<std::vector<at::Tensor>>& updates, int64_t byzantine);

}  // namespace meshtrain::fl
