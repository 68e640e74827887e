#include "meshtrain/fl/server_rounds.h"

#include "meshtrain/fl/metrics.h"
#include "meshtrain/fl/robust.h"
#include "meshtrain/fl/secagg.h"
#include "meshtrain/fl/update.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

namespace meshtrain::fl {
namespace {

std::string privacy_path(const FlConfig& c) { return c.out + "/privacy.json"; }

std::vector<uint32_t> words_of(const std::string& bytes) {
  std::vector<uint32_t> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

}  // namespace

Rounds::Rounds(const FlConfig& config, Coordinator& coordinator)
    : config_(config), coordinator_(coordinator), model_(config.model, config.seed), strategy_(config.strategy) {
  params_ = parameters_of(*model_);
  names_ = parameter_names(*model_);
  for (const auto& p : params_) shapes_.push_back(p.sizes().vec());
  if (!config_.val_file.empty()) {
    val_file_ = std::make_unique<train::TokenFile>(config_.val_file);
    val_ = std::make_unique<train::Sampler>(*val_file_, config_.model.context, config_.seed, /*shuffle=*/false);
  }
  util::make_directories(config_.out);
  if (config_.resume) resume();
  if (next_round_ == 1) {
    clear_states();
    std::filesystem::remove(privacy_path(config_));
  } else if (config_.dp() && util::is_regular_file(privacy_path(config_))) {
    privacy_ = PrivacyLedger::from_json(util::read_text_file(privacy_path(config_)));
  }
}

std::vector<at::Tensor> Rounds::weights() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) out.push_back(p.detach().clone());
  return out;
}

wire::Task Rounds::fit_task(uint64_t round) const {
  wire::Task task;
  task.set_model_json(model::to_json(config_.model));
  for (size_t i = 0; i < params_.size(); ++i) *task.add_weights() = to_wire(names_[i], params_[i]);
  wire::FitConfig* fit = task.mutable_fit();
  fit->set_local_steps(static_cast<uint32_t>(config_.local_steps));
  fit->set_batch(static_cast<uint32_t>(config_.batch));
  fit->set_lr(static_cast<float>(config_.lr));
  fit->set_optimizer(config_.optimizer);
  fit->set_prox_mu(static_cast<float>(config_.strategy.prox_mu));
  fit->set_seed(mix_seed(config_.seed, round));
  *fit->mutable_compression() = config_.compression.to_wire();
  fit->mutable_secagg()->set_enabled(config_.secagg);
  fit->mutable_secagg()->set_threshold(static_cast<uint32_t>(config_.threshold));
  fit->mutable_secagg()->set_clip(static_cast<float>(config_.clip));
  fit->mutable_secagg()->set_bits(static_cast<uint32_t>(config_.secagg_bits));
  fit->set_data_offset((round - 1) * static_cast<uint64_t>(config_.local_steps * config_.batch));
  if (!config_.clip_auto) fit->set_clip_norm(static_cast<float>(config_.clip_norm));
  return task;
}

// Note [Sampling clients]
// A round aims at a target of results: fl.clients_per_round, or else
// fl.fraction of the connected clients (at least min_fit). It samples the
// target times 1 + fl.over_select of them, a seeded shuffle of the sorted ids
// (the seed, fl.seed mixed with the round, is in the metrics row, so that a
// round's choice can be made again), and closes as soon as the target's
// results are in, or every sampled client has answered or left, or at the
// deadline: dropouts cost the over-selected clients' work, not the round's
// time. Results that come after it closed are refused and the senders listed
// as dropped. Under DP the shuffle's seed is random (the choice must be secret).
std::vector<std::string> sample_clients(std::vector<std::string> ids, size_t count, uint64_t seed) {
  std::sort(ids.begin(), ids.end());
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(std::min(ids.size(), count));
  std::sort(ids.begin(), ids.end());
  return ids;
}

