// The server's state on disk (Note [Client bounds], rollback): the model and
// the server optimizer's moments after each good round, the last
// fl.keep_states of them, and resuming from the newest readable one.
#include "meshtrain/fl/server_rounds.h"

#include "meshtrain/interop/safetensors.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace meshtrain::fl {
namespace {

namespace fs = std::filesystem;

std::string state_path(const FlConfig& c) { return c.out + "/state.safetensors"; }
std::string states_dir(const FlConfig& c) { return c.out + "/states"; }

bool all_finite(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors)
    if (!at::isfinite(t).all().item<bool>()) return false;
  return true;
}

// A state that belongs to another run: an error to report, not a file to skip.
class StateMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Note [Resuming a federation]
// A server started on a folder that holds a state resumes it: the rounds go
// on from the saved model (a longer fl.rounds extends a finished run). The
// state records the model's fingerprint, the strategy and the settings that
// change what is computed (FlConfig::result_settings); a start with another
// value of any of them would continue one run under another's rules and
// call the result either, so it is refused, naming each difference and the
// two ways out (another fl.server.out, or fl.server.resume = false to start
// afresh in this one). A state written before the settings were recorded is
// checked for the model and strategy alone.
std::string settings_differences(const std::string& saved, const std::map<std::string, std::string>& now) {
  const nlohmann::json was = nlohmann::json::parse(saved);
  std::string out;
  for (const auto& [key, value] : now) {
    if (!was.contains(key) || was[key].get<std::string>() == value) continue;
    out += (out.empty() ? "" : ", ") + key + " = " + value + " here, " + was[key].get<std::string>() + " there";
  }
  return out;
}

// states/round-N.safetensors, newest first.
std::vector<std::pair<uint64_t, fs::path>> kept_states(const FlConfig& c) {
  std::vector<std::pair<uint64_t, fs::path>> out;
  if (!fs::is_directory(states_dir(c))) return out;
  for (const auto& entry : fs::directory_iterator(states_dir(c))) {
    const std::string name = entry.path().filename().string();
    unsigned long long round = 0;
    if (std::sscanf(name.c_str(), "round-%llu.safetensors", &round) == 1) out.emplace_back(round, entry.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  return out;
}

}  // namespace

Rounds::Snapshot Rounds::snapshot() const {
  Snapshot s;
  for (const auto& p : params_) s.params.push_back(p.detach().clone());
  for (const auto& t : strategy_.first_moment()) s.m.push_back(t.clone());
  for (const auto& t : strategy_.second_moment()) s.v.push_back(t.clone());
  return s;
}

void Rounds::restore(const Snapshot& s) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(s.params[i]);
  strategy_.first_moment() = s.m;
  strategy_.second_moment() = s.v;
}

// The model and the server optimizer's moments (a FedAdam v of inf leaves the
// parameters finite while freezing them).
bool Rounds::state_finite() const {
  return all_finite(params_) && all_finite(strategy_.first_moment()) && all_finite(strategy_.second_moment());
}

void Rounds::save(uint64_t round) const {
  if (!state_finite()) throw std::logic_error("fl server: refusing to save a non-finite state");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < params_.size(); ++i) tensors.emplace_back("model." + names_[i], params_[i].detach());
  const Strategy& s = strategy_;
  for (size_t i = 0; i < s.first_moment().size(); ++i) {
    tensors.emplace_back("server.m." + std::to_string(i), s.first_moment()[i]);
    tensors.emplace_back("server.v." + std::to_string(i), s.second_moment()[i]);
  }
  std::map<std::string, std::string> meta{{"round", std::to_string(round)},
                                          {"model", model::fingerprint(config_.model)},
                                          {"strategy", config_.strategy.name},
                                          {"settings", nlohmann::json(config_.result_settings()).dump()},
                                          {"uplink_bytes", std::to_string(cumulative_up_)},
                                          {"downlink_bytes", std::to_string(cumulative_down_)}};
  if (std::isfinite(good_val_loss_)) meta["val_loss"] = std::to_string(good_val_loss_);
  interop::write_safetensors(state_path(config_), tensors, meta);
  keep_state(round);
}

