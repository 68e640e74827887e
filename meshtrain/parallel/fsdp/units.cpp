// Units: which parameters share a flat buffer, and the buffers themselves.
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include <algorithm>
#include <cctype>
#include <set>

namespace meshtrain::parallel {

namespace {

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

UnitPolicy UnitPolicy::whole_model() {
  return {[](const std::string&, const torch::nn::Module&) { return false; }};
}

UnitPolicy UnitPolicy::submodules(std::vector<std::string> names) {
  std::set<std::string> set(names.begin(), names.end());
  return {[set](const std::string& name, const torch::nn::Module&) { return set.count(name) > 0; }};
}

UnitPolicy UnitPolicy::blocks(const std::string& list) {
  return {[list](const std::string& name, const torch::nn::Module&) {
    if (!starts_with(name, list + ".")) return false;
    const std::string index = name.substr(list.size() + 1);
    return !index.empty() && std::all_of(index.begin(), index.end(), [](char c) { return std::isdigit(c); });
  }};
}

void ShardedState::build_units(torch::nn::Module& module) {
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  for (const auto& item : module.named_parameters()) {
    names.push_back(item.key());
    values.push_back(item.value());
  }
  auto holds = [&](const std::string& prefix) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return starts_with(n, prefix); });
  };
  // The root unit first, then units of one parameter, then the chosen submodules in module order.
  units.emplace_back();
  for (const std::string& name : names) {
    const bool expert = is_expert(name);
    if (!expert && (!options.own_unit || !options.own_unit(name))) continue;
    if (stage3() && !expert) throw std::invalid_argument("fully sharded: units of one parameter need stage 1 or 2");
    units.emplace_back();
    units.back().module = "parameter " + name;
    units.back().expert = expert;
  }
  const size_t first_module_unit = units.size();
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    if (!options.units.is_unit || !options.units.is_unit(name, *item.value()) || !holds(name + ".")) continue;
    const bool nested = std::any_of(units.begin() + first_module_unit, units.end(),
                                    [&](const Unit& u) { return starts_with(name, u.module + "."); });
    if (nested) continue;  // part of a unit already
    units.emplace_back();
    units.back().module = name;
  }
  for (size_t i = 0; i < names.size(); ++i) {
    size_t u = 0;  // a unit of its own first, else the (innermost) module unit holding it, else the root
    for (size_t k = 1; k < units.size() && (u == 0 || u >= first_module_unit); ++k) {
      const std::string& m = units[k].module;
      if (k < first_module_unit ? m == "parameter " + names[i] : starts_with(names[i], m + ".")) u = k;
    }
    Unit& unit = units[u];
    unit.names.push_back(names[i]);
    unit.params.push_back(values[i]);
    unit.offsets.push_back(unit.numel);
    unit.numel += values[i].numel();
  }
  if (units.front().params.empty()) units.erase(units.begin());  // everything is in a unit (or a pipeline stage's blocks)
  if (units.empty()) throw std::invalid_argument("fully sharded: the module has no parameters");
  split_frozen();
  for (size_t u = 0; u < units.size(); ++u) unit_of_module[units[u].module] = u;
  if (stage3()) attach_companions();

  const int64_t n = shards;
  torch::NoGradGuard no_grad;
  for (Unit& unit : units) {
    unit.padded = (unit.numel + n - 1) / n * n;
    unit.shard = unit.padded / n;
    // A frozen unit kept in a lower precision (LoRA's base_dtype) stays in it, master and all: nothing steps it.
    const at::ScalarType stored = unit.params.front().scalar_type();
    const bool low = unit.frozen && stored != at::kFloat;
    const bool master_is_view = options.stage < 3 && (low || options.param_dtype == at::kFloat);
    const at::TensorOptions fp32 = unit.params.front().options().dtype(at::kFloat);
    unit.full = at::zeros({unit.padded}, fp32.dtype(low ? stored : options.param_dtype));
    at::Tensor flat32 = at::zeros({unit.padded}, fp32);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      flat32.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(unit.params[i].reshape({-1}));
    }
    unit.full.copy_(flat32);
    unit.master = master_is_view ? unit.full.narrow(0, shard_rank * unit.shard, unit.shard)
                                 : flat32.narrow(0, shard_rank * unit.shard, unit.shard).to(low ? stored : at::kFloat, false, true);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      at::Tensor& p = unit.params[i];
      const std::vector<int64_t> shape = p.sizes().vec();
      p.mutable_grad().reset();
      p.set_data(unit.full.narrow(0, unit.offsets[i], p.numel()).view(shape));
    }
    if (options.stage == 1 && !unit.frozen) {
      unit.grad = at::zeros({unit.padded}, unit.full.options());
      for (size_t i = 0; i < unit.params.size(); ++i) {
        unit.params[i].mutable_grad() =
            unit.grad.narrow(0, unit.offsets[i], unit.params[i].numel()).view(unit.params[i].sizes());
      }
    }
    const bool grad_is_view = options.stage == 1 && !options.stage1_reduce_scatter && options.param_dtype == at::kFloat;
    if (!unit.frozen) unit.shard_grad = grad_is_view ? unit.grad.narrow(0, shard_rank * unit.shard, unit.shard) : at::zeros({unit.shard}, fp32);
  }
  for (Unit& unit : units) {  // once every buffer exists: a host frees its companions with it
    if (stage3()) reshard_locked(unit);
  }
  build_reduce_order();
}

