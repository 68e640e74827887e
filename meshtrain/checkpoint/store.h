// CheckpointStore: the folders of a checkpoint directory — staging, publishing
// atomically, the `latest` pointer, pruning — and verifying a folder before
// it is read. See Note [Checkpoint atomicity].
#pragma once

#include "meshtrain/checkpoint/format.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::checkpoint {

// Note [Checkpoint atomicity]
// Every file of step N is written into DIR/.incomplete-step-N; MANIFEST.json
// (each file's size, metadata.json's checksum) is written last; the folder is
// synced and renamed to DIR/step-N, and only then DIR/latest is pointed at it
// (latest.tmp written, synced, renamed). A crash at any moment leaves
// DIR/latest naming a complete checkpoint; older ones are pruned (keeping
// `keep`) after the new one is in place, stale staging folders with them.
// The environment variable MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER=<file> makes a
// save fail right after writing that file (tests simulating a crash).
class CheckpointStore {
 public:
  CheckpointStore(std::string dir, int64_t keep);

  const std::string& dir() const { return dir_; }
  std::string staging_path(int64_t step) const;     // DIR/.incomplete-step-N
  std::string prepare_staging(int64_t step) const;  // that folder, fresh and empty
  // Writes the manifest of every file in `staging`, renames it to step-N,
  // points `latest` at it and (unless `prune_after` is false) prunes. Throws CheckpointError.
  void publish(int64_t step, const std::string& staging, bool prune_after = true) const;
  // Keeps the newest `keep` complete checkpoints and step `step`'s; drops stale staging folders.
  void prune(int64_t step) const;
  // The folder `latest` names, or "" when there is none. Throws when the
  // pointer is malformed or names a missing folder.
  std::string latest() const;
  // Every complete-looking step folder, newest first.
  std::vector<std::string> complete() const;

  // Checks a folder's manifest: present, every file there with its size,
  // metadata.json with its checksum. Throws CheckpointError naming the file.
  static void verify(const std::string& folder);
  // verify(), then the metadata.
  static Metadata read_metadata(const std::string& folder);
  // A checkpoint folder as given, or the latest of a checkpoint directory.
  static std::string resolve(const std::string& path);

 private:
  std::string dir_;
  int64_t keep_;
};

std::string step_folder_name(int64_t step);  // "step-00000100"
// Throws CheckpointError when MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER names `file`.
void maybe_fail_after(const std::string& file);

}  // namespace meshtrain::checkpoint