// The state just written, also as states/round-N.safetensors (a hard link:
// the next write replaces state.safetensors by a rename, leaving this one
// whole); the oldest beyond fl.keep_states are removed.
void Rounds::keep_state(uint64_t round) const {
  fs::create_directories(states_dir(config_));
  const fs::path kept = states_dir(config_) + "/round-" + std::to_string(round) + ".safetensors";
  std::error_code error;
  fs::remove(kept, error);
  fs::create_hard_link(state_path(config_), kept, error);
  if (error) fs::copy_file(state_path(config_), kept, fs::copy_options::overwrite_existing);
  const auto all = kept_states(config_);
  for (size_t i = static_cast<size_t>(config_.keep_states); i < all.size(); ++i) fs::remove(all[i].second, error);
}

// A fresh run (nothing to resume, or fl.server.resume = false) starts with no
// kept states, so that an older run's files can neither be pruned in place of
// this run's nor resumed from, and with a new metrics.jsonl, so that its rows
// are not read as continuing an older run's.
void Rounds::clear_states() const {
  std::error_code error;
  fs::remove_all(states_dir(config_), error);
  fs::remove(config_.out + "/metrics.jsonl", error);
}

// state.safetensors, or when it cannot be read, the newest readable state in
// states/. A state of another model or strategy is an error, not skipped.
void Rounds::resume() {
  std::vector<std::string> candidates;
  if (util::path_exists(state_path(config_))) candidates.push_back(state_path(config_));
  for (const auto& [round, path] : kept_states(config_)) candidates.push_back(path.string());
  for (const std::string& path : candidates) {
    try {
      load_state(path);
      return;
    } catch (const StateMismatch& e) {
      throw std::runtime_error(e.what());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fl server: cannot resume from %s (%s); trying an older state\n", path.c_str(), e.what());
    }
  }
  if (!candidates.empty())
    throw std::runtime_error("fl server: no readable state in " + config_.out + "; remove it or set fl.server.resume = false");
}

void Rounds::load_state(const std::string& path) {
  const interop::SafetensorsFile file(path);
  const auto& meta = file.metadata();
  auto get = [&](const std::string& key) {
    auto it = meta.find(key);
    if (it == meta.end()) throw std::runtime_error("not a federated server state (no '" + key + "')");
    return it->second;
  };
  if (get("model") != model::fingerprint(config_.model))
    throw StateMismatch(file.path() + " holds another model (" + get("model") + "); remove it or set "
                        "fl.server.resume = false");
  if (get("strategy") != config_.strategy.name)
    throw StateMismatch(file.path() + " was written by strategy " + get("strategy") + ", not " + config_.strategy.name);
  if (meta.count("settings")) {
    const std::string differ = settings_differences(meta.at("settings"), config_.result_settings());
    if (!differ.empty())
      throw StateMismatch("fl server: " + config_.out + " holds a federation run with other settings (" + differ +
                          "); resuming would mix two runs. Use another --fl.server.out, or --fl.server.resume=false "
                          "to start afresh in " + config_.out);
  }
  // Everything parsed and checked before anything is restored.
  const uint64_t round = std::stoull(get("round"));
  const int64_t up = std::stoll(get("uplink_bytes")), down = std::stoll(get("downlink_bytes"));
  const double val_loss = meta.count("val_loss") ? std::stod(meta.at("val_loss")) : std::nan("");
  Snapshot s;
  for (size_t i = 0; i < params_.size(); ++i) s.params.push_back(file.read("model." + names_[i]));
  if (file.contains("server.m.0")) {
    for (size_t i = 0; i < params_.size(); ++i) {
      s.m.push_back(file.read("server.m." + std::to_string(i)));
      s.v.push_back(file.read("server.v." + std::to_string(i)));
    }
  }
  if (!all_finite(s.params) || !all_finite(s.m) || !all_finite(s.v)) throw std::runtime_error("it holds non-finite values");
  restore(s);
  next_round_ = round + 1;
  cumulative_up_ = up;
  cumulative_down_ = down;
  good_val_loss_ = val_loss;
  std::fprintf(stderr, "fl server: resumed from %s after round %llu\n", file.path().c_str(),
               static_cast<unsigned long long>(round));
}

}  // namespace meshtrain::fl
