#include "meshtrain/checkpoint/writer.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/util/files.h"

#include <ATen/core/grad_mode.h>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>

namespace meshtrain::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSpaceAdvice[] = "Free space, keep fewer (checkpoint.keep), or set checkpoint.dir to a larger disk";

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Appends to a file with write(2), reporting errors with the path.
class RawFile {
 public:
  explicit RawFile(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644)) {
    if (fd_ < 0) throw CheckpointError("cannot create checkpoint file " + path + ": " + std::strerror(errno));
  }
  ~RawFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const void* data, int64_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, static_cast<size_t>(std::min<int64_t>(bytes, int64_t{1} << 30)));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw CheckpointError("cannot write checkpoint file " + path_ + ": " + std::strerror(errno));
      p += n;
      bytes -= n;
      size_ += n;
    }
  }
  void close_synced() {
    if (::fsync(fd_) != 0) throw CheckpointError("cannot sync checkpoint file " + path_ + ": " + std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
  }
  int64_t size() const { return size_; }

 private:
  std::string path_;
  int fd_;
  int64_t size_ = 0;
};

}  // namespace

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  return name;
}

namespace {

constexpr at::ScalarType kStoredDtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                            at::kByte,  at::kLong,   at::kInt};

std::string stored_name(at::ScalarType type) {
  for (at::ScalarType t : kStoredDtypes) {
    if (t == type) return comm::dtype_name(t);
  }
  throw CheckpointError("checkpoints do not store dtype " + comm::dtype_name(type));
}

}  // namespace

at::ScalarType stored_dtype(const std::string& name) {
  for (at::ScalarType t : kStoredDtypes) {
    if (comm::dtype_name(t) == name) return t;
  }
  throw CheckpointError("unknown dtype '" + name + "' in a checkpoint");
}

// What this rank writes, copied off the live tensors.
struct CheckpointWriter::Snapshot {
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<placement::Chunk> chunks;
    at::Tensor data;  // the chunks' elements in order, on the host
  };
  Metadata meta;
  std::vector<Tensor> tensors;
  int64_t bytes = 0;        // this rank's file
  int64_t total_bytes = 0;  // every rank's files
  int64_t host_bytes = 0;   // local: the files of this rank's host
};

// Note [Local checkpoints]
// With checkpoint.local = true, checkpoint.dir is a disk of each host's own
// (a node-local NVMe), not a shared file system. The first rank of each host
// stages, publishes and prunes the folder on its disk, as rank 0 does for a
// shared one (Note [Checkpoint atomicity]); every rank writes its file there.
// Each rank writes all it holds, replicas included, so that a resume on the
// same hosts in the same layout reads only its own host's files; the cost is
// a replica's bytes once per host. Every host's metadata.json is the whole
// one, with a "hosts" map naming the host that holds each file; its
// MANIFEST.json lists the files on that host. A reader reads, of a chunk's
// copies, one on its own host and names the files on other hosts when what
// it needs is only there. On resume the ranks agree on the newest step every
// host holds complete (a crash between two hosts' publications leaves them a
// step apart); older steps are pruned only once every host has published
// (so a save that fails on one host leaves a step all of them hold), and a
// step rank 0's host has that the others lack is an error, never a fresh
// start. `meshtrain checkpoint gather` copies a local checkpoint's files
// from every host into one folder, which any layout can read.

namespace {

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

}  // namespace

