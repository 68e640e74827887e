// DeviceMesh: a MeshLayout bound to communicators, one for every group of axes.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/mesh_layout.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::mesh {

// Every parallelism takes its communicators from the mesh, never from the world.
// Construction is collective over `world` (every rank builds the same layout at
// the same point) and creates the communicators of every non-empty set of axes
// up front, so comm() never communicates and cannot deadlock. Sets of axes that
// group the same ranks (they differ only by size-1 axes) share one communicator.
class DeviceMesh {
 public:
  DeviceMesh(std::shared_ptr<comm::Communicator> world, MeshLayout layout);

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return world_->rank(); }
  const std::shared_ptr<comm::Communicator>& world() const { return world_; }
  std::vector<int> coordinate() const { return layout_.coordinate(rank()); }
  int coordinate(const std::string& axis) const { return coordinate()[layout_.axis_index(axis)]; }

  // The communicator of this rank's group along `axis` / along `axes` (any order).
  const std::shared_ptr<comm::Communicator>& comm(const std::string& axis) const;
  const std::shared_ptr<comm::Communicator>& comm(const std::vector<std::string>& axes) const;

  // "dp(2) * tp(2); rank 3 at dp=1, tp=1"
  std::string describe() const;

 private:
  // The axes of `axes` with size > 1, in mesh order, joined by '+' ("" for none).
  std::string group_key(const std::vector<std::string>& axes) const;

  std::shared_ptr<comm::Communicator> world_;
  MeshLayout layout_;
  std::map<std::string, std::shared_ptr<comm::Communicator>> comms_;  // by group_key
};

}  // namespace meshtrain::mesh
