// Placements: where the pieces of a tensor live on a device mesh. A tensor
// has a global shape; along each mesh axis it is spread over, it is
// Replicate (every coordinate holds the same), Shard(dim) (each coordinate
// holds one chunk of `dim`, uneven chunks allowed) or Partial (the global
// value is the sum over the axis). Flat buffers (FSDP) add a range of the
// local elements. See Note [Placements].
#pragma once

#include "meshtrain/mesh/mesh_layout.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::placement {

// Note [Placements]
// - Chunks are balanced: `size` split into `parts` gives the first size % parts
//   chunks one element more than the others (some may be empty).
// - Nesting: a spec lists its mesh axes outermost first; each Shard splits the
//   extent the axes before it left (as DTensor: Shard(0) on axes a then b cuts
//   dim 0 into a-chunks, each into b-chunks).
// - Shard(dim, blocks): `dim` is `blocks` equal consecutive blocks, each split
//   alike, and a coordinate holds its chunk of every block, concatenated (the
//   q, k and v rows of a fused qkv projection split over tensor parallel).
//   Such a dim is split by one axis only.
// - A coordinate's local tensor is a list of boxes of the global tensor
//   (one, or `blocks`), concatenated along the split dim. A flat range keeps
//   elements [begin, end) of the local tensor in row-major order: an FSDP
//   rank's share of a parameter inside its unit's flat buffer. local_chunks()
//   turns both into pieces of single boxes, which is what checkpoints store.
struct Placement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;     // kShard
  int64_t blocks = 1;  // kShard

  static Placement replicate() { return {}; }
  static Placement shard(int64_t dim, int64_t blocks = 1) { return {Kind::kShard, dim, blocks}; }
  static Placement partial() { return {Kind::kPartial, 0, 1}; }
  bool is_replicate() const { return kind == Kind::kReplicate; }
  bool is_shard() const { return kind == Kind::kShard; }
  bool is_shard(int64_t d) const { return kind == Kind::kShard && dim == d; }
  bool is_partial() const { return kind == Kind::kPartial; }
  std::string str() const;  // "R", "S(1)", "S(0)x3", "P"
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::kShard || (dim == o.dim && blocks == o.blocks));
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
};

// Sizes and offsets of a balanced split of `size` into `parts`.
std::vector<int64_t> chunk_sizes(int64_t size, int64_t parts);
int64_t chunk_offset(int64_t size, int64_t parts, int64_t index);

// A box of a global tensor: per dim an offset and a size.
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

// Elements [begin, end) of a box in row-major order.
struct Chunk {
  Box box;
  int64_t begin = 0, end = 0;
  int64_t numel() const { return end - begin; }
};

// How a tensor is laid out on a mesh.
struct TensorSpec {
  std::vector<int64_t> shape;           // global
  std::vector<std::string> axes;        // mesh axes it is spread over, outermost first
  std::vector<Placement> placements;    // one per axis
  // Elements [flat_begin, flat_end) of the local tensor (flat_end < 0: all).
  int64_t flat_begin = 0, flat_end = -1;

  // Throws std::invalid_argument naming what is wrong (dim out of range,
  // blocks that do not divide, a blocks-split dim split twice, sizes).
  void check(const mesh::MeshLayout& mesh) const;
  std::string str() const;  // "[768, 256] tp:S(0)x3 dp:R"
};

// The boxes `rank` holds before any flat range, in local order.
std::vector<Box> local_boxes(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank);
// The shape of that local tensor (boxes concatenated along their split dim).
std::vector<int64_t> local_shape(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank);
// What `rank` holds as single-box pieces, flat range applied, in local order.
std::vector<Chunk> local_chunks(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank);
// Whether `rank` is the one coordinate that saves its chunks: coordinate 0 on
// every Replicate (and Partial) axis of the spec.
bool writes_once(const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank);

// Which of `owners` ranks saves each of several pieces that all of them hold
// alike, balancing bytes: largest first, each to the least loaded (the same
// answer on every rank for the same sizes).
std::vector<int> balanced_owners(const std::vector<int64_t>& sizes, int owners);

// The local tensor of `rank` cut out of the global value `global` (Partial
// axes: coordinate 0 holds the value, the others zeros).
at::Tensor local_of(const at::Tensor& global, const TensorSpec& spec, const mesh::MeshLayout& mesh, int rank);

}  // namespace meshtrain::placement
