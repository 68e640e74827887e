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
  const bool master_is_view = options.stage < 3 && options.param_dtype == at::kFloat;
  torch::NoGradGuard no_grad;
  for (Unit& unit : units) {
    unit.padded = (unit.numel + n - 1) / n * n;
    unit.shard = unit.padded / n;
    const at::TensorOptions fp32 = unit.params.front().options().dtype(at::kFloat);
    unit.full = at::zeros({unit.padded}, fp32.dtype(options.param_dtype));
    at::Tensor flat32 = at::zeros({unit.padded}, fp32);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      flat32.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(unit.params[i].reshape({-1}));
    }
    unit.full.copy_(flat32);
    unit.master = master_is_view ? unit.full.narrow(0, shard_rank * unit.shard, unit.shard)
                                 : flat32.narrow(0, shard_rank * unit.shard, unit.shard).clone();
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
    Unit& unit = units[u];
    size_t frozen = 0;
    for (const at::Tensor& p : unit.params) frozen += p.requires_grad() ? 0 : 1;
    if (frozen == 0) continue;
    if (frozen == unit.params.size()) {
      unit.frozen = true;
      continue;
    }
    if (unit.expert) throw std::invalid_argument("fully sharded: expert tensor " + unit.names.front() + " is frozen");
    Unit trainable, still;
    trainable.module = unit.module;
    still.module = "frozen " + (unit.module.empty() ? std::string("root") : unit.module);
    still.frozen = true;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      Unit& to = unit.params[i].requires_grad() ? trainable : still;
      to.names.push_back(unit.names[i]);
      to.params.push_back(unit.params[i]);
      to.offsets.push_back(to.numel);
      to.numel += unit.params[i].numel();
    }
    trainable.companions.push_back(units.size());
    still.host = u;
    unit = std::move(trainable);
    units.push_back(std::move(still));
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
