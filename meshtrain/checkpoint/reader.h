// CheckpointReader: loads a checkpoint into any layout, reading on each rank
// only the blocks of the chunks that overlap what it holds.
#pragma once

#include "meshtrain/checkpoint/format.h"
#include "meshtrain/mesh/mesh_layout.h"
#include "meshtrain/placement/state_tensor.h"

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace meshtrain::checkpoint {

class CheckpointReader {
 public:
  // Verifies the folder's manifest and reads its metadata (CheckpointStore::read_metadata).
  explicit CheckpointReader(std::string folder);
  ~CheckpointReader();

  const Metadata& metadata() const { return metadata_; }
  const std::string& folder() const { return folder_; }

  // Fills every entry of `state` (laid out on `layout`, this process being
  // `rank`) whose name `wanted` accepts from the chunks that overlap it,
  // converting dtypes; checks the checksum of every block it reads; of the
  // copies a local checkpoint holds of a chunk, reads one on this host. Throws
  // CheckpointError naming the tensor or file: a tensor missing, of another
  // shape, elements no chunk holds, a block whose checksum differs.
  void load(const placement::TrainingState& state, const mesh::MeshLayout& layout, int rank,
            const std::function<bool(const std::string&)>& wanted = {});
  // A whole tensor, in its saved dtype.
  at::Tensor read(const std::string& name);

  int64_t bytes_read() const { return bytes_read_; }

 private:
  // The saved chunk's elements [first, last) as a tensor of its dtype
  // (blocks read whole and verified).
  at::Tensor read_elements(const TensorEntry& tensor, const ChunkEntry& chunk, int64_t first, int64_t last);
  const TensorEntry& entry(const std::string& name) const;
  // Whether this host holds `file` (a local checkpoint holds each host's files on that host only).
  bool here(const std::string& file);

  std::string folder_;
  Metadata metadata_;
  std::map<std::string, int> files_;  // open descriptors by file name
  std::map<std::string, bool> present_;  // here(), by file name
  int64_t bytes_read_ = 0;
};

}  // namespace meshtrain::checkpoint
