// An async federation's model versions (Note [Buffered asynchronous rounds]).
#include "meshtrain/fl/robust.h"
#include "meshtrain/fl/server_rounds.h"
#include "meshtrain/fl/update.h"

#include <cmath>
#include <cstdio>

namespace meshtrain::fl {

// Note [Buffered asynchronous rounds]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// fl.mode = "async" is FedBuff (Nguyen et al. 2022): clients train whenever
// they are free, and the server updates its model every K = fl.async.buffer
// results, whichever clients they came from, so that a slow client holds up
// no one. Each metrics row is one model version:
// - Version v's FIT task is handed to a client that polls with nothing in
//   flight and has not trained v yet, while fewer than fl.async.concurrency
//   clients train (0: no limit), and whose last result is not still waiting
//   in the buffer (a client has at most one result in an aggregation). A
//   client trains each version at most once, at the data offset of that
//   version, so two of its results never repeat. Once K results are in, no
//   task is handed out until the next version opens (it would be stale at once).
// - A result is taken when it answers the task its client has in flight, and
//   joins a buffer that outlives versions: results that arrive while the
//   server aggregates wait for the next version.
// - Version v closes when K results are buffered (or at fl.deadline_s with
//   what there is, at least fl.min_fit). A result trained from version u has
//   staleness s = v - u. One more than fl.async.max_staleness old is refused
//   at upload (its task stops counting against the concurrency when v opens),
//   and the metrics row lists its client as dropped.
// - Each result is decoded against its own version's structures, weighed by
//   its examples and bounded as a synchronous round's (Note [Client bounds]:
//   the declared examples, the norm bound, a non-finite norm), then scaled by
//   (1 + s)^-fl.async.staleness_exponent, and fl.aggregation combines them:
//   with "mean" and equal examples, Σ (1 + s_i)^-a Δ_i / K, FedBuff's update.
//   The server strategy (fl.strategy, fl.server_lr) steps with it as a round's.
// - Rollback, validation, checkpoints and resume are a round's. A resumed
//   server opens the next version; results in flight at the stop are lost.
// Neither DP-FedAvg's accountant nor secure aggregation (both about one
// round's cohort) can cover a buffer filled by whoever finished first:
// config.cpp refuses them with fl.mode = "async".
Rounds::Outcome Rounds::run_async_version(uint64_t version) {
  Outcome outcome;
  const std::vector<std::string> available =
      coordinator_.wait_for_clients(static_cast<size_t>(config_.min_available), config_.wait_clients_s);
  outcome.available = available.size();
  if (static_cast<int64_t>(available.size()) < config_.min_available) {
    outcome.error = std::to_string(available.size()) + " clients connected after " +
                    std::to_string(static_cast<int>(config_.wait_clients_s)) + " s, fewer than min_available = " +
                    std::to_string(config_.min_available);
    return outcome;
  }
  outcome.target = static_cast<size_t>(config_.async_buffer);
  coordinator_.open_async(version, fit_task(version), outcome.target, static_cast<size_t>(config_.async_concurrency),
                          static_cast<uint64_t>(config_.max_staleness));
  Coordinator::Buffered buffered = coordinator_.take_buffered(outcome.target, config_.deadline_s);
  outcome.sampled = std::move(buffered.assigned);
  outcome.dropped = std::move(buffered.too_stale);

  std::map<uint64_t, std::vector<Structure>> structures;  // per version the buffer's results trained from
  std::vector<std::vector<at::Tensor>> updates;
  std::vector<double> weights, losses;
  for (wire::Result& r : buffered.results) {
    auto [it, fresh] = structures.try_emplace(r.round());
    if (fresh) it->second = round_structures(config_.compression, shapes_, mix_seed(config_.seed, r.round()));
    take_result(r.round(), it->second, r.client_id(), r, updates, weights, losses, outcome);
    outcome.staleness[r.client_id()] = version - r.round();
  }
  bound_updates(version, updates, weights, losses, outcome);
  if (static_cast<int64_t>(updates.size()) < config_.min_fit) {
    outcome.error = std::to_string(updates.size()) + " valid results buffered within " +
                    std::to_string(static_cast<int>(config_.deadline_s)) + " s, fewer than min_fit = " +
                    std::to_string(config_.min_fit);
    return outcome;
  }
  double total = 0, loss = 0;
  for (size_t i = 0; i < updates.size(); ++i) {
    const double scale = std::pow(1.0 + static_cast<double>(outcome.staleness.at(outcome.participants[i])),
                                  -config_.staleness_exponent);
    for (at::Tensor& t : updates[i]) t.mul_(scale);
    total += weights[i];
    loss += weights[i] * losses[i];
  }
  outcome.train_loss = loss / total;
  try {
    apply_mean(aggregate(config_.aggregation, updates, weights));
  } catch (const std::invalid_argument& e) {  // too few updates for the rule: the version does not count
    outcome.error = e.what();
  }
  return outcome;
}

}  // namespace meshtrain::fl
