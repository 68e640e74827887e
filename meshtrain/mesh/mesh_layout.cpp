#include "meshtrain/mesh/mesh_layout.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace meshtrain::mesh {

namespace {

std::string formula(const std::vector<MeshAxis>& axes) {
  std::ostringstream out;
  for (size_t i = 0; i < axes.size(); ++i) out << (i ? " * " : "") << axes[i].name << "(" << axes[i].size << ")";
  return out.str();
}

std::string join(const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : "") << names[i];
  return out.str();
}

}  // namespace

MeshLayout::MeshLayout(std::vector<MeshAxis> axes, int world_size) : axes_(std::move(axes)), world_size_(world_size) {
  if (axes_.empty()) throw MeshError("a device mesh needs at least one axis");
  if (world_size_ < 1) throw MeshError("world size must be >= 1, got " + std::to_string(world_size_));
  std::set<std::string> seen;
  long long product = 1;
  for (const MeshAxis& axis : axes_) {
    if (axis.name.empty()) throw MeshError("mesh axis names must be non-empty: " + formula(axes_));
    if (!seen.insert(axis.name).second) throw MeshError("mesh axis '" + axis.name + "' appears twice: " + formula(axes_));
    if (axis.size < 1) {
      throw MeshError("mesh axis '" + axis.name + "' has size " + std::to_string(axis.size) +
                      "; sizes must be >= 1: " + formula(axes_));
    }
    product *= axis.size;
  }
  if (product != world_size_) {
    throw MeshError(formula(axes_) + " = " + std::to_string(product) + " != world size " +
                    std::to_string(world_size_) + "; choose degrees whose product is the number of ranks");
  }
}

MeshLayout MeshLayout::from_degrees(const std::vector<MeshAxis>& degrees, int world_size) {
  const auto& names = canonical_axes();
  std::vector<MeshAxis> axes;
  for (const std::string& name : names) axes.push_back({name, 1});
  std::set<std::string> given;
  for (const MeshAxis& d : degrees) {
    auto it = std::find(names.begin(), names.end(), d.name);
    if (it == names.end()) {
      throw MeshError("unknown mesh axis '" + d.name + "'; known axes are " + join(names));
    }
    if (!given.insert(d.name).second) throw MeshError("mesh axis '" + d.name + "' given twice");
    axes[it - names.begin()].size = d.size;
  }
  return MeshLayout(std::move(axes), world_size);
}

int MeshLayout::axis_index(const std::string& name) const {
  for (int i = 0; i < ndim(); ++i) {
    if (axes_[i].name == name) return i;
  }
  std::vector<std::string> names;
  for (const MeshAxis& a : axes_) names.push_back(a.name);
  throw MeshError("the mesh " + formula(axes_) + " has no axis '" + name + "' (axes: " + join(names) + ")");
}

bool MeshLayout::has_axis(const std::string& name) const {
  return std::any_of(axes_.begin(), axes_.end(), [&](const MeshAxis& a) { return a.name == name; });
}

void MeshLayout::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw MeshError("rank " + std::to_string(rank) + " is outside the mesh " + formula(axes_) + " of " +
                    std::to_string(world_size_) + " ranks");
  }
}

std::vector<int> MeshLayout::coordinate(int rank) const {
  check_rank(rank);
  std::vector<int> coord(axes_.size());
  for (int i = ndim() - 1; i >= 0; --i) {
    coord[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return coord;
}

int MeshLayout::rank_of(const std::vector<int>& coordinate) const {
  if (static_cast<int>(coordinate.size()) != ndim()) {
    throw MeshError("a coordinate of the mesh " + formula(axes_) + " has " + std::to_string(ndim()) +
                    " entries, got " + std::to_string(coordinate.size()));
  }
  int rank = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (coordinate[i] < 0 || coordinate[i] >= axes_[i].size) {
      throw MeshError("coordinate " + std::to_string(coordinate[i]) + " is outside axis '" + axes_[i].name +
                      "' of size " + std::to_string(axes_[i].size));
    }
    rank = rank * axes_[i].size + coordinate[i];
  }
  return rank;
}

std::vector<bool> MeshLayout::selection(const std::vector<std::string>& axes) const {
  if (axes.empty()) throw MeshError("a mesh group needs at least one axis");
  std::vector<bool> selected(axes_.size(), false);
  for (const std::string& name : axes) {
    const int i = axis_index(name);
    if (selected[i]) throw MeshError("mesh axis '" + name + "' named twice in a group");
    selected[i] = true;
  }
  return selected;
}

std::vector<int> MeshLayout::group_ranks(int rank, const std::vector<std::string>& axes) const {
  const std::vector<bool> selected = selection(axes);
  const std::vector<int> base = coordinate(rank);
  int group_size = 1;
  for (int i = 0; i < ndim(); ++i) {
    if (selected[i]) group_size *= axes_[i].size;
  }
  std::vector<int> ranks;
  ranks.reserve(group_size);
  for (int g = 0; g < group_size; ++g) {
    std::vector<int> coord = base;
    int rest = g;
    for (int i = ndim() - 1; i >= 0; --i) {
      if (!selected[i]) continue;
      coord[i] = rest % axes_[i].size;
      rest /= axes_[i].size;
    }
    ranks.push_back(rank_of(coord));
  }
  return ranks;
}

int MeshLayout::rank_in_group(int rank, const std::vector<std::string>& axes) const {
  const std::vector<bool> selected = selection(axes);
  const std::vector<int> coord = coordinate(rank);
  int position = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (selected[i]) position = position * axes_[i].size + coord[i];
  }
  return position;
}

int MeshLayout::group_index(int rank, const std::vector<std::string>& axes) const {
  const std::vector<bool> selected = selection(axes);
  const std::vector<int> coord = coordinate(rank);
  int index = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (!selected[i]) index = index * axes_[i].size + coord[i];
  }
  return index;
}

std::vector<std::vector<int>> MeshLayout::all_groups(const std::vector<std::string>& axes) const {
  const std::vector<bool> selected = selection(axes);
  int groups = 1;
  for (int i = 0; i < ndim(); ++i) {
    if (!selected[i]) groups *= axes_[i].size;
  }
  std::vector<std::vector<int>> result(groups);
  for (int r = 0; r < world_size_; ++r) {
    if (rank_in_group(r, axes) == 0) result[group_index(r, axes)] = group_ranks(r, axes);
  }
  return result;
}

std::string MeshLayout::describe() const { return formula(axes_); }

}  // namespace meshtrain::mesh