Rounds::Outcome Rounds::run_round(uint64_t round) {
  Outcome outcome;
  std::vector<std::string> available =
      coordinator_.wait_for_clients(static_cast<size_t>(config_.min_available), config_.wait_clients_s);
  if (static_cast<int64_t>(available.size()) < config_.min_available) {
    outcome.error = std::to_string(available.size()) + " clients connected after " +
                    std::to_string(static_cast<int>(config_.wait_clients_s)) + " s, fewer than min_available = " +
                    std::to_string(config_.min_available);
    return outcome;
  }
  // Note [Sampling clients]
  outcome.available = available.size();
  outcome.target = std::min(available.size(), config_.clients_per_round > 0
                                                  ? static_cast<size_t>(config_.clients_per_round)
                                                  : std::max<size_t>(static_cast<size_t>(config_.min_fit),
                                                                     static_cast<size_t>(std::ceil(config_.fraction * available.size()))));
  // The target plus its over-selected share, rounded up (100 x 0.1 is 10, not 10.000000000000002).
  const size_t sampled = std::min(available.size(), outcome.target + static_cast<size_t>(std::ceil(
                                                                          outcome.target * config_.over_select - 1e-9)));
  // Under DP the choice must be secret for the sampling to hide anyone (Note [Differential privacy]).
  outcome.sample_seed = mix_seed(config_.seed, round + 0x5a);
  outcome.sampled = sample_clients(std::move(available), sampled,
                                   config_.dp() ? (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()
                                                : outcome.sample_seed);

  wire::Task task = fit_task(round);
  // Distributed DP: the clients add the noise, a 1/m share of its variance each.
  if (config_.dp() && config_.secagg)
    task.mutable_fit()->set_noise_stddev(static_cast<float>(config_.noise_multiplier * config_.clip_norm /
                                                            std::sqrt(static_cast<double>(outcome.sampled.size()))));
  task.set_kind(wire::Task::FIT);
  Stream stream;  // Note [Streaming the mean]
  if (streams()) {
    stream.round = round;
    stream.structures = round_structures(config_.compression, shapes_, mix_seed(config_.seed, round));
    coordinator_.stream_results([&](const std::string& id, wire::Result& r) { stream_result(stream, id, r, outcome); });
  }
  coordinator_.open(round, std::move(task), outcome.sampled, outcome.target);  // one copy of the model for all
  std::map<std::string, wire::Result> results = coordinator_.close(config_.deadline_s);
  coordinator_.stream_results(nullptr);
  for (const auto& id : outcome.sampled)
    if (!results.count(id)) outcome.dropped.push_back(id);
  if (static_cast<int64_t>(results.size()) < config_.min_fit) {
    outcome.error = std::to_string(results.size()) + " of " + std::to_string(outcome.sampled.size()) +
                    " clients returned results before the deadline, fewer than min_fit = " +
                    std::to_string(config_.min_fit);
    return outcome;
  }
  if (config_.secagg) aggregate_secure(round, results, outcome);
  else if (streams()) aggregate_streamed(stream, outcome);
  else aggregate_plain(round, results, outcome);
  return outcome;
}

void Rounds::aggregate_plain(uint64_t round, std::map<std::string, wire::Result>& results, Outcome& outcome) {
  const std::vector<Structure> structures = round_structures(config_.compression, shapes_, mix_seed(config_.seed, round));
  std::vector<std::vector<at::Tensor>> updates;
  std::vector<double> weights, losses;
  for (auto& [id, r] : results) take_result(round, structures, id, r, updates, weights, losses, outcome);
  bound_updates(round, updates, weights, losses, outcome);
  if (config_.dp() && !updates.empty()) account(outcome, config_.noise_multiplier);
  if (static_cast<int64_t>(updates.size()) < config_.min_fit) {
    outcome.error = std::to_string(updates.size()) + " valid updates, fewer than min_fit = " + std::to_string(config_.min_fit);
    return;
  }
  double total = 0, loss = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    total += weights[i];
    loss += weights[i] * losses[i];
  }
  outcome.train_loss = loss / total;
  if (config_.dp()) {  // Note [Differential privacy]: weight 1 each, noise on the sum, divided by the m sampled
    std::vector<at::Tensor> sum = weighted_mean(updates, weights);
    for (at::Tensor& t : sum) t = t * static_cast<double>(updates.size());
    add_gaussian_noise(sum, config_.noise_multiplier * config_.clip_norm);
    for (at::Tensor& t : sum) t = t / static_cast<double>(outcome.sampled.size());
    apply_mean(sum);
    return;
  }
  try {
    apply_mean(aggregate(config_.aggregation, updates, weights));
  } catch (const std::invalid_argument& e) {  // too few updates for the rule: the round does not count
    outcome.error = e.what();
  }
}

