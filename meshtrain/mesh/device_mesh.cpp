#include "meshtrain/mesh/device_mesh.h"

#include <sstream>

namespace meshtrain::mesh {

DeviceMesh::DeviceMesh(std::shared_ptr<comm::Communicator> world, MeshLayout layout)
    : world_(std::move(world)), layout_(std::move(layout)) {
  if (!world_) throw MeshError("DeviceMesh needs a world communicator");
  if (world_->size() != layout_.world_size()) {
    throw MeshError("rank " + std::to_string(world_->rank()) + ": " + layout_.describe() + " = " +
                    std::to_string(layout_.world_size()) + " != world size " + std::to_string(world_->size()));
  }
  const int n = layout_.ndim();
  for (unsigned mask = 1; mask < (1u << n); ++mask) {
    std::vector<std::string> axes;
    for (int i = 0; i < n; ++i) {
      if (mask & (1u << i)) axes.push_back(layout_.axes()[i].name);
    }
    const std::string key = group_key(axes);
    if (comms_.count(key)) continue;
    const int color = layout_.group_index(rank(), axes);
    const int key_in_group = layout_.rank_in_group(rank(), axes);
    comms_[key] = world_->split(color, key_in_group, "mesh:" + (key.empty() ? std::string("self") : key));
  }
}

std::string DeviceMesh::group_key(const std::vector<std::string>& axes) const {
  std::vector<bool> selected(layout_.ndim(), false);
  for (const std::string& a : axes) selected[layout_.axis_index(a)] = true;
  std::string key;
  for (int i = 0; i < layout_.ndim(); ++i) {
    if (!selected[i] || layout_.axes()[i].size == 1) continue;
    if (!key.empty()) key += "+";
    key += layout_.axes()[i].name;
  }
  return key;
}

const std::shared_ptr<comm::Communicator>& DeviceMesh::comm(const std::string& axis) const {
  return comm(std::vector<std::string>{axis});
}

const std::shared_ptr<comm::Communicator>& DeviceMesh::comm(const std::vector<std::string>& axes) const {
  if (axes.empty()) throw MeshError("DeviceMesh::comm needs at least one axis");
  return comms_.at(group_key(axes));
}

std::string DeviceMesh::describe() const {
  std::ostringstream out;
  out << layout_.describe() << "; rank " << rank() << " at ";
  const std::vector<int> coord = coordinate();
  for (int i = 0; i < layout_.ndim(); ++i) out << (i ? ", " : "") << layout_.axes()[i].name << "=" << coord[i];
  return out.str();
}

}  // namespace meshtrain::mesh
