// Checkpoints v1: the whole training state in one directory per step, written
// atomically, verified on load. See Note [Checkpoint atomicity].
#pragma once

#include "meshtrain/comm/communicator.h"

#include <torch/torch.h>

#include <functional>
#include <map>
#include <vector>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace meshtrain::train {

// A checkpoint that cannot be used: the message names the file and the problem.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Note [Checkpoint atomicity]
// save() writes every file into DIR/.incomplete-step-N, records each file's
// size and FNV-1a checksum in MANIFEST.json (written last), fsyncs, renames the
// folder to DIR/step-N, and only then points DIR/latest at it (write
// latest.tmp, fsync, rename). A crash at any moment leaves DIR/latest naming a
// complete checkpoint; older ones are pruned after the new one is in place.
// load() checks the manifest before reading, so a truncated or altered file is
// refused with its name. The environment variable
// MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER=<file> makes save() fail right after
// writing that file (for the tests that simulate a crash mid-save).
struct CheckpointMeta {
  int64_t step = 0;     // optimizer steps completed
  int64_t cursor = 0;   // sampler stream position of the next batch
  std::string model;    // a fingerprint of the model shape, checked on load
  std::string model_config;  // the model's GptConfig as JSON (see model_config_to_json)
  std::string layout;        // sharded checkpoints: the layout their shard files need ("" otherwise)
};

// A model.pt as save() writes it: parameters by name, buffers as "buffer.NAME",
// the CPU generator's state.
void write_model_archive(const std::string& path, const std::map<std::string, at::Tensor>& parameters,
                         const std::map<std::string, at::Tensor>& buffers);

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, int64_t keep);

  // Writes model parameters and buffers, the optimizer state, the default CPU
  // generator's state and `meta`. Call on one rank (the state is replicated).
  void save(const CheckpointMeta& meta, torch::nn::Module& model, torch::optim::Optimizer& optimizer) const;
  // Collective over `comm` (sharded states): every rank writes its own files
  // into the staging folder given to `write`, which returns their names; each
  // file's size and checksum, taken by the rank that wrote it, go into the
  // manifest, which rank 0 writes before publishing as save() does. A failure
  // on any rank fails the save on every rank and leaves earlier checkpoints as
  // they were.
  void save_collective(const CheckpointMeta& meta, comm::Communicator& comm,
                       const std::function<std::vector<std::string>(const std::string& staging)>& write) const;
  // The newest complete checkpoint folder, or "" when there is none.
  std::string latest() const;
  // The manifest of a checkpoint folder, verified (files present, sizes and checksums).
  static CheckpointMeta read_meta(const std::string& folder);
  // Verifies and loads a checkpoint folder into model (and optimizer, if given);
  // restores the CPU generator state. Throws CheckpointError on any mismatch.
  CheckpointMeta load(const std::string& folder, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                      const std::string& expected_model) const;

  const std::string& dir() const { return dir_; }

 private:
  std::string staging_path(int64_t step) const;     // DIR/.incomplete-step-N
  std::string prepare_staging(int64_t step) const;  // staging_path(step), fresh and empty
  // Writes the manifest (`files`: JSON object of file -> size and checksum), renames, points `latest`, prunes.
  void publish(const CheckpointMeta& meta, const std::string& staging, const std::string& files) const;

  std::string dir_;
  int64_t keep_;
};

}  // namespace meshtrain::train
