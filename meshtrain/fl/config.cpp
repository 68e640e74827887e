#include "meshtrain/fl/config.h"

#include "meshtrain/model/config_json.h"
#include "meshtrain/util/suggest.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>

namespace meshtrain::fl {
namespace {

struct Key {
  std::string help;
  std::function<void(FlConfig&, const toml::node&)> set;
};

template <typename T>
T as(const toml::node& node, const std::string& key) {
  if constexpr (std::is_same_v<T, bool>) {
    if (auto v = node.value<bool>()) return *v;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (auto v = node.value<std::string>()) return *v;
  } else if constexpr (std::is_floating_point_v<T>) {
    if (auto v = node.value<double>()) return static_cast<T>(*v);
  } else {
    if (auto v = node.value<int64_t>()) return static_cast<T>(*v);
  }
  const char* wanted = std::is_same_v<T, bool> ? "true or false" : std::is_same_v<T, std::string> ? "a string" :
                       std::is_floating_point_v<T> ? "a number" : "an integer";
  (void)node;
  throw FlConfigError(key + ": wrong type, expected " + std::string(wanted));
}

std::vector<std::string> as_strings(const toml::node& node, const std::string& key) {
  std::vector<std::string> out;
  if (const auto* array = node.as_array()) {
    for (const auto& item : *array) out.push_back(as<std::string>(item, key));
    return out;
  }
  std::string text = as<std::string>(node, key);
  std::istringstream in(text);
  for (std::string s; std::getline(in, s, ',');) if (!s.empty()) out.push_back(s);
  return out;
}

#define FL_KEY(name, help, member, type) \
  { name, Key{help, [](FlConfig& c, const toml::node& n) { c.member = as<type>(n, name); }} }

const std::map<std::string, Key>& keys() {
  static const std::map<std::string, Key> k = {
      FL_KEY("fl.rounds", "rounds to run", rounds, int64_t),
      FL_KEY("fl.fraction", "fraction of the available clients sampled per round", fraction, double),
      FL_KEY("fl.min_available", "clients that must be connected before a round starts", min_available, int64_t),
      FL_KEY("fl.min_fit", "results a round needs to count (else it is discarded)", min_fit, int64_t),
      FL_KEY("fl.deadline_s", "seconds per round phase; later results are dropped as stragglers", deadline_s, double),
      FL_KEY("fl.wait_clients_s", "seconds a round waits for min_available clients", wait_clients_s, double),
      FL_KEY("fl.seed", "sampling, structures and sketches", seed, uint64_t),
      FL_KEY("fl.label", "name of this configuration in metrics and plots", label, std::string),
      FL_KEY("fl.strategy", "fedavg | fedprox | fedadam | fedyogi", strategy.name, std::string),
      FL_KEY("fl.server_lr", "server step size (FedAvg: 1 takes the mean update as is)", strategy.server_lr, double),
      FL_KEY("fl.beta1", "FedAdam/FedYogi first moment decay", strategy.beta1, double),
      FL_KEY("fl.beta2", "FedAdam/FedYogi second moment decay", strategy.beta2, double),
      FL_KEY("fl.tau", "FedAdam/FedYogi adaptivity", strategy.tau, double),
      FL_KEY("fl.prox_mu", "FedProx proximal weight mu (clients add mu/2·|w - w_global|²)", strategy.prox_mu, double),
      FL_KEY("fl.aggregation", "mean (FedAvg's, by examples) | median | trimmed_mean | krum | multi_krum: how the round's "
             "updates combine; all but mean withstand some hostile clients and need every update (no secagg)",
             aggregation.name, std::string),
      FL_KEY("fl.trim_fraction", "trimmed_mean: the share of values dropped at each end, per coordinate", aggregation.trim_fraction,
             double),
      FL_KEY("fl.byzantine", "krum, multi_krum: f, the hostile clients tolerated (a round needs 2f + 3 updates)",
             aggregation.byzantine, int64_t),
      FL_KEY("fl.krum_keep", "multi_krum: the best-scored updates averaged (0: n - f)", aggregation.keep, int64_t),
      {"fl.clip_norm", Key{"the bound on each client's update, a global L2 norm: \"auto\" (the default: fl.clip_factor "
                           "times the round's median norm), a number (fixed; clients clip too), or 0 (none)",
                           [](FlConfig& c, const toml::node& n) {
                             if (n.is_string() && *n.value<std::string>() == "auto") {
                               c.clip_auto = true;
                               return;
                             }
                             if (n.is_string()) throw FlConfigError("fl.clip_norm: a number >= 0, or \"auto\"");
                             c.clip_auto = false;
                             c.clip_norm = as<double>(n, "fl.clip_norm");
                           }}},
      FL_KEY("fl.clip_factor", "fl.clip_norm = \"auto\": the bound as a multiple of the round's median update norm",
             clip_factor, double),
      FL_KEY("fl.max_message_mb", "a client message larger than this is refused before it is read (0: a full update "
             "plus a quarter and 4 MiB)", max_message_mb, double),
      FL_KEY("fl.max_examples_per_client", "a client's FedAvg weight is at most this (0: the training sequences it "
             "declared at Join, which cannot grow within its session)", max_examples_per_client, int64_t),
      FL_KEY("fl.max_regression", "a round that raises the validation loss by more than this (or makes it or the "
             "model non-finite) is rolled back", max_regression, double),
      FL_KEY("fl.keep_states", "the last good server states kept in out/states/", keep_states, int64_t),
      FL_KEY("fl.dp.noise_multiplier", "DP-FedAvg: Gaussian noise of std z·clip_norm on the sum of clipped updates (0: "
             "off; needs a fixed fl.clip_norm)", noise_multiplier, double),
      FL_KEY("fl.dp.delta", "DP-FedAvg: the delta of the (epsilon, delta) the accountant reports", dp_delta, double),
      FL_KEY("fl.client.local_steps", "local steps per round", local_steps, int64_t),
      FL_KEY("fl.client.batch", "sequences per local step", batch, int64_t),
      FL_KEY("fl.client.lr", "client learning rate", lr, double),
      FL_KEY("fl.client.optimizer", "sgd | adamw (fresh each round, no decay)", optimizer, std::string),
      FL_KEY("fl.compression.structure", "none | low_rank | mask", compression.structure, std::string),
      FL_KEY("fl.compression.rank", "low_rank: k", compression.rank, int64_t),
      FL_KEY("fl.compression.mask_fraction", "mask: probability an entry is trained", compression.mask_fraction, double),
      FL_KEY("fl.compression.rotate", "random Walsh-Hadamard rotation before the sketch", compression.rotate, bool),
      FL_KEY("fl.compression.keep", "random subsampling: probability an entry is sent", compression.keep, double),
      FL_KEY("fl.compression.bits", "0: float32; 1..16: unbiased quantisation", compression.bits, int64_t),
      FL_KEY("fl.secagg.enabled", "secure aggregation (the server learns only the sum)", secagg, bool),
      FL_KEY("fl.secagg.threshold", "t: clients needed to unmask", threshold, int64_t),
      FL_KEY("fl.secagg.clip", "updates are clipped to [-clip, clip]", clip, double),
      FL_KEY("fl.secagg.bits", "quantisation bits in the ring Z_2^32", secagg_bits, int64_t),
      FL_KEY("fl.data.val_file", "validation token file (fl split's val.bin)", val_file, std::string),
      FL_KEY("fl.data.clients_dir", "fl simulate: a directory of client directories with train.bin", clients_dir,
             std::string),
      FL_KEY("fl.data.eval_batches", "validation batches per round", eval_batches, int64_t),
      FL_KEY("fl.server.listen", "host:port (port 0: any free one)", listen, std::string),
      FL_KEY("fl.server.out", "metrics.jsonl, state.safetensors, loss.svg", out, std::string),
      FL_KEY("fl.server.resume", "continue from out/state.safetensors when present", resume, bool),
      FL_KEY("fl.server.cert", "server certificate (PEM)", tls.cert, std::string),
      FL_KEY("fl.server.key", "server private key (PEM)", tls.key, std::string),
      FL_KEY("fl.server.client_ca", "mutual TLS: CA that signs client certificates", tls.ca, std::string),
      FL_KEY("fl.server.mutual_tls", "require client certificates", tls.mutual, bool),
      {"fl.server.allow", Key{"mutual TLS: admitted client common names (empty: any signed by client_ca)",
                              [](FlConfig& c, const toml::node& n) { c.tls.allow = as_strings(n, "fl.server.allow"); }}},
      FL_KEY("fl.server.insecure", "plaintext (only on a loopback address)", tls.insecure, bool),
  };
  return k;
}

void apply_model(FlConfig& c, const toml::table& model) {
  if (auto p = model["preset"]) c.preset = as<std::string>(*p.node(), "model.preset");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(model::to_json(model::GptConfig::preset(c.preset)));
  } catch (const std::exception& e) {
    throw FlConfigError(std::string("model.preset: ") + e.what());
  }
  for (const auto& [k, node] : model) {
    const std::string key(k.str());
    if (key == "preset") continue;
    if (!j.contains(key) || j[key].is_object()) throw FlConfigError("model." + key + ": not a model key of federated runs");
    if (j[key].is_boolean()) j[key] = as<bool>(node, "model." + key);
    else if (j[key].is_string()) j[key] = as<std::string>(node, "model." + key);
    else if (j[key].is_number_integer()) j[key] = as<int64_t>(node, "model." + key);
    else j[key] = as<double>(node, "model." + key);
  }
  c.model = model::config_from_json(j.dump());
}

void apply_table(FlConfig& c, const toml::table& table, const std::string& prefix) {
  for (const auto& [k, node] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (key == "model") {
      if (!node.is_table()) throw FlConfigError("[model] must be a table");
      continue;
    }
    if (node.is_table()) {
      apply_table(c, *node.as_table(), key);
      continue;
    }
    auto found = keys().find(key);
    if (found == keys().end()) {
      std::vector<std::string> known;
      for (const auto& entry : keys()) known.push_back(entry.first);
      throw FlConfigError(key + ": unknown key" + util::did_you_mean(key, known) +
                          "; meshtrain fl server --help-config lists them");
    }
    found->second.set(c, node);
  }
}

}  // namespace