void ShardedState::split_frozen() {
  const size_t count = units.size();
  for (size_t u = 0; u < count; ++u) {
    // The trainable parameters, then the frozen ones by dtype (LoRA's base
    // keeps its matrices in bf16, its norms in fp32): each a unit.
    std::vector<Unit> parts(1);
    std::map<at::ScalarType, size_t> part_of;  // frozen dtype -> its part
    for (size_t i = 0; i < units[u].params.size(); ++i) {
      const at::Tensor& p = units[u].params[i];
      size_t k = 0;
      if (!p.requires_grad()) {
        auto it = part_of.emplace(p.scalar_type(), parts.size()).first;
        if (it->second == parts.size()) parts.emplace_back().frozen = true;
        k = it->second;
      }
      Unit& to = parts[k];
      to.names.push_back(units[u].names[i]);
      to.params.push_back(p);
      to.offsets.push_back(to.numel);
      to.numel += p.numel();
    }
    if (part_of.empty()) continue;
    if (units[u].expert) throw std::invalid_argument("fully sharded: expert tensor " + units[u].names.front() + " is frozen");
    if (parts.front().params.empty()) parts.erase(parts.begin());  // all frozen: the first dtype keeps the unit
    const std::string module = units[u].module;
    for (size_t k = 0; k < parts.size(); ++k) {
      parts[k].module = k == 0 ? module : "frozen " + std::to_string(k) + " " + (module.empty() ? "root" : module);
      if (k == 0) continue;
      parts[k].host = u;
      parts.front().companions.push_back(units.size() + k - 1);
    }
    units[u] = std::move(parts.front());
    for (size_t k = 1; k < parts.size(); ++k) units.push_back(std::move(parts[k]));
  }
}

void ShardedState::attach_companions() {
  for (size_t u = 0; u < units.size(); ++u) {
    if (!units[u].expert) continue;
    const std::string& name = units[u].names.front();
    size_t host = SIZE_MAX, matched = 0;  // the innermost module unit holding it, else the root
    for (size_t k = 0; k < units.size(); ++k) {
      const std::string& m = units[k].module;
      if (units[k].expert || starts_with(m, "parameter ")) continue;
      const bool holds = m.empty() || starts_with(name, m + ".");
      if (holds && (host == SIZE_MAX || m.size() > matched)) host = k, matched = m.size();
    }
    if (host == SIZE_MAX) {
      throw std::invalid_argument("fully sharded: stage 3 gathers expert tensor " + name +
                                  " with the unit holding its module, and no unit (nor a root unit) holds it");
    }
    units[u].host = host;
    units[host].companions.push_back(u);
  }
}

void ShardedState::build_reduce_order() {
  // Backward finishes the units last to first, the root last (the embedding's
  // gradient is the last one ready). A host's companions (its experts, whose
  // gradients come before its attention's) just before it, so each is freed
  // with its block's backward.
  // Frozen units are never reduced.
  for (size_t u = units.size(); u-- > 0;) {
    if (units[u].host != SIZE_MAX || units[u].frozen) continue;
    for (auto c = units[u].companions.rbegin(); c != units[u].companions.rend(); ++c) {
      if (!units[*c].frozen) reduce_order.push_back(*c);
    }
    reduce_order.push_back(u);
  }
}

size_t ShardedState::next_host(size_t u) const {
  for (size_t k = u + 1; k < units.size(); ++k) {
    if (units[k].host == SIZE_MAX) return k;
  }
  return SIZE_MAX;
}

size_t ShardedState::previous_host(size_t u) const {
  for (size_t k = u; k-- > 0;) {
    if (units[k].host == SIZE_MAX) return k;
  }
  return SIZE_MAX;
}

}  // namespace meshtrain::parallel