CheckpointWriter::CheckpointWriter(CheckpointStore store, const std::shared_ptr<comm::Communicator>& world, bool async,
                                   int64_t block_bytes, bool local)
    : store_(std::move(store)), comm_(world->split(0, world->rank(), "checkpoint")), async_(async), local_(local),
      block_bytes_(block_bytes) {
  if (block_bytes_ < 1) throw std::invalid_argument("checkpoint writer: block_bytes must be positive");
  if (!local_) return;
  hosts_ = comm::all_gather_strings(*comm_, this_host());
  host_leader_ = std::find(hosts_.begin(), hosts_.end(), hosts_[comm_->rank()]) - hosts_.begin() == comm_->rank();
}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::save(Metadata meta, const placement::TrainingState& state, const mesh::MeshLayout& layout) {
  wait();
  const auto start = Clock::now();
  auto snapshot = std::make_shared<Snapshot>();
  snapshot->meta = std::move(meta);
  {
    at::NoGradGuard no_grad;
    for (const placement::StateTensor& t : state) {
      if (!t.write && !local_) continue;  // a replica another rank writes (local: each host writes its own)
      Snapshot::Tensor copy{t.name, t.spec.shape, placement::local_chunks(t.spec, layout, comm_->rank()), {}};
      copy.data = t.local.detach().reshape({-1}).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      snapshot->tensors.push_back(std::move(copy));
    }
  }
  check_space(*snapshot);
  if (!async_) {
    write(*snapshot);
    blocking_seconds_ = seconds_since(start);
    return;
  }
  blocking_seconds_ = seconds_since(start);
  done_ = false;
  thread_ = std::thread([this, snapshot] {
    try {
      write(*snapshot);
    } catch (...) {
      error_ = std::current_exception();
    }
    done_ = true;
  });
}

void CheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

// Note [Failed saves]
// A save can fail part-way: a disk fills, a quota is reached, a file system
// goes read-only. Before it writes, every rank checks that the free space
// where the checkpoints go holds its file (rank 0: every rank's files, for a
// shared file system), and a save that cannot fit is refused with the bytes
// it needs, having written nothing. A save that fails anyway removes what it
// wrote (each rank its file, rank 0 the staging folder), so the disk is left
// as it was before the save began; `latest` and the older checkpoints are
// untouched. The error says the bytes needed and what to do.

void CheckpointWriter::check_space(Snapshot& snapshot) {
  for (const Snapshot::Tensor& t : snapshot.tensors) snapshot.bytes += t.data.numel() * t.data.element_size();
  const std::vector<std::string> all = comm::all_gather_strings(*comm_, std::to_string(snapshot.bytes));
  snapshot.total_bytes = 0;
  snapshot.host_bytes = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    snapshot.total_bytes += std::stoll(all[r]);
    if (local_ && hosts_[r] == hosts_[comm_->rank()]) snapshot.host_bytes += std::stoll(all[r]);
  }
  comm::on_all_or_all_fail(*comm_, [&] {
    struct statvfs fs {};
    if (statvfs(store_.dir().c_str(), &fs) != 0) return;  // not there yet: the save says what fails
    const int64_t free = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    const int64_t needed = !publishes() ? snapshot.bytes : local_ ? snapshot.host_bytes : snapshot.total_bytes;
    if (needed <= free) return;
    char text[128];
    std::snprintf(text, sizeof text, "; %.1f MiB are free there: nothing was written",
                  free / 1048576.0);
    throw CheckpointError(space_advice(snapshot).insert(0, "cannot save") + text +
                          ", the checkpoints before it are kept. " + kSpaceAdvice);
  });
}

std::string CheckpointWriter::space_advice(const Snapshot& snapshot) const {
  char text[256];
  std::snprintf(text, sizeof text, " checkpoint step %lld: it needs %.1f MiB in %s%s (%.1f MiB of it this rank's file)",
                (long long)snapshot.meta.step, (local_ ? snapshot.host_bytes : snapshot.total_bytes) / 1048576.0,
                store_.dir().c_str(), local_ ? " on this host" : "", snapshot.bytes / 1048576.0);
  return text;
}

void CheckpointWriter::write(const Snapshot& snapshot) {
  const std::string staging = store_.staging_path(snapshot.meta.step);
  try {
    write_files(snapshot, staging);
  } catch (const std::exception& e) {
    ::unlink(util::join_path(staging, rank_file_name(comm_->rank())).c_str());
    if (publishes()) {
      try {
        util::remove_tree(staging);
      } catch (const std::runtime_error&) {
        // Said below as part of the failure; the next save clears stale staging folders.
      }
    }
    const std::string cause = e.what();
    const bool space = cause.find("No space left") != std::string::npos || cause.find("quota") != std::string::npos ||
                       cause.find("File too large") != std::string::npos;
    const std::string what = cause + ";" + space_advice(snapshot) + "; its partial files are removed" +
                             (space ? std::string(", the checkpoints before it are kept. ") + kSpaceAdvice : "");
    if (dynamic_cast<const comm::AgreedError*>(&e)) throw comm::AgreedError(what);
    throw CheckpointError(what);
  }
}

