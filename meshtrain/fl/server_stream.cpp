// A round's mean summed as its results come (Note [Streaming the mean]).
#include "meshtrain/fl/robust.h"
#include "meshtrain/fl/server_rounds.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace meshtrain::fl {

// Note [Streaming the mean]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A round that keeps its results until it closes holds every update twice
// over (encoded, then decoded): at 1,000 clients a round of a 0.5 MB model,
// more than a gigabyte. Where the round's rule needs no update but the one in
// hand — fl.aggregation = "mean", a fixed fl.clip_norm (or none), no secure
// aggregation, no DP — each result is decoded, bounded and added to Σ
// examples·Δ the moment the round takes it (Coordinator::stream_results, on
// the thread that received it), and freed: the round holds one sum and the
// uploads in progress. The bounds are a round's (Note [Client bounds]): the
// declared examples, the fixed norm bound, a non-finite norm rejected. The
// mean is the same sum taken in arrival order, equal to the kept round's
// within float rounding. fl.clip_norm = "auto" (the default) bounds by the
// round's median norm, known only once all are in, so such rounds keep their
// results.
bool Rounds::streams() const {
  return !config_.secagg && !config_.dp() && config_.aggregation.name == "mean" && !config_.clip_auto;
}

void Rounds::stream_result(Stream& stream, const std::string& id, wire::Result& r, Outcome& outcome) {
  std::lock_guard<std::mutex> lock(stream.mutex);
  std::vector<std::vector<at::Tensor>> update;
  std::vector<double> weight, loss;
  take_result(stream.round, stream.structures, id, r, update, weight, loss, outcome);
  if (update.empty()) return;  // rejected, and listed as dropped
  const double norm = clip_update(update[0], 0);
  if (!std::isfinite(norm)) {
    std::fprintf(stderr, "fl server: round %llu: the update of '%s' is rejected: its norm is not finite\n",
                 static_cast<unsigned long long>(stream.round), id.c_str());
    outcome.participants.pop_back();
    outcome.dropped.push_back(id);
    return;
  }
  if (config_.clip_norm > 0 && norm > config_.clip_norm) {
    clip_update(update[0], config_.clip_norm);
    outcome.clipped.push_back(id);
    std::fprintf(stderr, "fl server: round %llu: the update of '%s' has norm %.3g, clipped to %.3g\n",
                 static_cast<unsigned long long>(stream.round), id.c_str(), norm, config_.clip_norm);
  }
  if (stream.sum.empty())
    for (const at::Tensor& t : update[0]) stream.sum.push_back(at::zeros_like(t));
  for (size_t p = 0; p < stream.sum.size(); ++p) stream.sum[p].add_(update[0][p], weight[0]);
  stream.total += weight[0];
  stream.loss += weight[0] * loss[0];
}

void Rounds::aggregate_streamed(Stream& stream, Outcome& outcome) {
  outcome.clip_norm = config_.clip_norm;
  if (static_cast<int64_t>(outcome.participants.size()) < config_.min_fit) {
    outcome.error = std::to_string(outcome.participants.size()) + " valid updates, fewer than min_fit = " +
                    std::to_string(config_.min_fit);
    return;
  }
  std::sort(outcome.participants.begin(), outcome.participants.end());  // as a kept round lists them
  std::sort(outcome.clipped.begin(), outcome.clipped.end());
  outcome.train_loss = stream.loss / stream.total;
  for (at::Tensor& t : stream.sum) t.div_(stream.total);
  apply_mean(stream.sum);
}

}  // namespace meshtrain::fl