void Rounds::take_result(uint64_t round, const std::vector<Structure>& structures, const std::string& id,
                         wire::Result& r,
                         std::vector<std::vector<at::Tensor>>& updates, std::vector<double>& weights,
                         std::vector<double>& losses, Outcome& outcome) {
  const uint64_t seed = mix_seed(config_.seed, round);
  // Note [Client bounds]: a client's weight is at most what it declared at Join.
  uint64_t cap = coordinator_.declared_examples(id);
  if (config_.max_examples_per_client > 0) cap = std::min(cap, static_cast<uint64_t>(config_.max_examples_per_client));
  const uint64_t examples = std::min<uint64_t>(r.examples(), cap);
  try {
    if (examples == 0) throw std::runtime_error("0 examples");
    if (!std::isfinite(r.train_loss())) throw std::runtime_error("train loss not finite");
    updates.push_back(decode_update({r.update().begin(), r.update().end()}, config_.compression, structures, seed, id,
                                    /*shared_seeds=*/false));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fl server: round %llu: the update of '%s' is rejected: %s\n",
                 static_cast<unsigned long long>(round), id.c_str(), e.what());
    outcome.dropped.push_back(id);
    return;
  }
  google::protobuf::RepeatedPtrField<wire::EncodedTensor>().Swap(r.mutable_update());  // freed, not kept for reuse
  if (r.examples() > cap && overclaimed_.insert(id).second) {
    std::fprintf(stderr, "fl server: '%s' claims %llu examples; counted as %llu (what it declared at Join, and "
                 "fl.max_examples_per_client)\n", id.c_str(), static_cast<unsigned long long>(r.examples()),
                 static_cast<unsigned long long>(cap));
  }
  weights.push_back(static_cast<double>(examples));
  losses.push_back(r.train_loss());
  outcome.participants.push_back(id);
}

// Note [Client bounds]: the norm bound, then a non-finite norm rejects the update.
void Rounds::bound_updates(uint64_t round, std::vector<std::vector<at::Tensor>>& updates, std::vector<double>& weights,
                           std::vector<double>& losses, Outcome& outcome) {
  std::vector<double> norms;
  for (auto& u : updates) norms.push_back(clip_update(u, 0));
  double bound = config_.clip_auto ? 0 : config_.clip_norm;
  std::vector<double> finite;
  for (double n : norms)
    if (std::isfinite(n)) finite.push_back(n);
  if (config_.clip_auto && !finite.empty()) {
    std::sort(finite.begin(), finite.end());
    bound = config_.clip_factor * finite[(finite.size() - 1) / 2];
  }
  outcome.clip_norm = bound;
  const bool clipping = config_.clip_auto || bound > 0;  // an auto bound of 0 (a median update of 0) still binds
  std::vector<std::vector<at::Tensor>> kept;
  std::vector<double> kept_weights, kept_losses;
  std::vector<std::string> kept_ids;
  for (size_t i = 0; i < updates.size(); ++i) {
    const std::string& id = outcome.participants[i];
    if (!std::isfinite(norms[i])) {
      std::fprintf(stderr, "fl server: round %llu: the update of '%s' is rejected: its norm is not finite\n",
                   static_cast<unsigned long long>(round), id.c_str());
      outcome.dropped.push_back(id);
      continue;
    }
    if (clipping && norms[i] > bound) {
      if (bound > 0) clip_update(updates[i], bound);
      else for (at::Tensor& t : updates[i]) t.zero_();
      outcome.clipped.push_back(id);
      std::fprintf(stderr, "fl server: round %llu: the update of '%s' has norm %.3g, clipped to %.3g\n",
                   static_cast<unsigned long long>(round), id.c_str(), norms[i], bound);
    }
    kept.push_back(std::move(updates[i]));
    kept_weights.push_back(config_.dp() ? 1.0 : weights[i]);
    kept_losses.push_back(losses[i]);
    kept_ids.push_back(id);
  }
  updates = std::move(kept);
  weights = std::move(kept_weights);
  losses = std::move(kept_losses);
  outcome.participants = std::move(kept_ids);
}

