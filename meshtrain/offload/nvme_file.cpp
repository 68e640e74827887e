#include "meshtrain/offload/nvme_file.h"

#include "meshtrain/offload/host_memory.h"
#include "meshtrain/offload/tier.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>
#include <stdexcept>

namespace meshtrain::offload {

namespace {

std::runtime_error io_error(const std::string& path, const char* what, int64_t offset, int error) {
  return std::runtime_error("NVMe tier: " + std::string(what) + " " + path + " at offset " + std::to_string(offset) +
                            " failed: " + std::strerror(error) + " (check offload.nvme_dir: a writable local disk)");
}

}  // namespace

NvmeFile::NvmeFile(std::string path, NvmeOptions options) : path_(std::move(path)), options_(std::move(options)) {
  if (options_.engine != "io_uring" && options_.engine != "pread") {
    throw std::invalid_argument("NVMe engine \"" + options_.engine + "\": must be \"io_uring\" or \"pread\"");
  }
  options_.chunk_bytes = round_up(std::max<int64_t>(options_.chunk_bytes, kIoAlignment));
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd_ < 0 && errno == EINVAL) {
    direct_ = false;
    std::fprintf(stderr, "warning: %s: the file system refuses O_DIRECT; NVMe tier I/O goes through the page cache\n",
                 path_.c_str());
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  }
  if (fd_ < 0) throw io_error(path_, "creating", 0, errno);
  if (options_.engine == "io_uring") {
    ring_ = new io_uring;
    const int error = io_uring_queue_init(static_cast<unsigned>(std::max(options_.queue_depth, 1)), ring_, 0);
    if (error < 0) {
      delete ring_;
      ring_ = nullptr;
      options_.engine = "pread";
      std::fprintf(stderr, "warning: io_uring unavailable (%s); NVMe tier I/O uses pread/pwrite\n",
                   std::strerror(-error));
    }
  }
}

NvmeFile::~NvmeFile() {
  if (ring_ != nullptr) {
    io_uring_queue_exit(ring_);
    delete ring_;
  }
  if (fd_ >= 0) ::close(fd_);
  ::unlink(path_.c_str());
  count_resident(Tier::kNvme, -size_);
}

int64_t NvmeFile::allocate(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t offset = size_;
  const int64_t rounded = round_up(bytes);
  if (::ftruncate(fd_, offset + rounded) != 0) throw io_error(path_, "growing", offset, errno);
  size_ += rounded;
  count_resident(Tier::kNvme, rounded);
  return offset;
}

void NvmeFile::read(int64_t offset, void* data, int64_t bytes) {
  transfer(false, offset, static_cast<char*>(data), bytes);
  count_read(Tier::kNvme, bytes);
}

void NvmeFile::write(int64_t offset, const void* data, int64_t bytes) {
  transfer(true, offset, static_cast<char*>(const_cast<void*>(data)), bytes);
  count_written(Tier::kNvme, bytes);
}

void NvmeFile::transfer(bool write, int64_t offset, char* data, int64_t bytes) {
  if (direct_ && (offset % kIoAlignment != 0 || bytes % kIoAlignment != 0 ||
                  reinterpret_cast<uintptr_t>(data) % kIoAlignment != 0)) {
    throw std::invalid_argument("NVMe tier: O_DIRECT I/O needs offset, size and buffer aligned to 4096 bytes");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (ring_ != nullptr) {
    transfer_uring(write, offset, data, bytes);
  } else {
    transfer_pread(write, offset, data, bytes);
  }
}

void NvmeFile::transfer_pread(bool write, int64_t offset, char* data, int64_t bytes) {
  int64_t done = 0;
  while (done < bytes) {
    const size_t n = static_cast<size_t>(std::min(options_.chunk_bytes, bytes - done));
    const ssize_t got = write ? ::pwrite(fd_, data + done, n, offset + done) : ::pread(fd_, data + done, n, offset + done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw io_error(path_, write ? "writing" : "reading", offset + done, got < 0 ? errno : EIO);
    done += got;
  }
}

// Chunks go out `queue_depth` at a time; each completion is checked and a
// short transfer resubmits its remainder.
void NvmeFile::transfer_uring(bool write, int64_t offset, char* data, int64_t bytes) {
  struct Request {
    int64_t at, left;
  };
  std::vector<Request> requests;
  for (int64_t at = 0; at < bytes; at += options_.chunk_bytes) requests.push_back({at, std::min(options_.chunk_bytes, bytes - at)});
  size_t next = 0;
  int in_flight = 0;
  auto submit = [&](size_t index) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring_);
    const Request& r = requests[index];
    if (write) {
      io_uring_prep_write(sqe, fd_, data + r.at, static_cast<unsigned>(r.left), static_cast<__u64>(offset + r.at));
    } else {
      io_uring_prep_read(sqe, fd_, data + r.at, static_cast<unsigned>(r.left), static_cast<__u64>(offset + r.at));
    }
    io_uring_sqe_set_data64(sqe, index);
    ++in_flight;
  };
  // On an error nothing more is submitted, but what is in flight is reaped
  // before throwing: the kernel may still be writing into `data`.
  std::exception_ptr failure;
  while ((next < requests.size() && !failure) || in_flight > 0) {
    while (!failure && next < requests.size() && in_flight < options_.queue_depth) submit(next++);
    const int submitted = io_uring_submit(ring_);
    if (submitted < 0 && !failure) failure = std::make_exception_ptr(io_error(path_, "submitting I/O for", offset, -submitted));
    io_uring_cqe* cqe = nullptr;
    const int error = io_uring_wait_cqe(ring_, &cqe);
    if (error == -EINTR) continue;
    if (error < 0) throw io_error(path_, "waiting for I/O on", offset, -error);
    const size_t index = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
    const int result = cqe->res;
    io_uring_cqe_seen(ring_, cqe);
    --in_flight;
    Request& r = requests[index];
    if (result <= 0) {
      if (!failure) failure = std::make_exception_ptr(io_error(path_, write ? "writing" : "reading", offset + r.at, result < 0 ? -result : EIO));
      continue;
    }
    r.at += result;
    r.left -= result;
    if (r.left > 0 && !failure) submit(index);
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace meshtrain::offload
