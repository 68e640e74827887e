#include "meshtrain/plan/layout.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace meshtrain::plan {

namespace {

int64_t positive(const std::string& key, const std::string& value) {
  size_t used = 0;
  int64_t n = 0;
  try {
    n = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || n < 1) {
    throw std::invalid_argument("layout " + key + "=" + value + ": needs a whole number >= 1");
  }
  return n;
}

std::string one_of(const std::string& key, const std::string& value, const std::vector<std::string>& allowed) {
  std::string list;
  for (const auto& a : allowed) {
    if (a == value) return value;
    list += (list.empty() ? "" : ", ") + a;
  }
  throw std::invalid_argument("layout " + key + "=" + value + ": use one of " + list);
}

}  // namespace

mesh::ParallelDims Layout::dims() const {
  mesh::ParallelDims d;
  d.pp = pp;
  d.dp = dp;
  d.fsdp = fsdp;
  d.ep = ep;
  d.tp = tp;
  d.sequence_parallel = sp;
  d.zero_stage = zero_stage;
  d.schedule = schedule;
  d.virtual_stages = virtual_stages;
  return d;
}

Layout Layout::from_dims(const mesh::ParallelDims& d, int64_t micro_batch) {
  Layout l;
  l.pp = d.pp;
  l.dp = d.dp;
  l.fsdp = d.fsdp;
  l.ep = d.ep;
  l.tp = d.tp;
  l.sp = d.sequence_parallel;
  l.zero_stage = d.zero_stage;
  l.schedule = d.schedule;
  l.virtual_stages = d.virtual_stages;
  l.micro_batch = micro_batch;
  return l;
}

std::string Layout::str() const {
  std::string text;
  auto add = [&](const std::string& part) { text += (text.empty() ? "" : " ") + part; };
  if (pp > 1) {
    add("pp=" + std::to_string(pp) + " " + schedule);
    if (virtual_stages > 1) add("v=" + std::to_string(virtual_stages));
  }
  if (tp > 1) add("tp=" + std::to_string(tp) + (sp ? " sp" : ""));
  if (dp > 1 || (fsdp == 1 && pp == 1 && tp == 1 && ep == 1)) add("dp=" + std::to_string(dp));
  if (ep > 1) add("ep=" + std::to_string(ep));
  if (zero_stage > 0) add("zero=" + std::to_string(zero_stage));
  if (fsdp > 1) add("fsdp=" + std::to_string(fsdp));
  add("mb=" + std::to_string(micro_batch));
  if (recompute != "none") add("recompute=" + recompute);
  if (offload != "none") add("offload=" + offload);
  return text;
}

Layout Layout::parse(const std::string& text) {
  Layout layout;
  std::string spaced = text;
  for (char& c : spaced) c = c == ',' ? ' ' : c;
  size_t pos = 0;
  bool fsdp_given = false;
  while (pos < spaced.size()) {
    while (pos < spaced.size() && std::isspace(static_cast<unsigned char>(spaced[pos]))) ++pos;
    if (pos >= spaced.size()) break;
    const size_t end = spaced.find(' ', pos);
    const std::string item = spaced.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? spaced.size() : end;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "sp" && eq == std::string::npos) layout.sp = true;
    else if (key == "gpipe" || key == "1f1b" || key == "interleaved") layout.schedule = key;
    else if (eq == std::string::npos) throw std::invalid_argument("layout item '" + item + "': expected key=value (e.g. tp=2)");
    else if (key == "dp") layout.dp = positive(key, value);
    else if (key == "fsdp") layout.fsdp = positive(key, value), fsdp_given = true;
    else if (key == "tp") layout.tp = positive(key, value);
    else if (key == "ep") layout.ep = positive(key, value);
    else if (key == "pp") layout.pp = positive(key, value);
    else if (key == "v") layout.virtual_stages = positive(key, value);
    else if (key == "mb") layout.micro_batch = positive(key, value);
    else if (key == "sp") layout.sp = one_of(key, value, {"true", "false"}) == "true";
    else if (key == "schedule") layout.schedule = one_of(key, value, {"gpipe", "1f1b", "interleaved"});
    else if (key == "zero") layout.zero_stage = static_cast<int>(std::stoll(one_of(key, value, {"0", "1", "2", "3"})));
    else if (key == "recompute") layout.recompute = one_of(key, value, {"none", "selective", "full"});
    else if (key == "offload") layout.offload = one_of(key, value, {"none", "optimizer", "parameters"});
    else {
      throw std::invalid_argument("layout key '" + key + "' unknown; keys: dp fsdp ep tp sp pp schedule v zero mb recompute offload");
    }
  }
  // "zero=3 dp=8" means eight shards, as ZeRO speaks of them.
  if (layout.zero_stage > 0 && !fsdp_given) std::swap(layout.dp, layout.fsdp);
  return layout;
}

Precision Precision::parse(const std::string& name) {
  Precision p;
  p.name = name;
  if (name == "fp32") return p;
  if (name == "bf16-mixed") {
    p.param = p.grad = p.activation = 2;
    p.optimizer = 12;
    p.mask = 1;
    return p;
  }
  throw std::invalid_argument("precision '" + name + "': use fp32 or bf16-mixed");
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
  auto number = [&](const char* key, double& field) {
    if (!j.contains(key)) return;
    if (!j[key].is_number() || !(j[key].get<double>() > 0)) {
      throw std::invalid_argument(std::string("machine profile field '") + key + "' must be a positive number");
    }
    field = j[key].get<double>();
  };
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
