#include "meshtrain/fl/config.h"

#include "meshtrain/model/gpt_config_keys.h"
#include "meshtrain/util/config_toml.h"
#include "meshtrain/util/suggest.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>

namespace meshtrain::fl {
namespace {

using config::Kind;
using config::Value;
using FlKey = config::Key<FlConfig>;

template <typename Access>
FlKey key(std::string section, std::string name, std::string help, Access access) {
  return config::key<FlConfig>(std::move(section), std::move(name), std::move(help), access);
}

#define MEMBER(expression) [](FlConfig& c) -> auto& { return c.expression; }

// Every [fl...] key, in the order --help-config lists them (Note [Config keys]).
const std::vector<FlKey>& keys() {
  static const std::vector<FlKey> k = {
      key("fl", "rounds", "rounds to run", MEMBER(rounds)),
      key("fl", "fraction", "fraction of the available clients sampled per round", MEMBER(fraction)),
      key("fl", "clients_per_round", "results a round waits for, its target (0: fl.fraction of the connected clients, "
             "at least min_fit); the round closes when they are in", MEMBER(clients_per_round)),
      key("fl", "over_select", "sample this share more clients than the target, so that dropouts still leave it "
             "(0.3: 30% more); the round closes at the target, the others' results refused", MEMBER(over_select)),
      key("fl", "mode", "sync: rounds that wait for their clients | async: buffered asynchronous aggregation (FedBuff), "
             "the model updated every fl.async.buffer results, each weighted by its staleness", MEMBER(mode)),
      key("fl", "min_available", "clients that must be connected before a round starts", MEMBER(min_available)),
      key("fl", "min_fit", "results a round needs to count (else it is discarded)", MEMBER(min_fit)),
      key("fl", "deadline_s", "seconds per round phase; later results are dropped as stragglers", MEMBER(deadline_s)),
      key("fl", "wait_clients_s", "seconds a round waits for min_available clients", MEMBER(wait_clients_s)),
      key("fl", "seed", "sampling, structures and sketches", MEMBER(seed)),
      key("fl", "label", "name of this configuration in metrics and plots", MEMBER(label)),
      key("fl", "strategy", "fedavg | fedprox | fedadam | fedyogi", MEMBER(strategy.name)),
      key("fl", "server_lr", "server step size (FedAvg: 1 takes the mean update as is)", MEMBER(strategy.server_lr)),
      key("fl", "beta1", "FedAdam/FedYogi first moment decay", MEMBER(strategy.beta1)),
      key("fl", "beta2", "FedAdam/FedYogi second moment decay", MEMBER(strategy.beta2)),
      key("fl", "tau", "FedAdam/FedYogi adaptivity", MEMBER(strategy.tau)),
      key("fl", "prox_mu", "FedProx proximal weight mu (clients add mu/2·|w - w_global|²)", MEMBER(strategy.prox_mu)),
      key("fl", "aggregation", "mean (FedAvg's, by examples) | median | trimmed_mean | krum | multi_krum: how the round's "
             "updates combine; all but mean withstand some hostile clients and need every update (no secagg)", MEMBER(aggregation.name)),
      key("fl", "trim_fraction", "trimmed_mean: the share of values dropped at each end, per coordinate", MEMBER(aggregation.trim_fraction)),
      key("fl", "byzantine", "krum, multi_krum: f, the hostile clients tolerated (a round needs 2f + 3 updates)", MEMBER(aggregation.byzantine)),
      key("fl", "krum_keep", "multi_krum: the best-scored updates averaged (0: n - f)", MEMBER(aggregation.keep)),
      FlKey{"fl", "clip_norm", Kind::kNumberOrString,
            "the bound on each client's update, a global L2 norm: \"auto\" (fl.clip_factor times the round's median "
            "norm), a number (fixed; clients clip too), or 0 (none)",
            [](FlConfig& c, const Value& v) {
              if (!v.s.empty() && v.s != "auto") config::refuse("fl.clip_norm", config::quoted(v.s), "a number >= 0, or \"auto\"");
              c.clip_auto = v.s == "auto";
              if (!c.clip_auto) c.clip_norm = v.f;
            },
            [](const FlConfig& c) { return c.clip_auto ? std::string("\"auto\"") : config::FieldType<double>::show(c.clip_norm); }},
      key("fl", "clip_factor", "fl.clip_norm = \"auto\": the bound as a multiple of the round's median update norm", MEMBER(clip_factor)),
      key("fl", "max_message_mb", "a client's result larger than this is refused at the chunk that passes it (0: a "
             "full update plus a quarter and 4 MiB)", MEMBER(max_message_mb)),
      key("fl", "max_examples_per_client", "a client's FedAvg weight is at most this (0: the training sequences it "
             "declared at Join, which cannot grow within its session)", MEMBER(max_examples_per_client)),
      key("fl", "max_regression", "a round that raises the validation loss by more than this (or makes it or the "
             "model non-finite) is rolled back", MEMBER(max_regression)),
      key("fl", "keep_states", "the last good server states kept in out/states/", MEMBER(keep_states)),
      key("fl.async", "buffer", "K: the results that make one aggregation (a new model version)", MEMBER(async_buffer)),
      key("fl.async", "concurrency", "clients training at once (0: every connected client)", MEMBER(async_concurrency)),
      key("fl.async", "max_staleness", "a result trained from a model this many versions old still counts; "
             "older ones are refused", MEMBER(max_staleness)),
      key("fl.async", "staleness_exponent", "a result s versions old is scaled by (1 + s)^-exponent (0: not at all)",
          MEMBER(staleness_exponent)),
      key("fl.dp", "noise_multiplier", "DP-FedAvg: Gaussian noise of std z·clip_norm on the sum of clipped updates (0: "
             "off; needs a fixed fl.clip_norm)", MEMBER(noise_multiplier)),
      key("fl.dp", "delta", "DP-FedAvg: the delta of the (epsilon, delta) the accountant reports", MEMBER(dp_delta)),
      key("fl.client", "local_steps", "local steps per round", MEMBER(local_steps)),
      key("fl.client", "batch", "sequences per local step", MEMBER(batch)),
      key("fl.client", "lr", "client learning rate", MEMBER(lr)),
      key("fl.client", "optimizer", "sgd | adamw (fresh each round, no decay)", MEMBER(optimizer)),
      key("fl.compression", "structure", "none | low_rank | mask", MEMBER(compression.structure)),
      key("fl.compression", "rank", "low_rank: k", MEMBER(compression.rank)),
      key("fl.compression", "mask_fraction", "mask: probability an entry is trained", MEMBER(compression.mask_fraction)),
      key("fl.compression", "rotate", "random Walsh-Hadamard rotation before the sketch", MEMBER(compression.rotate)),
      key("fl.compression", "keep", "random subsampling: probability an entry is sent", MEMBER(compression.keep)),
      key("fl.compression", "bits", "0: float32; 1..16: unbiased quantisation", MEMBER(compression.bits)),
      key("fl.secagg", "enabled", "secure aggregation (the server learns only the sum)", MEMBER(secagg)),
      key("fl.secagg", "threshold", "t: clients needed to unmask", MEMBER(threshold)),
      key("fl.secagg", "clip", "updates are clipped to [-clip, clip]", MEMBER(clip)),
      key("fl.secagg", "bits", "quantisation bits in the ring Z_2^32", MEMBER(secagg_bits)),
      key("fl.data", "val_file", "validation token file (fl split's val.bin)", MEMBER(val_file)),
      key("fl.data", "clients_dir", "fl simulate: a directory of client directories with train.bin", MEMBER(clients_dir)),
      key("fl.data", "eval_batches", "validation batches per round", MEMBER(eval_batches)),
      key("fl.server", "listen", "host:port (port 0: any free one)", MEMBER(listen)),
      key("fl.server", "out", "metrics.jsonl, state.safetensors, loss.svg", MEMBER(out)),
      key("fl.server", "resume", "continue from out/state.safetensors when present", MEMBER(resume)),
      key("fl.server", "cert", "server certificate (PEM)", MEMBER(tls.cert)),
      key("fl.server", "key", "server private key (PEM)", MEMBER(tls.key)),
      key("fl.server", "client_ca", "mutual TLS: CA that signs client certificates", MEMBER(tls.ca)),
      key("fl.server", "mutual_tls", "require client certificates", MEMBER(tls.mutual)),
      FlKey{"fl.server", "allow", Kind::kStringList,
            "mutual TLS: admitted client common names (a list, or one string of them separated by commas; empty: any "
            "signed by client_ca)",
            [](FlConfig& c, const Value& v) {
              c.tls.allow.clear();
              for (const std::string& item : v.list) {
                std::istringstream in(item);
                for (std::string name; std::getline(in, name, ',');) if (!name.empty()) c.tls.allow.push_back(name);
              }
            },
            [](const FlConfig& c) { return config::FieldType<std::vector<std::string>>::show(c.tls.allow); }},
      key("fl.server", "join_token_file", "without mutual TLS: a Join must quote the secret in this file (clients: "
             "--join-token-file)", MEMBER(join_token_file)),
      key("fl.server", "joins_per_minute", "Joins one source address may make a minute (0: no limit)",
          MEMBER(joins_per_minute)),
      key("fl.server", "ids_per_address", "live client ids from one source address (0: no limit)", MEMBER(ids_per_address)),
      key("fl.server", "insecure", "plaintext (only on a loopback address)", MEMBER(tls.insecure)),
      key("fl.server", "grpc_memory_mb", "the memory gRPC may hold for all connections; a message that would pass it "
             "(one larger than a chunk, sent whole) is cut off", MEMBER(grpc_memory_mb)),
  };
  return k;
}

#undef MEMBER

const FlKey& find_key(const std::string& name, const std::string& where) {
  for (const FlKey& k : keys()) {
    if (k.full_name() == name) return k;
  }
  std::vector<std::string> known;
  for (const FlKey& k : keys()) known.push_back(k.full_name());
  throw FlConfigError(where + name + ": unknown key" + util::did_you_mean(name, known) +
                      "; meshtrain fl server --help-config lists them");
}

void set(FlConfig& c, const FlKey& k, const toml::node& node, const std::string& where) {
  try {
    k.set(c, config::read_value(k.full_name(), k.kind, node, where));
  } catch (const FlConfigError&) {
    throw;
  } catch (const std::invalid_argument& e) {
    throw FlConfigError(e.what());
  }
}

// [model]: a preset, then the model's keys (Note [Model keys]) over it.
void apply_model(FlConfig& c, const toml::table& model) {
  if (auto p = model["preset"]) {
    try {
      c.preset = config::read_value("model.preset", Kind::kString, *p.node(), "config").s;
    } catch (const std::invalid_argument& e) {
      throw FlConfigError(e.what());
    }
  }
  try {
    c.model = model::GptConfig::preset(c.preset);
  } catch (const std::exception& e) {
    throw FlConfigError(std::string("model.preset: ") + e.what());
  }
  for (const auto& [k, node] : model) {
    const std::string key(k.str());
    if (key == "preset") continue;
    const model::ModelKey* found = model::find_model_key(key);
    if (!found) {
      std::vector<std::string> known;
      for (const model::ModelKey& m : model::model_keys()) known.push_back(m.key.name);
      throw FlConfigError("model." + key + ": not a model key" + util::did_you_mean(key, known) +
                          "; meshtrain train --help lists them under [model]");
    }
    try {
      found->key.set(c.model, config::read_value("model." + key, found->key.kind, node, "config"));
    } catch (const std::invalid_argument& e) {
      throw FlConfigError(e.what());
    }
  }
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
    set(c, find_key(key, ""), node, "config");
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
          {"fl.clients_per_round", std::to_string(clients_per_round)},
          {"fl.over_select", number(over_select)},
          {"fl.seed", std::to_string(seed)},
          {"fl.mode", mode},
          {"fl.async.buffer", std::to_string(async_buffer)},
          {"fl.async.concurrency", std::to_string(async_concurrency)},
          {"fl.async.max_staleness", std::to_string(max_staleness)},
          {"fl.async.staleness_exponent", number(staleness_exponent)},
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
  // [model] overrides join the file's [model] table (the preset first); [fl...] ones are set after the file's.
  std::vector<std::pair<const FlKey*, std::string>> fl_overrides;
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos) throw FlConfigError("override '" + o + "': write section.key=value, e.g. fl.rounds=3");
    const std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    if (key.rfind("model.", 0) != 0) {
      fl_overrides.emplace_back(&find_key(key, "override --"), value);
      continue;
    }
    toml::table parsed;
    try {
      parsed = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      parsed = toml::parse("v = \"" + value + "\"");
    }
    if (!root["model"]) root.insert("model", toml::table{});
    toml::table* model = root["model"].as_table();
    if (!model) throw FlConfigError("override '" + o + "': model is not a section");
    model->insert_or_assign(key.substr(6), *parsed["v"].node());
  }
  FlConfig c;
  if (const auto* model = root["model"].as_table()) apply_model(c, *model);
  apply_table(c, root, "");
  for (const auto& [k, raw] : fl_overrides) {
    const std::string where = "override --" + k->full_name() + "=" + raw;
    try {
      set(c, *k, *config::override_value(k->full_name(), k->kind, raw, where).get("v"), where);
    } catch (const config::ConfigError& e) {
      throw FlConfigError(e.what());
    }
  }
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
  if (min_fit < 1 || min_available < min_fit)
    fail("fl.min_fit = " + std::to_string(min_fit) + ": must be >= 1 and <= fl.min_available = " +
         std::to_string(min_available) + (min_fit > min_available ? "; raise fl.min_available to " +
                                          std::to_string(min_fit) : ""));
  if (clients_per_round < 0 || (clients_per_round > 0 && clients_per_round < min_fit))
    fail("fl.clients_per_round = " + std::to_string(clients_per_round) + ": 0 (from fl.fraction), or at least "
         "fl.min_fit = " + std::to_string(min_fit));
  if (!(over_select >= 0)) fail("fl.over_select must be >= 0 (0.3: sample 30% more clients than the target)");
  if (!(deadline_s > 0) || !(wait_clients_s > 0)) fail("fl.deadline_s and fl.wait_clients_s must be positive");
  if (local_steps < 1 || batch < 1) fail("fl.client.local_steps and fl.client.batch must be >= 1");
  if (!(lr > 0)) fail("fl.client.lr must be positive");
  if (!(clip_norm >= 0)) fail("fl.clip_norm must be >= 0 (0: none), or \"auto\"");
  if (!(clip_factor > 0)) fail("fl.clip_factor must be positive");
  if (!(max_message_mb >= 0)) fail("fl.max_message_mb must be >= 0 (0: from the model)");
  if (!(grpc_memory_mb >= 16)) fail("fl.server.grpc_memory_mb must be at least 16 (gRPC's buffers for every connection)");
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
    if (over_select > 0)
      fail("fl.over_select with fl.dp.noise_multiplier: the accountant counts every sampled client as taking part, "
           "and a round that closes at a target of them is not what it accounts for; set fl.over_select = 0");
  }
  if (mode != "sync" && mode != "async") fail("fl.mode = \"" + mode + "\": use sync or async");
  if (async()) validate_async();
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
    if (over_select > 0) fail("fl.over_select with fl.secagg: not supported (secure rounds wait for every sampled client)");
    if (threshold > min_fit)
      fail("fl.secagg.threshold = " + std::to_string(threshold) + " must not exceed fl.min_fit = " +
           std::to_string(min_fit) + " (a round below t cannot unmask); set fl.min_fit = " + std::to_string(threshold) +
           (threshold > min_available ? " and fl.min_available = " + std::to_string(threshold) : ""));
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
  if (!(joins_per_minute == 0 || joins_per_minute >= 1)) fail("fl.server.joins_per_minute must be 0 (no limit) or >= 1");
  if (ids_per_address < 0) fail("fl.server.ids_per_address must be >= 0 (0: no limit)");
}

