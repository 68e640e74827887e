#include "meshtrain/annotate/annotate.h"

#include <sstream>
#include <stdexcept>

namespace meshtrain::annotate {

using placement::Placement;

namespace {

std::string axes_of(const mesh::DeviceMesh& mesh) { return mesh.layout().describe(); }

}  // namespace

Sharding replicated(const mesh::DeviceMesh& mesh) { return Sharding(mesh.layout().ndim(), Placement::replicate()); }

Sharding split_sharding(const mesh::DeviceMesh& mesh, int64_t dim, int num_partitions, const std::string& axis) {
  Sharding out = replicated(mesh);
  if (num_partitions == 1) return out;
  if (!axis.empty()) {
    const int k = mesh.layout().axis_index(axis);
    if (mesh.layout().axes()[k].size != num_partitions) {
      throw std::invalid_argument("split: axis " + axis + " has " + std::to_string(mesh.layout().axes()[k].size) +
                                  " ranks, not " + std::to_string(num_partitions) + " (mesh " + axes_of(mesh) + ")");
    }
    out[k] = Placement::shard(dim);
    return out;
  }
  std::vector<int> candidates;
  for (int k = 0; k < mesh.layout().ndim(); ++k) {
    if (mesh.layout().axes()[k].size == num_partitions) candidates.push_back(k);
  }
  if (candidates.size() != 1) {
    throw std::invalid_argument("split: " + std::to_string(candidates.size()) + " axes of mesh " + axes_of(mesh) +
                                " have " + std::to_string(num_partitions) + " ranks; " +
                                (candidates.empty() ? "choose a number of partitions an axis has"
                                                    : "name the axis to split over"));
  }
  out[candidates.front()] = Placement::shard(dim);
  return out;
}

Sharding tiled_sharding(const mesh::DeviceMesh& mesh, const std::vector<int64_t>& tiles,
                        const std::vector<int>& device_order) {
  const mesh::MeshLayout& layout = mesh.layout();
  int64_t count = 1;
  for (int64_t t : tiles) count *= t;
  if (static_cast<int64_t>(device_order.size()) != count) {
    throw std::invalid_argument("shard: " + std::to_string(count) + " tiles but " +
                                std::to_string(device_order.size()) + " devices in the order");
  }
  // Try every assignment of the split dims to distinct mesh axes of their sizes.
  std::vector<int64_t> dims;
  for (size_t d = 0; d < tiles.size(); ++d) {
    if (tiles[d] > 1) dims.push_back(static_cast<int64_t>(d));
  }
  std::vector<int> axis_of(dims.size(), -1);
  std::function<bool(size_t)> assign = [&](size_t i) -> bool {
    if (i == dims.size()) {
      // Tile index -> coordinate (other axes 0) -> rank, against the order.
      for (int64_t flat = 0; flat < count; ++flat) {
        std::vector<int> coordinate(layout.ndim(), 0);
        int64_t rest = flat;
        for (size_t d = tiles.size(); d-- > 0;) {
          const int64_t index = rest % tiles[d];
          rest /= tiles[d];
          const auto it = std::find(dims.begin(), dims.end(), static_cast<int64_t>(d));
          if (it != dims.end()) coordinate[axis_of[it - dims.begin()]] = static_cast<int>(index);
        }
        if (layout.rank_of(coordinate) != device_order[flat]) return false;
      }
      return true;
    }
    for (int k = 0; k < layout.ndim(); ++k) {
      if (layout.axes()[k].size != tiles[dims[i]]) continue;
      if (std::find(axis_of.begin(), axis_of.begin() + i, k) != axis_of.begin() + i) continue;
      axis_of[i] = k;
      if (assign(i + 1)) return true;
    }
    return false;
  };
  if (!assign(0)) {
    std::ostringstream order;
    for (int r : device_order) order << (order.tellp() > 0 ? "," : "") << r;
    throw std::invalid_argument("shard: the device order [" + order.str() +
                                "] is not one the axes of mesh " + axes_of(mesh) +
                                " give; each split dim must run along one axis of its size (reorder the mesh or the devices)");
  }
  Sharding out = replicated(mesh);
  for (size_t i = 0; i < dims.size(); ++i) out[axis_of[i]] = Placement::shard(dims[i]);
  return out;
}

Sharding mesh_split_sharding(const mesh::DeviceMesh& mesh, const std::vector<int>& dims_mapping, int64_t blocks) {
  Sharding out = replicated(mesh);
  for (size_t d = 0; d < dims_mapping.size(); ++d) {
    const int k = dims_mapping[d];
    if (k < 0) continue;
    if (k >= mesh.layout().ndim()) {
      throw std::invalid_argument("mesh_split: dims_mapping[" + std::to_string(d) + "] = " + std::to_string(k) +
                                  " but mesh " + axes_of(mesh) + " has " + std::to_string(mesh.layout().ndim()) + " axes");
    }
    if (!out[k].is_replicate()) {
      throw std::invalid_argument("mesh_split: mesh axis " + mesh.layout().axes()[k].name + " splits two dims");
    }
    out[k] = Placement::shard(static_cast<int64_t>(d), blocks);
  }
  return out;
}

at::Tensor annotate(const at::Tensor& t, const Mesh& mesh, const Sharding& sharding) {
  if (is_dist(t)) return redistribute(t, sharding);
  for (const Placement& p : sharding) {
    if (p.is_shard() && p.dim >= t.dim()) {
      throw std::invalid_argument("annotation: splits dim " + std::to_string(p.dim) + " of a tensor of " +
                                  std::to_string(t.dim()) + " dims");
    }
  }
  if (!(t.is_leaf() && t.requires_grad())) return distribute(t, mesh, sharding);
  // A parameter: its TensorImpl becomes the distributed one, in place.
  at::Tensor dist;
  {
    torch::NoGradGuard no_grad;
    dist = distribute(t.detach(), mesh, sharding);
  }
  at::Tensor param = t;
  if (param.grad().defined()) param.mutable_grad() = at::Tensor();
  param.unsafeGetTensorImpl()->shallow_copy_from(dist.getIntrusivePtr());
  return param;
}

at::Tensor replicate(const at::Tensor& t, const Mesh& mesh) { return annotate(t, mesh, replicated(*mesh)); }

at::Tensor split(const at::Tensor& t, int64_t dim, int num_partitions, const Mesh& mesh, const std::string& axis) {
  return annotate(t, mesh, split_sharding(*mesh, dim < 0 ? dim + t.dim() : dim, num_partitions, axis));
}

at::Tensor shard(const at::Tensor& t, const Mesh& mesh, const std::vector<int64_t>& tiles,
                 const std::vector<int>& device_order) {
  if (static_cast<int64_t>(tiles.size()) != t.dim()) {
    throw std::invalid_argument("shard: " + std::to_string(tiles.size()) + " tile counts for a tensor of " +
                                std::to_string(t.dim()) + " dims");
  }
  return annotate(t, mesh, tiled_sharding(*mesh, tiles, device_order));
}

at::Tensor mesh_split(const at::Tensor& t, const Mesh& mesh, const std::vector<int>& dims_mapping, int64_t blocks) {
  if (static_cast<int64_t>(dims_mapping.size()) != t.dim()) {
    throw std::invalid_argument("mesh_split: dims_mapping has " + std::to_string(dims_mapping.size()) +
                                " entries for a tensor of " + std::to_string(t.dim()) + " dims");
  }
  return annotate(t, mesh, mesh_split_sharding(*mesh, dims_mapping, blocks));
}

bool name_matches(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0;
  while (p < pattern.size() && n <= name.size()) {
    const size_t pe = std::min(pattern.find('.', p), pattern.size());
    const size_t ne = std::min(name.find('.', n), name.size());
    const std::string seg = pattern.substr(p, pe - p);
    if (seg != "*" && seg != name.substr(n, ne - n)) return false;
    p = pe + 1, n = ne + 1;
    if ((pe == pattern.size()) != (ne == name.size())) return false;
  }
  return p > pattern.size() && n > name.size();
}

std::vector<std::string> annotate_module(torch::nn::Module& module, const Mesh& mesh,
                                         const std::vector<ShardingRule>& rules) {
  std::vector<std::string> split_names;
  for (auto& item : module.named_parameters()) {
    const Sharding* sharding = nullptr;
    for (const ShardingRule& rule : rules) {
      if (name_matches(rule.first, item.key())) {
        sharding = &rule.second;
        break;
      }
    }
    annotate(item.value(), mesh, sharding ? *sharding : replicated(*mesh));
    bool split_here = false;
    for (size_t k = 0; sharding && k < sharding->size(); ++k) {
      split_here = split_here || (!(*sharding)[k].is_replicate() && mesh->layout().axes()[k].size > 1);
    }
    if (split_here) split_names.push_back(item.key());
  }
  return split_names;
}

void settle_gradients(torch::nn::Module& module) {
  for (at::Tensor& p : module.parameters()) {
    if (!p.grad().defined() || !is_dist(p)) continue;
    const Sharding& want = dist_state(p).placements;
    if (!is_dist(p.grad())) {
      p.mutable_grad() = distribute(p.grad(), dist_state(p).mesh, want);
    } else if (dist_state(p.grad()).placements != want) {
      torch::NoGradGuard no_grad;
      p.mutable_grad() = redistribute(p.grad(), want);
    }
  }
}

}  // namespace meshtrain::annotate