std::map<std::string, std::string> FlConfig::result_settings() const {
  auto number = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  return {{"fl.strategy", strategy.name},
          {"fl.server_lr", number(strategy.server_lr)},
          {"fl.prox_mu", number(strategy.prox_mu)},
          {"fl.aggregation", aggregation.name},
          {"fl.trim_fraction", number(aggregation.trim_fraction)},
          {"fl.byzantine", std::to_string(aggregation.byzantine)},
          {"fl.krum_keep", std::to_string(aggregation.keep)},
          {"fl.fraction", number(fraction)},
          {"fl.seed", std::to_string(seed)},
          {"fl.dp.noise_multiplier", number(noise_multiplier)},
          {"fl.client.local_steps", std::to_string(local_steps)},
          {"fl.client.batch", std::to_string(batch)},
          {"fl.client.lr", number(lr)},
          {"fl.client.optimizer", optimizer},
          {"fl.compression", compression.describe()},
          {"fl.secagg.enabled", secagg ? "true" : "false"}};
}

bool is_loopback_address(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  const std::string host = colon == std::string::npos ? host_port : host_port.substr(0, colon);
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

FlConfig FlConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    if (!path.empty()) root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    throw FlConfigError(path + ":" + where.str() + ": " + std::string(e.description()));
  }
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos) throw FlConfigError("override '" + o + "': write section.key=value, e.g. fl.rounds=3");
    const std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    toml::table parsed;
    try {
      parsed = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      parsed = toml::parse("v = \"" + value + "\"");
    }
    // Walk/create the tables of key's path, then set the leaf.
    toml::table* t = &root;
    size_t start = 0;
    for (size_t dot; (dot = key.find('.', start)) != std::string::npos; start = dot + 1) {
      const std::string part = key.substr(start, dot - start);
      if (!(*t)[part]) t->insert(part, toml::table{});
      t = (*t)[part].as_table();
      if (!t) throw FlConfigError("override '" + o + "': " + part + " is not a section");
    }
    t->insert_or_assign(key.substr(start), *parsed["v"].node());
  }
  FlConfig c;
  if (const auto* model = root["model"].as_table()) apply_model(c, *model);
  apply_table(c, root, "");
  c.validate();
  return c;
}

