// CheckpointWriter: every rank writes the chunks it owns of the training
// state, once, in the background when asked; rank 0 writes the metadata and
// publishes the folder. See Note [Checkpoint format].
#pragma once

#include "meshtrain/checkpoint/format.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/mesh_layout.h"
#include "meshtrain/placement/state_tensor.h"

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::checkpoint {

// Note [Asynchronous save]
// save() takes a snapshot first: a host copy of this rank's chunks (the
// entries it writes), so training may change the live tensors at once. The
// snapshot is written by a thread of this writer, which talks to the other
// ranks on a communicator of its own (split at construction), so the
// training's collectives and the save's never interleave on one
// communicator. At most one save is in flight: the next save() (or wait())
// waits for it first, so memory holds at most one snapshot — a copy of what
// this rank saves. A failure on any rank fails the save on every rank
// (agreed over the writer's communicator) and leaves `latest` where it was;
// wait() rethrows it.
class CheckpointWriter {
 public:
  // Collective over `world`. Checksums cover `block_bytes` each (the unit a
  // reader verifies, so the least it reads of a chunk).
  // `local`: a local checkpoint (Note [Local checkpoints]).
  CheckpointWriter(CheckpointStore store, const std::shared_ptr<comm::Communicator>& world, bool async,
                   int64_t block_bytes = kBlockBytes, bool local = false);
  ~CheckpointWriter();  // waits for a save in flight (its error is lost: call wait() first)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Collective: saves `state` (laid out on `layout`, this rank `rank`) as
  // checkpoint `meta.step`, with `meta`'s fields; meta.tensors is filled here.
  void save(Metadata meta, const placement::TrainingState& state, const mesh::MeshLayout& layout);
  // Waits for the save in flight, if any, and throws its error. Collective then.
  void wait();
  bool in_flight() const { return thread_.joinable(); }
  // A save was started and has ended (wait() then returns at once, or throws its error).
  bool finished() const { return thread_.joinable() && done_.load(); }

  const CheckpointStore& store() const { return store_; }
  // Of the last save: seconds the caller was blocked (snapshot, or all of a
  // synchronous save) and seconds writing took; bytes this rank wrote.
  double last_blocking_seconds() const { return blocking_seconds_; }
  double last_write_seconds() const { return write_seconds_; }
  // All of the last save, as a synchronous save would take it (0 before any).
  double last_save_seconds() const { return async_ ? blocking_seconds_ + write_seconds_ : blocking_seconds_; }
  int64_t last_bytes() const { return bytes_; }

 private:
  struct Snapshot;
  void write(const Snapshot& snapshot);
  void write_files(const Snapshot& snapshot, const std::string& staging);
  // Collective: this save's bytes on this rank and on all; refuses a save the disk cannot hold.
  void check_space(Snapshot& snapshot);
  std::string space_advice(const Snapshot& snapshot) const;

  // Whether this rank prepares and publishes the folder: rank 0, or in a local
  // checkpoint the first rank of each host.
  bool publishes() const { return local_ ? host_leader_ : comm_->rank() == 0; }

  CheckpointStore store_;
  std::shared_ptr<comm::Communicator> comm_;
  bool async_;
  bool local_ = false;
  std::vector<std::string> hosts_;  // local: each rank's host name
  bool host_leader_ = false;
  int64_t block_bytes_;
  std::thread thread_;
  std::exception_ptr error_;
  std::atomic<bool> done_{false};
  double blocking_seconds_ = 0, write_seconds_ = 0;
  int64_t bytes_ = 0;
};

std::string rank_file_name(int rank);  // "rank-00003.bin"
// A stored dtype by its name (comm::dtype_name); throws CheckpointError for
// names checkpoints do not store.
at::ScalarType stored_dtype(const std::string& name);

}  // namespace meshtrain::checkpoint