void CheckpointWriter::write_files(const Snapshot& snapshot, const std::string& staging) {
  const auto start = Clock::now();
  const int64_t step = snapshot.meta.step;
  // Rank 0 prepares the staging folder (local: each host's first rank); a failure fails the save on every rank.
  const auto on_publishers = [&](const std::function<void()>& work) {
    if (local_) {
      comm::on_all_or_all_fail(*comm_, [&] {
        if (publishes()) work();
      });
    } else {
      comm::on_root_or_all_fail(*comm_, 0, work);
    }
  };
  on_publishers([&] { store_.prepare_staging(step); });
  // This rank's file: every chunk's bytes back to back, block checksums.
  Metadata mine = snapshot.meta;
  int64_t written = 0;
  comm::on_all_or_all_fail(*comm_, [&] {
    if (snapshot.tensors.empty()) return;
    const std::string file = rank_file_name(comm_->rank());
    RawFile out(util::join_path(staging, file));
    for (const Snapshot::Tensor& t : snapshot.tensors) {
      TensorEntry& entry = mine.tensors[t.name];
      entry.shape = t.shape;
      entry.dtype = stored_name(t.data.scalar_type());
      const char* bytes = static_cast<const char*>(t.data.data_ptr());
      const int64_t element = t.data.element_size();
      int64_t consumed = 0;
      for (const placement::Chunk& c : t.chunks) {
        ChunkEntry chunk;
        chunk.offsets = c.box.offsets;
        chunk.sizes = c.box.sizes;
        chunk.begin = c.begin;
        chunk.end = c.end;
        chunk.file = file;
        chunk.offset = out.size();
        chunk.bytes = c.numel() * element;
        chunk.block_bytes = block_bytes_;
        const char* data = bytes + consumed * element;
        for (int64_t b = 0; b < chunk.bytes; b += chunk.block_bytes) {
          chunk.checksums.push_back(checksum(data + b, std::min(chunk.block_bytes, chunk.bytes - b)));
        }
        out.append(data, chunk.bytes);
        consumed += c.numel();
        entry.chunks.push_back(std::move(chunk));
      }
    }
    out.close_synced();
    written = out.size();
    maybe_fail_after(file);
  });
  // Rank 0 (local: each host's first rank) merges every rank's chunks into the metadata and publishes.
  const std::vector<std::string> all = comm::all_gather_strings(*comm_, mine.tensors.empty() ? "" : mine.to_json());
  on_publishers([&] {
    Metadata merged = snapshot.meta;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      const Metadata part = Metadata::from_json(all[r], "the chunk list of rank " + std::to_string(r));
      for (const auto& [name, entry] : part.tensors) {
        TensorEntry& target = merged.tensors[name];
        target.shape = entry.shape;
        target.dtype = entry.dtype;
        target.chunks.insert(target.chunks.end(), entry.chunks.begin(), entry.chunks.end());
      }
      if (local_) merged.hosts[rank_file_name(static_cast<int>(r))] = hosts_[r];
    }
    try {
      util::write_text_file(util::join_path(staging, "metadata.json"), merged.to_json());
    } catch (const std::runtime_error& e) {
      throw CheckpointError(e.what());
    }
    maybe_fail_after("metadata.json");
    store_.publish(step, staging, /*prune_after=*/!local_);
  });
  // Local: older checkpoints go only once every host holds this one, so a host
  // that failed to publish leaves a step that all of them still hold.
  if (local_) on_publishers([&] { store_.prune(step); });
  bytes_ = written;
  write_seconds_ = seconds_since(start);
}

}  // namespace meshtrain::checkpoint