void FlConfig::validate() const {
  try {
    model.validate();
  } catch (const std::exception& e) {
    throw FlConfigError(std::string("[model] ") + e.what());
  }
  auto fail = [](const std::string& m) { throw FlConfigError(m); };
  if (rounds < 1) fail("fl.rounds = " + std::to_string(rounds) + ": must be at least 1");
  if (!(fraction > 0 && fraction <= 1)) fail("fl.fraction must be in (0, 1]");
  if (min_fit < 1 || min_available < min_fit) fail("fl.min_fit must be >= 1 and <= fl.min_available");
  if (!(deadline_s > 0) || !(wait_clients_s > 0)) fail("fl.deadline_s and fl.wait_clients_s must be positive");
  if (local_steps < 1 || batch < 1) fail("fl.client.local_steps and fl.client.batch must be >= 1");
  if (!(lr > 0)) fail("fl.client.lr must be positive");
  if (!(clip_norm >= 0)) fail("fl.clip_norm must be >= 0 (0: none), or \"auto\"");
  if (!(clip_factor > 0)) fail("fl.clip_factor must be positive");
  if (!(max_message_mb >= 0)) fail("fl.max_message_mb must be >= 0 (0: from the model)");
  if (max_examples_per_client < 0) fail("fl.max_examples_per_client must be >= 0 (0: what each client declared)");
  if (!(max_regression > 0)) fail("fl.max_regression must be positive");
  if (keep_states < 1) fail("fl.keep_states must be at least 1");
  if (!(noise_multiplier >= 0)) fail("fl.dp.noise_multiplier must be >= 0 (0: off)");
  if (!(dp_delta > 0 && dp_delta < 1)) fail("fl.dp.delta must be in (0, 1)");
  if (dp()) {
    if (clip_auto || clip_norm <= 0)
      fail("fl.dp.noise_multiplier: DP-FedAvg needs a fixed fl.clip_norm (the sensitivity), not \"auto\" or 0");
    if (aggregation.name != "mean")
      fail("fl.dp.noise_multiplier: DP-FedAvg adds its noise to the mean; fl.aggregation = \"" + aggregation.name +
           "\" is not covered by its guarantee");
  }
  if (optimizer != "sgd" && optimizer != "adamw") fail("fl.client.optimizer = \"" + optimizer + "\": use sgd or adamw");
  try {
    strategy.validate();
    aggregation.validate();
    compression.validate();
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  if (secagg) {
    if (aggregation.name != "mean") {
      fail("fl.aggregation = \"" + aggregation.name + "\" reads every client's update, and under secure aggregation "
           "the server sees only their sum: use fl.aggregation = \"mean\" with fl.secagg, or turn fl.secagg off");
    }
    if (threshold < 2) fail("fl.secagg.threshold must be at least 2");
    if (threshold > min_fit) fail("fl.secagg.threshold must not exceed fl.min_fit (a round below t cannot unmask)");
    if (secagg_bits < 1 || secagg_bits > 24) fail("fl.secagg.bits must be in 1..24 (the sum lives in Z_2^32)");
    if (!(clip > 0)) fail("fl.secagg.clip must be positive");
    if (compression.bits > 0) fail("fl.compression.bits: under secure aggregation, quantisation is fl.secagg.bits");
    // Distributed DP: a client's share of the noise must survive the ring's clip, or the sum holds less than z·S.
    const double share = noise_multiplier * clip_norm / std::sqrt(static_cast<double>(min_fit));
    if (dp() && clip < clip_norm + 4 * share) {
      fail("fl.secagg.clip = " + std::to_string(clip) + " would clip the clients' noise (std up to " +
           std::to_string(share) + " each): set it to at least fl.clip_norm + 4 x that, " +
           std::to_string(clip_norm + 4 * share));
    }
  }
  if (eval_batches < 1) fail("fl.data.eval_batches must be >= 1");
  if (tls.insecure && !is_loopback_address(listen))
    fail("fl.server.insecure: plaintext is only allowed on a loopback address, not " + listen);
  if (!tls.insecure && (tls.cert.empty() || tls.key.empty()))
    fail("fl.server: set cert and key (PEM files) for TLS, or insecure = true on a loopback address");
  if (tls.mutual && tls.ca.empty()) fail("fl.server.mutual_tls needs client_ca");
}

int64_t FlConfig::max_message_bytes() const {
  constexpr int64_t kMiB = 1 << 20, kGrpcLimit = (int64_t{1} << 31) - 1;
  if (max_message_mb > 0) return std::min<int64_t>(kGrpcLimit, static_cast<int64_t>(max_message_mb * kMiB));
  const int64_t update = 4 * model.parameter_count();
  return std::min<int64_t>(kGrpcLimit, update + update / 4 + 4 * kMiB);
}

std::string FlConfig::describe_keys() {
  std::ostringstream out;
  out << "[model] preset and keys as for meshtrain train (default preset: tiny)\n";
  for (const auto& [name, key] : keys()) out << "  " << name << "  " << key.help << "\n";
  return out.str();
}

}  // namespace meshtrain::fl
