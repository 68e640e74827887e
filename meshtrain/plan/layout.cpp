#include "meshtrain/plan/layout.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace meshtrain::plan {

Layout Layout::parse(const std::string& text) {
  int64_t micro_batch = 1;
  const parallel::ParallelSpec::OtherKeys mb{
      {"mb"}, [&](const std::string& key, const std::string& value) { micro_batch = parallel::layout_number(key, value); }};
  const parallel::ParallelSpec spec = parallel::ParallelSpec::parse(text, mb);
  return Layout(spec, micro_batch);
}

Precision Precision::parse(const std::string& name) {
  Precision p;
  p.name = name;
  if (name == "fp32") return p;
  if (name == "bf16-mixed") {
    p.param = p.grad = p.activation = p.residual = 2;
    p.optimizer = 12;
    p.mask = 1;
    return p;
  }
  if (name == "bf16-autocast") {
    p.activation = p.weight_copy = 2;
    return p;
  }
  throw std::invalid_argument("precision '" + name + "': use fp32, bf16-mixed or bf16-autocast");
}

std::string Machine::to_json() const {
  nlohmann::json j = {{"name", name},
                      {"peak_flops", peak_flops},
                      {"mfu", mfu},
                      {"intra_bandwidth", intra_bandwidth},
                      {"inter_bandwidth", inter_bandwidth},
                      {"latency", latency},
                      {"host_bandwidth", host_bandwidth},
                      {"devices_per_node", devices_per_node},
                      {"device_memory", device_memory}};
  if (cores_per_node > 0) j["cores_per_node"] = cores_per_node;
  if (sync > 0) j["sync"] = sync;
  if (operators.measured()) {
    const OperatorRates& r = operators;
    j["operators"] = {{"matmul_flops", r.matmul_flops},         {"matmul_call", r.matmul_call},
                      {"attention_flops", r.attention_flops},   {"attention_call", r.attention_call},
                      {"elementwise_bytes", r.elementwise_bytes}, {"elementwise_call", r.elementwise_call},
                      {"overhead", r.overhead},                 {"precision", r.precision}};
  }
  return j.dump(2) + "\n";
}

Machine Machine::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("machine profile is not JSON: ") + e.what());
  }
  Machine m;
  // `o[key]` into `field`; `prefix` names the enclosing object in the message.
  auto read = [](const nlohmann::json& o, const std::string& key, double& field, bool zero_allowed,
                 const std::string& prefix = "") {
    if (!o.contains(key)) return;
    const bool ok = o[key].is_number() && std::isfinite(o[key].get<double>()) &&
                    (o[key].get<double>() > 0 || (zero_allowed && o[key].get<double>() == 0));
    if (!ok) {
      throw std::invalid_argument("machine profile field '" + prefix + key + "' must be a " +
                                  (zero_allowed ? "non-negative" : "positive") + " number");
    }
    field = o[key].get<double>();
  };
  auto number = [&](const char* key, double& field) { read(j, key, field, false); };
  if (j.contains("name") && j["name"].is_string()) m.name = j["name"].get<std::string>();
  number("peak_flops", m.peak_flops);
  number("mfu", m.mfu);
  number("intra_bandwidth", m.intra_bandwidth);
  number("inter_bandwidth", m.inter_bandwidth);
  number("latency", m.latency);
  number("host_bandwidth", m.host_bandwidth);
  number("device_memory", m.device_memory);
  double per_node = static_cast<double>(m.devices_per_node);
  number("devices_per_node", per_node);
  m.devices_per_node = static_cast<int64_t>(per_node);
  double cores = 0;
  number("cores_per_node", cores);
  m.cores_per_node = static_cast<int64_t>(cores);
  number("sync", m.sync);
  if (j.contains("operators")) {  // Note [Operator time]
    const nlohmann::json& o = j["operators"];
    if (!o.is_object()) throw std::invalid_argument("machine profile field 'operators' must be an object");
    OperatorRates& r = m.operators;
    for (const auto& [key, field] : {std::pair<const char*, double*>{"matmul_flops", &r.matmul_flops},
                                     {"attention_flops", &r.attention_flops},
                                     {"elementwise_bytes", &r.elementwise_bytes},
                                     {"overhead", &r.overhead}}) {
      if (!o.contains(key)) throw std::invalid_argument(std::string("machine profile field 'operators.") + key + "' is missing");
      read(o, key, *field, false, "operators.");
    }
    for (const auto& [key, field] : {std::pair<const char*, double*>{"matmul_call", &r.matmul_call},
                                     {"attention_call", &r.attention_call},
                                     {"elementwise_call", &r.elementwise_call}}) {
      read(o, key, *field, true, "operators.");
    }
    if (o.contains("precision")) {
      if (!o["precision"].is_string() || (o["precision"] != "fp32" && o["precision"] != "bf16-mixed")) {
        throw std::invalid_argument("machine profile field 'operators.precision' must be \"fp32\" or \"bf16-mixed\"");
      }
      r.precision = o["precision"].get<std::string>();
    }
  }
  if (m.mfu > 1) throw std::invalid_argument("machine profile field 'mfu' must be at most 1");
  return m;
}

double parse_bytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::vector<std::pair<std::string, double>> units = {
      {"", 1},          {"b", 1},          {"k", 1024.0},     {"m", 1048576.0},   {"g", 1073741824.0}, {"kib", 1024.0},   {"mib", 1048576.0}, {"gib", 1073741824.0},
      {"tib", 1099511627776.0}, {"kb", 1e3}, {"mb", 1e6},      {"gb", 1e9},        {"tb", 1e12}};
  if (used == 0 || !(value > 0)) throw std::invalid_argument("size '" + text + "': expected a positive number with a unit, e.g. 80GiB");
  for (const auto& [name, scale] : units) {
    if (unit == name) return value * scale;
  }
  throw std::invalid_argument("size '" + text + "': unknown unit '" + unit + "'; use B, KiB, MiB, GiB, TiB (or K, M, G: binary; KB, MB, GB, TB: decimal)");
}

std::string format_bytes(double bytes) {
  char text[32];
  const double gib = bytes / 1073741824.0;
  if (std::abs(gib) >= 1) std::snprintf(text, sizeof text, "%.1f GiB", gib);
  else std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

}  // namespace meshtrain::plan
