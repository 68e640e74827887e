// MeshLayout: the rank <-> coordinate arithmetic of an N-D device mesh, with no
// processes or communicators involved (so it is testable for any world size).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::mesh {

// The axis names every parallelism uses, outermost first; tp is innermost so
// tensor-parallel peers are neighbouring ranks (usually one node), and cp
// next to it (its ring and all-to-all run every layer).
inline const std::vector<std::string>& canonical_axes() {
  static const std::vector<std::string> axes{"pp", "dp", "fsdp", "ep", "cp", "tp"};
  return axes;
}

struct MeshAxis {
  std::string name;
  int size = 1;
};

class MeshError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Ranks are laid out row-major over the axes in the given order: the last axis
// varies fastest. A group "along" a set of axes is the ranks that share every
// other coordinate; within it, ranks are ordered row-major over the chosen axes.
class MeshLayout {
 public:
  // Checks names (non-empty, unique), sizes (>= 1) and that the product of the
  // sizes equals `world_size`; errors print the formula, e.g.
  // "pp(2) * dp(2) * tp(4) = 16 != world size 8".
  MeshLayout(std::vector<MeshAxis> axes, int world_size);

  // Axes in canonical order (pp, dp, fsdp, ep, cp, tp) from degrees keyed by name;
  // names not given get size 1; unknown names are rejected.
  static MeshLayout from_degrees(const std::vector<MeshAxis>& degrees, int world_size);

  int world_size() const { return world_size_; }
  int ndim() const { return static_cast<int>(axes_.size()); }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  int axis_index(const std::string& name) const;  // throws naming the axes there are
  int axis_size(const std::string& name) const { return axes_[axis_index(name)].size; }
  bool has_axis(const std::string& name) const;

  std::vector<int> coordinate(int rank) const;
  int rank_of(const std::vector<int>& coordinate) const;

  // The ranks in `rank`'s group along `axes` (in group order).
  std::vector<int> group_ranks(int rank, const std::vector<std::string>& axes) const;
  // rank's position within that group, and the group's index among all groups
  // along `axes` (row-major over the other axes).
  int rank_in_group(int rank, const std::vector<std::string>& axes) const;
  int group_index(int rank, const std::vector<std::string>& axes) const;
  // Every group along `axes`, indexed by group_index.
  std::vector<std::vector<int>> all_groups(const std::vector<std::string>& axes) const;

  // "pp(2) * dp(2) * tp(2)"
  std::string describe() const;

 private:
  std::vector<bool> selection(const std::vector<std::string>& axes) const;
  void check_rank(int rank) const;

  std::vector<MeshAxis> axes_;
  int world_size_;
};

}  // namespace meshtrain::mesh