// Note [Secure aggregation]: keys arrived with the FIT results; three phases follow.
void Rounds::aggregate_secure(uint64_t round, const std::map<std::string, wire::Result>& fit_results, Outcome& outcome) {
  const uint64_t seed = mix_seed(config_.seed, round);
  secagg::ServerSession session(static_cast<int>(config_.threshold));
  double loss = 0, examples = 0;
  try {
    for (const auto& [id, r] : fit_results) {
      session.add_keys(id, r.keys());
      loss += r.train_loss() * static_cast<double>(r.examples());
      examples += static_cast<double>(r.examples());
    }
    std::map<std::string, wire::Task> tasks;
    const std::vector<wire::PeerKeys> peers = session.peers();
    for (const auto& [id, r] : fit_results) {
      wire::Task& t = tasks[id];
      for (const auto& p : peers) *t.add_peers() = p;
    }
    coordinator_.open(round, wire::Task::SECAGG_SHARE, std::move(tasks));
    for (const auto& [id, r] : coordinator_.close(config_.deadline_s))
      session.add_shares(id, {r.shares().begin(), r.shares().end()});
    tasks.clear();
    for (const auto& p : peers) {
      if (!session.sent_shares(p.client_id())) continue;  // not in U2
      std::vector<wire::SealedShares> mine = session.shares_for(p.client_id());
      tasks[p.client_id()];
      for (auto& s : mine) *tasks[p.client_id()].add_shares() = std::move(s);
    }
    coordinator_.open(round, wire::Task::SECAGG_MASK, std::move(tasks));
    const std::vector<Structure> structures = round_structures(config_.compression, shapes_, seed);
    size_t length = 1;  // the sketched values, and the example count (weight_by_examples)
    for (size_t i = 0; i < structures.size(); ++i)
      length += static_cast<size_t>(kept_entries(config_.compression, sketch_seed(seed, static_cast<uint32_t>(i), "", true),
                                                 structures[i].payload_size()));
    for (const auto& [id, r] : coordinator_.close(config_.deadline_s)) {
      if (r.masked().size() != length * 4) {
        std::fprintf(stderr, "fl server: round %llu: the masked update of '%s' has %zu bytes, expected %zu\n",
                     static_cast<unsigned long long>(round), id.c_str(), r.masked().size(), length * 4);
        continue;
      }
      session.add_masked(id, words_of(r.masked()));
    }
    tasks.clear();
    const std::vector<std::string> survivors = session.survivors(), dropped = session.dropped();
    for (const auto& id : survivors) {
      wire::Task& t = tasks[id];
      for (const auto& s : survivors) t.add_survivors(s);
      for (const auto& d : dropped) t.add_dropped(d);
    }
    coordinator_.open(round, wire::Task::SECAGG_UNMASK, std::move(tasks));
    for (const auto& [id, r] : coordinator_.close(config_.deadline_s))
      session.add_revealed(id, {r.revealed().begin(), r.revealed().end()});
    const std::vector<uint32_t> sum = session.sum();
    const std::vector<float> mean =
        secagg::weighted_mean_from_sum(sum, static_cast<float>(config_.clip), static_cast<int>(config_.secagg_bits));
    for (const auto& [id, r] : fit_results)
      if (std::find(survivors.begin(), survivors.end(), id) == survivors.end()) outcome.dropped.push_back(id);
    outcome.participants = survivors;
    outcome.train_loss = examples > 0 ? loss / examples : 0;
    // The clients added the noise; the dropped took their shares with them (Note [Differential privacy]).
    if (config_.dp() && !survivors.empty())
      account(outcome, config_.noise_multiplier * std::sqrt(static_cast<double>(survivors.size()) /
                                                            static_cast<double>(outcome.sampled.size())));
    if (static_cast<int64_t>(survivors.size()) < config_.min_fit)
      throw secagg::SecAggError(std::to_string(survivors.size()) + " masked updates, fewer than min_fit");
    apply_mean(split_sketched(mean, config_.compression, structures, seed));
  } catch (const std::exception& e) {
    outcome.error = e.what();
  }
}

