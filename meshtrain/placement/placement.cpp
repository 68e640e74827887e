#include "meshtrain/placement/placement.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace meshtrain::placement {

std::string Placement::str() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kPartial: return "P";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")" + (blocks > 1 ? "x" + std::to_string(blocks) : "");
  }
  return "?";
}

std::vector<int64_t> chunk_sizes(int64_t size, int64_t parts) {
  std::vector<int64_t> sizes(parts, size / parts);
  for (int64_t i = 0; i < size % parts; ++i) ++sizes[i];
  return sizes;
}

int64_t chunk_offset(int64_t size, int64_t parts, int64_t index) {
  return index * (size / parts) + std::min(index, size % parts);
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

void TensorSpec::check(const mesh::MeshLayout& mesh) const {
  auto fail = [&](const std::string& why) { throw std::invalid_argument("tensor spec " + str() + ": " + why); };
  if (axes.size() != placements.size()) fail("needs one placement per axis");
  const int64_t dims = static_cast<int64_t>(shape.size());
  for (int64_t s : shape) {
    if (s < 0) fail("negative size");
  }
  for (size_t i = 0; i < axes.size(); ++i) {
    if (!mesh.has_axis(axes[i])) fail("the mesh " + mesh.describe() + " has no axis '" + axes[i] + "'");
    for (size_t j = 0; j < i; ++j) {
      if (axes[j] == axes[i]) fail("axis '" + axes[i] + "' listed twice");
    }
    const Placement& p = placements[i];
    if (!p.is_shard()) continue;
    if (p.dim < 0 || p.dim >= dims) fail("shards dim " + std::to_string(p.dim) + " of a " + std::to_string(dims) + "-d tensor");
    if (p.blocks < 1) fail("blocks must be >= 1");
    if (p.blocks == 1) continue;
    if (shape[p.dim] % p.blocks != 0) fail(std::to_string(p.blocks) + " blocks do not divide dim " + std::to_string(p.dim));
    for (size_t j = 0; j < placements.size(); ++j) {
      if (j != i && placements[j].is_shard(p.dim)) fail("a dim split into blocks is split by one axis only");
    }
  }
  if (flat_begin < 0 || (flat_end >= 0 && flat_end < flat_begin)) fail("bad flat range");
}

std::string TensorSpec::str() const {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  for (size_t i = 0; i < axes.size() && i < placements.size(); ++i) out << " " << axes[i] << ":" << placements[i].str();
  if (flat_begin != 0 || flat_end >= 0) out << " flat[" << flat_begin << ", " << flat_end << ")";
  return out.str();
}

std::vector<Box> local_boxes(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank) {
  spec.check(mesh);
  const std::vector<int> coordinate = mesh.coordinate(rank);
  std::vector<Box> boxes = {Box{std::vector<int64_t>(spec.shape.size(), 0), spec.shape}};
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    const Placement& p = spec.placements[i];
    if (!p.is_shard()) continue;
    const int axis = mesh.axis_index(spec.axes[i]);
    const int64_t n = mesh.axes()[axis].size, c = coordinate[axis], d = p.dim;
    if (p.blocks > 1) {
      // check(): the only split of dim d; other dims' splits cut every box alike.
      std::vector<Box> blocked;
      for (const Box& whole : boxes) {
        const int64_t block = whole.sizes[d] / p.blocks;
        for (int64_t b = 0; b < p.blocks; ++b) {
          Box box = whole;
          box.offsets[d] = whole.offsets[d] + b * block + chunk_offset(block, n, c);
          box.sizes[d] = chunk_sizes(block, n)[c];
          blocked.push_back(box);
        }
      }
      boxes = blocked;
      continue;
    }
    for (Box& box : boxes) {
      box.offsets[d] += chunk_offset(box.sizes[d], n, c);
      box.sizes[d] = chunk_sizes(box.sizes[d], n)[c];
    }
  }
  return boxes;
}

std::vector<int64_t> local_shape(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank) {
  const std::vector<Box> boxes = local_boxes(spec, mesh, rank);
  std::vector<int64_t> shape = boxes.front().sizes;
  int64_t d = 0;  // blocks: concatenated along their dim
  for (const Placement& p : spec.placements) d = p.is_shard() && p.blocks > 1 ? p.dim : d;
  for (size_t b = 1; b < boxes.size(); ++b) shape[d] += boxes[b].sizes[d];
  return shape;
}

std::vector<Chunk> local_chunks(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank) {
  const std::vector<Box> boxes = local_boxes(spec, mesh, rank);
  int64_t total = 0;
  for (const Box& box : boxes) total += box.numel();
  const int64_t begin = spec.flat_begin, end = spec.flat_end < 0 ? total : spec.flat_end;
  if (end > total) {
    throw std::invalid_argument("tensor spec " + spec.str() + ": flat range beyond the " + std::to_string(total) +
                                " local elements of rank " + std::to_string(rank));
  }
  std::vector<Chunk> chunks;
  int64_t start = 0;  // of the current box in the local tensor
  for (const Box& box : boxes) {
    const int64_t lo = std::max(begin, start), hi = std::min(end, start + box.numel());
    if (lo < hi) chunks.push_back({box, lo - start, hi - start});
    start += box.numel();
  }
  return chunks;
}

bool writes_once(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank) {
  const std::vector<int> coordinate = mesh.coordinate(rank);
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    if (!spec.placements[i].is_shard() && coordinate[mesh.axis_index(spec.axes[i])] != 0) return false;
  }
  return true;
}

std::vector<int> balanced_owners(const std::vector<int64_t>& sizes, int owners) {
  std::vector<size_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  std::vector<int64_t> load(static_cast<size_t>(std::max(1, owners)), 0);
  std::vector<int> owner(sizes.size(), 0);
  for (size_t i : order) {
    const int least = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = least;
    load[least] += sizes[i];
  }
  return owner;
}

at::Tensor local_of(const at::Tensor& global, const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank) {
  std::vector<at::Tensor> pieces;
  for (const Box& box : local_boxes(spec, mesh, rank)) {
    at::Tensor piece = global;
    for (size_t d = 0; d < box.sizes.size(); ++d) piece = piece.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
    pieces.push_back(piece);
  }
  at::Tensor local = pieces.size() == 1 ? pieces.front().contiguous() : at::cat(pieces, 0);
  const std::vector<int> coordinate = mesh.coordinate(rank);
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    if (spec.placements[i].is_partial() && coordinate[mesh.axis_index(spec.axes[i])] != 0) local = at::zeros_like(local);
  }
  if (spec.flat_begin != 0 || spec.flat_end >= 0) {
    const int64_t end = spec.flat_end < 0 ? local.numel() : spec.flat_end;
    local = local.reshape({-1}).narrow(0, spec.flat_begin, end - spec.flat_begin);
  }
  return local.clone();
}

}  // namespace meshtrain::placement