// Note [Buffered asynchronous rounds]: what an async federation cannot combine with.
void FlConfig::validate_async() const {
  auto fail = [](const std::string& m) { throw FlConfigError(m); };
  if (async_buffer < 1) fail("fl.async.buffer must be at least 1");
  if (async_concurrency < 0) fail("fl.async.concurrency must be >= 0 (0: every connected client)");
  if (async_concurrency > 0 && async_concurrency < async_buffer)
    fail("fl.async.concurrency = " + std::to_string(async_concurrency) + " is below fl.async.buffer = " +
         std::to_string(async_buffer) + ": an aggregation could never fill");
  if (max_staleness < 0) fail("fl.async.max_staleness must be >= 0");
  if (!(staleness_exponent >= 0)) fail("fl.async.staleness_exponent must be >= 0");
  if (min_fit > async_buffer) fail("fl.min_fit must not exceed fl.async.buffer under fl.mode = \"async\"");
  if (dp())
    fail("fl.dp.noise_multiplier with fl.mode = \"async\": the accountant's analysis is of rounds that sample "
         "clients independently, and a buffer fills with whoever finishes first, stale updates included; it cannot "
         "account for that. Use fl.mode = \"sync\" for DP-FedAvg");
  if (secagg)
    fail("fl.secagg with fl.mode = \"async\": secure aggregation masks one round's clients against each other, "
         "and a buffer's results come from different model versions; use fl.mode = \"sync\"");
  if (clients_per_round > 0 || over_select > 0)
    fail("fl.clients_per_round and fl.over_select choose a synchronous round's clients; under fl.mode = \"async\" "
         "set fl.async.concurrency (clients training at once) and fl.async.buffer instead");
}

int64_t FlConfig::max_message_bytes() const {
  constexpr int64_t kMiB = 1 << 20, kGrpcLimit = (int64_t{1} << 31) - 1;
  if (max_message_mb > 0) return std::min<int64_t>(kGrpcLimit, static_cast<int64_t>(max_message_mb * kMiB));
  const int64_t update = 4 * model.parameter_count();
  return std::min<int64_t>(kGrpcLimit, update + update / 4 + 4 * kMiB);
}

std::string FlConfig::describe_keys() {
  const FlConfig defaults;
  return "[model] preset and keys as for meshtrain train (default preset: tiny)\n" + config::describe(keys(), defaults);
}

}  // namespace meshtrain::fl