void Rounds::apply_mean(const std::vector<at::Tensor>& mean) {
  at::NoGradGuard no_grad;
  strategy_.apply(params_, mean);
}

double Rounds::evaluate() {
  if (!val_) return std::nan("");
  at::NoGradGuard no_grad;
  model_->eval();
  double sum = 0;
  for (int64_t b = 0; b < config_.eval_batches; ++b) {
    auto [inputs, targets] = val_->rows(b * config_.batch, config_.batch);
    sum += model_->loss(inputs, targets).item<double>();
  }
  model_->train();
  return sum / static_cast<double>(config_.eval_batches);
}

void Rounds::account(const Outcome& outcome, double z) {
  privacy_.rounds.emplace_back(static_cast<double>(outcome.sampled.size()) / static_cast<double>(outcome.available), z);
  const std::string tmp = privacy_path(config_) + ".tmp";
  util::write_text_file(tmp, privacy_.to_json());
  util::rename_path(tmp, privacy_path(config_));
}

// Note [Client bounds]: rollback.
std::string Rounds::regression(double val_loss) const {
  if (!state_finite()) return "the aggregated model or the server optimizer's state holds non-finite values";
  if (!val_) return {};
  char why[256];
  if (!std::isfinite(val_loss)) {
    std::snprintf(why, sizeof why, "the validation loss became %g", val_loss);
    return why;
  }
  if (std::isfinite(good_val_loss_) && val_loss > good_val_loss_ + config_.max_regression) {
    std::snprintf(why, sizeof why, "the validation loss rose from %.4f to %.4f, more than fl.max_regression = %g",
                  good_val_loss_, val_loss, config_.max_regression);
    return why;
  }
  return {};
}

