// One file on a local disk (NVMe) holding the NVMe tier's regions, read and
// written with O_DIRECT (past the page cache) through io_uring, several
// chunks in flight at once. See Note [Tiered store].
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

struct io_uring;

namespace meshtrain::offload {

struct NvmeOptions {
  int queue_depth = 16;              // chunks in flight
  int64_t chunk_bytes = 1 << 20;     // each read or write request
  std::string engine = "io_uring";   // "io_uring" | "pread" (blocking preads/pwrites, one chunk at a time)
};

class NvmeFile {
 public:
  // Creates `path` (truncated) and removes it on destruction. Falls back to
  // buffered I/O, with a warning, where the file system refuses O_DIRECT
  // (tmpfs), and to "pread" where io_uring cannot be set up.
  explicit NvmeFile(std::string path, NvmeOptions options = {});
  ~NvmeFile();
  NvmeFile(const NvmeFile&) = delete;
  NvmeFile& operator=(const NvmeFile&) = delete;

  // A new region of `bytes` (rounded up to kIoAlignment): its offset.
  int64_t allocate(int64_t bytes);
  // Blocking; `data` and `bytes` aligned to kIoAlignment. Thread-safe (one
  // request stream at a time). Throws std::runtime_error naming the file,
  // offset and error.
  void read(int64_t offset, void* data, int64_t bytes);
  void write(int64_t offset, const void* data, int64_t bytes);

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  const std::string& engine() const { return options_.engine; }
  int64_t size() const { return size_; }

 private:
  void transfer(bool write, int64_t offset, char* data, int64_t bytes);
  void transfer_uring(bool write, int64_t offset, char* data, int64_t bytes);
  void transfer_pread(bool write, int64_t offset, char* data, int64_t bytes);

  std::string path_;
  NvmeOptions options_;
  int fd_ = -1;
  bool direct_ = true;
  io_uring* ring_ = nullptr;
  std::mutex mutex_;
  int64_t size_ = 0;
};

}  // namespace meshtrain::offload
