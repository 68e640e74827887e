// The distributed checkpoint format (version 2): what is in a checkpoint
// folder and how its metadata maps every tensor's chunks to bytes in files.
// See Note [Checkpoint format].
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::checkpoint {

// A checkpoint that cannot be used: the message names the file and the problem.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Note [Checkpoint format]
// A checkpoint is a folder DIR/step-NNNNNNNN holding
//   metadata.json   (format 2) the step, the data cursor, the model (a
//                   fingerprint and its config), the layout it was saved
//                   with (ParallelDims::str() and the world size), and for
//                   every tensor its global shape, dtype and chunks;
//   rank-RRRRR.bin  each writing rank's chunks back to back, raw, in the
//                   tensor's dtype (native byte order);
//   MANIFEST.json   written last: every file's size, and metadata.json's checksum.
// A chunk is a box of the tensor (offsets and sizes per dim) and the range
// [begin, end) of the box's elements in row-major order it holds (all of
// them, or an FSDP rank's share); it lives at bytes [offset, offset + bytes)
// of `file`, with a 64-bit checksum of every 1 MiB block (block_bytes) of it.
// Chunks of one tensor never overlap: what several ranks hold alike was
// written once; except in a local checkpoint (Note [Local checkpoints]),
// where each rank writes all it holds, so a chunk may be there several
// times, alike, in files on different hosts; a reader uses one of them.
// Names: "model/PARAM" (fp32 parameters), "optim/PARAM/exp_avg" and
// ".../exp_avg_sq" (AdamW; its step count is the checkpoint's step),
// "rng/cpu" and "rng/tensor_parallel" (one row per rank).
// Loading plans from the metadata alone: each rank reads the blocks of the
// chunks that overlap what it holds in its own layout, and verifies their
// checksums. DIR/latest names the newest complete checkpoint; see
// Note [Checkpoint atomicity] (store.h).
constexpr int kFormat = 2;
constexpr int64_t kBlockBytes = int64_t{1} << 20;

struct ChunkEntry {
  std::vector<int64_t> offsets, sizes;  // the box
  int64_t begin = 0, end = 0;           // elements of the box, row-major
  std::string file;
  int64_t offset = 0, bytes = 0;        // in the file
  int64_t block_bytes = kBlockBytes;
  std::vector<uint64_t> checksums;      // one per block
  int64_t numel() const { return end - begin; }
};

struct TensorEntry {
  std::vector<int64_t> shape;
  std::string dtype;  // "float32", "uint8", ...
  std::vector<ChunkEntry> chunks;
  int64_t numel() const;
};

struct Metadata {
  int format = kFormat;
  int64_t step = 0;
  int64_t cursor = 0;          // the data stream position of the next batch
  std::string model;           // a fingerprint of the model shape, checked on load
  std::string model_config;    // the model's config as JSON
  std::string layout;          // ParallelDims::str() of the saving run
  int64_t world = 1;           // its world size
  std::string tokenizer;       // text::tokenizer_to_json of the training's tokenizer ("": bytes)
  std::string source;          // the Hugging Face model folder it was imported from ("": trained here)
  std::map<std::string, TensorEntry> tensors;
  // A local checkpoint's files and the hosts that hold them (empty: every file is in the folder).
  std::map<std::string, std::string> hosts;

  std::string to_json() const;
  // Throws CheckpointError naming `where` for anything missing or malformed.
  static Metadata from_json(const std::string& text, const std::string& where);
};

// 64-bit checksum of `bytes` bytes (four FNV-1a lanes over 8-byte words, folded, then the tail).
uint64_t checksum(const void* data, int64_t bytes);
std::string hex(uint64_t value);

}  // namespace meshtrain::checkpoint