void Rounds::record(uint64_t round, const Outcome& o, double seconds, double val_loss) {
  nlohmann::json row;
  row["round"] = round;
  row["label"] = config_.display_label();
  row["strategy"] = config_.strategy.name;
  row["status"] = o.error.empty() ? "ok" : o.rolled_back ? "rolled_back" : "failed";
  if (!o.error.empty()) row["error"] = o.error;
  if (o.rolled_back) row["rejected_val_loss"] = std::isfinite(o.rejected_val_loss) ? nlohmann::json(o.rejected_val_loss)
                                                                                  : nlohmann::json(nullptr);
  row["clip_norm"] = o.clip_norm;
  row["clipped"] = o.clipped;
  if (config_.dp()) row["epsilon"] = privacy_.epsilon(config_.dp_delta);
  row["mode"] = config_.mode;
  if (config_.async()) row["staleness"] = o.staleness;  // versions behind, per participant
  row["target"] = o.target;
  row["sample_seed"] = config_.dp() ? nlohmann::json(nullptr) : nlohmann::json(o.sample_seed);  // DP's is secret
  row["sampled"] = o.sampled;
  row["participants"] = o.participants;
  row["dropped"] = o.dropped;
  row["train_loss"] = o.error.empty() && round > 0 ? nlohmann::json(o.train_loss) : nlohmann::json(nullptr);
  row["val_loss"] = std::isnan(val_loss) ? nlohmann::json(nullptr) : nlohmann::json(val_loss);
  int64_t up = 0, down = 0;
  nlohmann::json per_client = nlohmann::json::object();
  for (const auto& [id, t] : coordinator_.take_traffic()) {
    up += t.up;
    down += t.down;
    per_client[id] = {{"up", t.up}, {"down", t.down}};
  }
  cumulative_up_ += up;
  cumulative_down_ += down;
  row["uplink_bytes"] = up;
  row["downlink_bytes"] = down;
  row["cumulative_uplink_bytes"] = cumulative_up_;
  row["cumulative_downlink_bytes"] = cumulative_down_;
  row["bytes_per_client"] = per_client;
  row["seconds"] = seconds;
  row["elapsed_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  append_jsonl(config_.out + "/metrics.jsonl", row);
  if (round == 0) {
    std::fprintf(stderr, "fl server: round 0 (the starting model): val loss %.4f\n", val_loss);
    return;
  }
  if (config_.async()) {
    uint64_t stalest = 0;
    for (const auto& [id, s] : o.staleness) stalest = std::max(stalest, s);
    std::fprintf(stderr, "fl server: version %llu/%lld %s: %zu results (staleness up to %llu), %zu clients handed the "
                 "model, train loss %.4f, val loss %.4f, up %lld B, down %lld B, %.2f s%s%s\n",
                 static_cast<unsigned long long>(round), static_cast<long long>(config_.rounds),
                 o.error.empty() ? "done" : "FAILED", o.participants.size(), static_cast<unsigned long long>(stalest),
                 o.sampled.size(), o.train_loss, val_loss, static_cast<long long>(up), static_cast<long long>(down),
                 seconds, o.error.empty() ? "" : ": ", o.error.c_str());
    return;
  }
  std::fprintf(stderr, "fl server: round %llu/%lld %s: %zu of %zu clients, train loss %.4f, val loss %.4f, up %lld B, "
               "down %lld B, %.2f s%s%s\n",
               static_cast<unsigned long long>(round), static_cast<long long>(config_.rounds),
               o.error.empty() ? "done" : "FAILED", o.participants.size(), o.sampled.size(), o.train_loss, val_loss,
               static_cast<long long>(up), static_cast<long long>(down), seconds, o.error.empty() ? "" : ": ",
               o.error.c_str());
}

int Rounds::run() {
  int failed = 0;
  if (next_round_ == 1) {
    good_val_loss_ = evaluate();
    record(0, Outcome{}, 0.0, good_val_loss_);
  }
  for (uint64_t round = next_round_; round <= static_cast<uint64_t>(config_.rounds); ++round) {
    const auto start = std::chrono::steady_clock::now();
    const Snapshot before = snapshot();
    Outcome outcome = config_.async() ? run_async_version(round) : run_round(round);
    double val_loss = evaluate();
    if (const std::string why = regression(val_loss); !why.empty()) {  // Note [Client bounds]
      restore(before);
      outcome.rolled_back = true;
      outcome.rejected_val_loss = val_loss;
      outcome.error = "rolled back: " + why;
      val_loss = good_val_loss_;
    } else if (outcome.error.empty()) {
      good_val_loss_ = val_loss;
    }
    if (!outcome.error.empty()) ++failed;
    record(round, outcome, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), val_loss);
    if (!outcome.rolled_back) save(round);
  }
  coordinator_.stop("the federation finished its " + std::to_string(config_.rounds) + " rounds", 5.0);
  write_loss_svg({config_.out + "/metrics.jsonl"}, config_.out + "/loss.svg");
  return failed;
}

}  // namespace meshtrain::fl
