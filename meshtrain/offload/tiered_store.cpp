#include "meshtrain/offload/tiered_store.h"

#include "meshtrain/offload/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <stdexcept>

namespace meshtrain::offload {

void Ticket::wait() const {
  if (state_ == nullptr) return;
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Ticket::done() const {
  if (state_ == nullptr) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

TieredStore::TieredStore(StoreOptions options) : options_(std::move(options)) {
  if (options_.max_in_flight < 1) throw std::invalid_argument("tiered store: max_in_flight must be >= 1");
  worker_ = std::thread([this] { run(); });
}

TieredStore::~TieredStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

NvmeFile& TieredStore::nvme_file() {
  if (nvme_ == nullptr) {
    const std::string path =
        options_.nvme_dir + "/meshtrain-nvme-tier-" + std::to_string(::getpid()) + "-" +
        std::to_string(reinterpret_cast<uintptr_t>(this) % 1000003) + ".bin";
    nvme_ = std::make_unique<NvmeFile>(path, options_.nvme);
  }
  return *nvme_;
}

TieredStore::Id TieredStore::allocate(int64_t numel, at::ScalarType dtype, Tier tier) {
  if (tier == Tier::kDevice) throw std::invalid_argument("tiered store: slots live in the host or NVMe tier");
  Slot slot{tier, numel, dtype, {}, 0};
  if (tier == Tier::kHost) {
    slot.host = host_tensor(numel, dtype, options_.pinned);
  } else {
    slot.offset = nvme_file().allocate(std::max<int64_t>(slot.bytes(), 1));
    at::Tensor zeros = staging(round_up(slot.bytes()));
    std::memset(zeros.data_ptr(), 0, static_cast<size_t>(round_up(slot.bytes())));
    nvme_file().write(slot.offset, zeros.data_ptr(), round_up(slot.bytes()));
    release_staging(zeros);
  }
  slots_.push_back(std::move(slot));
  return slots_.size() - 1;
}

TieredStore::Id TieredStore::put(const at::Tensor& value, Tier tier) {
  const Id id = allocate(value.numel(), value.scalar_type(), tier);
  write(id, value.reshape({-1}));
  return id;
}

const at::Tensor& TieredStore::host(Id id) const {
  const Slot& slot = slots_.at(id);
  if (slot.tier != Tier::kHost) throw std::logic_error("tiered store: host() of a slot not in the host tier");
  return slot.host;
}

Ticket TieredStore::fetch(Id id, at::Tensor dst) {
  const Slot& slot = slots_.at(id);
  TORCH_CHECK(dst.is_contiguous() && dst.numel() == slot.numel && dst.scalar_type() == slot.dtype,
              "tiered store: fetch into a tensor of another size or dtype");
  return submit([this, &slot, dst] { copy_out(slot, dst); });
}

Ticket TieredStore::store(Id id, at::Tensor src) {
  const Slot& slot = slots_.at(id);
  TORCH_CHECK(src.numel() == slot.numel && src.scalar_type() == slot.dtype,
              "tiered store: store from a tensor of another size or dtype");
  return submit([this, &slot, src = src.contiguous()] { copy_in(slot, src); });
}

void TieredStore::read_range(Id id, int64_t offset, int64_t numel, const at::Tensor& host) {
  const Slot& slot = slots_.at(id);
  const int64_t element = static_cast<int64_t>(c10::elementSize(slot.dtype));
  TORCH_CHECK(slot.tier == Tier::kNvme && offset + numel <= slot.numel, "tiered store: read_range out of the slot");
  nvme_file().read(slot.offset + offset * element, host.data_ptr(), round_up(numel * element));
}

void TieredStore::write_range(Id id, int64_t offset, int64_t numel, const at::Tensor& host) {
  const Slot& slot = slots_.at(id);
  const int64_t element = static_cast<int64_t>(c10::elementSize(slot.dtype));
  TORCH_CHECK(slot.tier == Tier::kNvme && offset + numel <= slot.numel, "tiered store: write_range out of the slot");
  // The rounded tail lands in the slot's own padding or in the next range, which its own write then sets.
  nvme_file().write(slot.offset + offset * element, host.data_ptr(), round_up(numel * element));
}

void TieredStore::copy_out(const Slot& slot, const at::Tensor& dst) {
  if (slot.tier == Tier::kHost) {
    dst.view({-1}).copy_(slot.host.view({-1}), /*non_blocking=*/false);
    count_read(Tier::kHost, slot.bytes());
    return;
  }
  // In pieces: piece i is copied out (on a helper thread) while this thread,
  // which owns the I/O, reads piece i + 1.
  const int64_t bytes = slot.bytes(), total = round_up(bytes);
  constexpr int64_t kPiece = int64_t{32} << 20;  // 32 requests: the queue stays full
  at::Tensor buffer = staging(total);
  uint8_t* base = buffer.data_ptr<uint8_t>();
  const at::Tensor out = dst.view({-1}).view(at::kByte);
  std::future<void> copying;
  for (int64_t at = 0; at < total; at += kPiece) {
    nvme_file().read(slot.offset + at, base + at, std::min(kPiece, total - at));
    if (copying.valid()) copying.get();
    const int64_t n = std::min(kPiece, bytes - at);
    if (n > 0) {
      copying = std::async(std::launch::async, [&out, base, at, n] {
        out.narrow(0, at, n).copy_(at::from_blob(base + at, {n}, at::TensorOptions(at::kByte)));
      });
    }
  }
  if (copying.valid()) copying.get();
  release_staging(buffer);
}

void TieredStore::copy_in(const Slot& slot, const at::Tensor& src) {
  if (slot.tier == Tier::kHost) {
    slot.host.view({-1}).copy_(src.view({-1}));
    count_written(Tier::kHost, slot.bytes());
    return;
  }
  at::Tensor buffer = staging(round_up(slot.bytes()));
  at::from_blob(buffer.data_ptr(), {slot.numel}, at::TensorOptions(slot.dtype)).copy_(src.view({-1}));
  nvme_file().write(slot.offset, buffer.data_ptr(), round_up(slot.bytes()));
  release_staging(buffer);
}

at::Tensor TieredStore::staging(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(staging_mutex_);
    for (size_t i = 0; i < free_staging_.size(); ++i) {
      if (free_staging_[i].numel() >= bytes) {
        at::Tensor buffer = std::move(free_staging_[i]);
        free_staging_.erase(free_staging_.begin() + static_cast<std::ptrdiff_t>(i));
        return buffer;
      }
    }
  }
  return host_tensor(bytes, at::kByte, options_.pinned);
}

void TieredStore::release_staging(at::Tensor buffer) {
  std::lock_guard<std::mutex> lock(staging_mutex_);
  free_staging_.push_back(std::move(buffer));
  // Keep the two largest: the double buffer.
  std::sort(free_staging_.begin(), free_staging_.end(),
            [](const at::Tensor& a, const at::Tensor& b) { return a.numel() > b.numel(); });
  if (free_staging_.size() > 2) free_staging_.resize(2);
}

Ticket TieredStore::submit(std::function<void()> job) {
  Ticket ticket;
  ticket.state_ = std::make_shared<Ticket::State>();
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return pending_ < options_.max_in_flight; });
  queue_.emplace_back(std::move(job), ticket.state_);
  ++pending_;
  lock.unlock();
  cv_.notify_all();
  return ticket;
}

void TieredStore::run() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    auto [job, state] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> done(state->mutex);
      state->done = true;
      state->error = error;
    }
    state->cv.notify_all();
    lock.lock();
    --pending_;
    lock.unlock();
    cv_.notify_all();
  }
}

}  // namespace meshtrain::offload
