#include "meshtrain/fl/robust.h"

#include "meshtrain/fl/strategy.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace meshtrain::fl {

namespace {

// Every client's update as one row: [n, D] in fp64 (the order statistics of
// float32 values are exact in it; the mean as well as the sums can be).
at::Tensor stacked(const std::vector<std::vector<at::Tensor>>& updates) {
  std::vector<at::Tensor> rows;
  for (const auto& update : updates) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : update) flat.push_back(t.reshape({-1}).to(at::kDouble));
    rows.push_back(at::cat(flat));
  }
  return at::stack(rows);
}

// A row [D] cut back into the shapes (and dtypes) of `like`.
std::vector<at::Tensor> unflatten(const at::Tensor& row, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (const at::Tensor& t : like) {
    out.push_back(row.narrow(0, at, t.numel()).view(t.sizes()).to(t.scalar_type()).clone());
    at += t.numel();
  }
  return out;
}

at::Tensor median_rows(const at::Tensor& rows) {
  const at::Tensor sorted = std::get<0>(rows.sort(0));
  const int64_t n = rows.size(0);
  if (n % 2 == 1) return sorted[n / 2];
  return (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

at::Tensor trimmed_mean_rows(const at::Tensor& rows, double beta) {
  const int64_t n = rows.size(0), cut = static_cast<int64_t>(beta * static_cast<double>(n));
  return std::get<0>(rows.sort(0)).narrow(0, cut, n - 2 * cut).mean(0);
}

}  // namespace

void Aggregation::validate() const {
  if (name != "mean" && name != "median" && name != "trimmed_mean" && name != "krum" && name != "multi_krum") {
    throw std::invalid_argument("fl.aggregation = \"" + name + "\": use mean, median, trimmed_mean, krum or multi_krum");
  }
  if (!(trim_fraction >= 0 && trim_fraction < 0.5)) throw std::invalid_argument("fl.trim_fraction must be in [0, 0.5)");
  if (byzantine < 0) throw std::invalid_argument("fl.byzantine must be >= 0");
  if (keep < 0) throw std::invalid_argument("fl.krum_keep must be >= 0 (0: n - fl.byzantine)");
}

double clip_update(std::vector<at::Tensor>& update, double max_norm) {
  double squares = 0;
  for (const at::Tensor& t : update) squares += t.to(at::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(squares);
  if (max_norm > 0 && norm > max_norm) {
    for (at::Tensor& t : update) t = (t.to(at::kDouble) * (max_norm / norm)).to(t.scalar_type());
  }
  return norm;
}

std::vector<double> krum_scores(const std::vector<std::vector<at::Tensor>>& updates, int64_t byzantine) {
  const int64_t n = static_cast<int64_t>(updates.size());
  if (n < 2 * byzantine + 3) {
    throw std::invalid_argument("krum with fl.byzantine = " + std::to_string(byzantine) + " needs at least " +
                                std::to_string(2 * byzantine + 3) + " updates (2f + 3), this round has " +
                                std::to_string(n));
  }
  const at::Tensor rows = stacked(updates);
  const at::Tensor distances = at::cdist(rows, rows).pow(2);  // [n, n]
  std::vector<double> scores;
  for (int64_t i = 0; i < n; ++i) {
    // The n - f - 2 nearest others: the row sorted, itself (0) first, skipped.
    const at::Tensor nearest = std::get<0>(distances[i].sort()).narrow(0, 1, n - byzantine - 2);
    scores.push_back(nearest.sum().item<double>());
  }
  return scores;
}

std::vector<at::Tensor> aggregate(const Aggregation& rule, const std::vector<std::vector<at::Tensor>>& updates,
                                  const std::vector<double>& weights) {
  if (updates.empty()) throw std::invalid_argument("aggregate: no updates");
  if (rule.name == "mean") return weighted_mean(updates, weights);
  if (rule.name == "median") return unflatten(median_rows(stacked(updates)), updates.front());
  if (rule.name == "trimmed_mean") return unflatten(trimmed_mean_rows(stacked(updates), rule.trim_fraction), updates.front());
  const std::vector<double> scores = krum_scores(updates, rule.byzantine);
  std::vector<size_t> order(updates.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  const int64_t n = static_cast<int64_t>(updates.size());
  const int64_t keep = rule.name == "krum" ? 1 : (rule.keep > 0 ? std::min(rule.keep, n) : n - rule.byzantine);
  std::vector<std::vector<at::Tensor>> chosen;
  std::vector<double> chosen_weights;
  for (int64_t k = 0; k < keep; ++k) {
    chosen.push_back(updates[order[k]]);
    chosen_weights.push_back(weights[order[k]]);
  }
  return weighted_mean(chosen, chosen_weights);
}

}  // namespace meshtrain::fl
