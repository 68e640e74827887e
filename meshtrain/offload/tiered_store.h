// The tiered store: tensors kept in the host or NVMe tier and moved to and
// from the compute device asynchronously. See Note [Tiered store].
#pragma once

#include "meshtrain/offload/nvme_file.h"
#include "meshtrain/offload/tier.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::offload {

// Note [Tiered store]
// A slot holds one flat tensor's bytes in a tier: in the host tier a
// host_tensor (aligned, outside the counting allocator, pinned on CUDA); in
// the NVMe tier a region of one O_DIRECT file in `nvme_dir`. fetch() copies a
// slot into a tensor on the device, store() a device tensor into a slot; both
// return at once with a Ticket and run on the store's transfer thread (the
// copy engine), at most `max_in_flight` queued or running: a caller asking
// for more waits for the oldest, so prefetching is bounded and a fetch of
// the next layer runs while this one computes (double buffering is
// max_in_flight = 2 with the buffer in use). An NVMe transfer goes through a
// host staging buffer from a small pool (O_DIRECT needs aligned memory; on a
// GPU machine this is the pinned buffer the copy engine reads), the file read
// as io_uring chunks in flight together, in 32 MiB pieces: a piece is copied
// out while the next is read. Each tier's resident and moved bytes are counted (tier.h).
class Ticket {
 public:
  Ticket() = default;
  // Blocks until the transfer is done; rethrows its error.
  void wait() const;
  bool done() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class TieredStore;
  struct State {
    mutable std::mutex mutex;
    mutable std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  std::shared_ptr<State> state_;
};

struct StoreOptions {
  std::string nvme_dir = "/tmp";  // the NVMe tier's file goes here (a local disk)
  int max_in_flight = 2;          // transfers queued or running
  bool pinned = false;            // host tier page-locked (the device is CUDA)
  NvmeOptions nvme;
};

class TieredStore {
 public:
  using Id = size_t;
  explicit TieredStore(StoreOptions options = {});
  ~TieredStore();  // waits for the transfers; removes the NVMe file
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  // A new slot in `tier` (host or NVMe) holding a copy of `value`'s elements
  // (flattened); synchronous.
  Id put(const at::Tensor& value, Tier tier);
  // A new zeroed slot of `numel` elements.
  Id allocate(int64_t numel, at::ScalarType dtype, Tier tier);
  Tier tier(Id id) const { return slots_.at(id).tier; }
  int64_t numel(Id id) const { return slots_.at(id).numel; }
  // A host-tier slot's tensor itself (the CPU works on it in place).
  const at::Tensor& host(Id id) const;

  // Asynchronous: slot -> `dst` (a contiguous tensor of the slot's elements,
  // on the device), and `src` -> slot. The tensors must stay alive and
  // untouched until the ticket is done.
  Ticket fetch(Id id, at::Tensor dst);
  Ticket store(Id id, at::Tensor src);
  // Blocking forms.
  void read(Id id, const at::Tensor& dst) { fetch(id, dst).wait(); }
  void write(Id id, const at::Tensor& src) { store(id, src).wait(); }

  // Elements [offset, offset + numel) of an NVMe slot <-> `host`, a host
  // tensor from host_tensor() (aligned), blocking on the calling thread:
  // for streaming a slot through host memory piece by piece (ZeRO-Infinity's
  // optimizer step). `offset` in elements must keep 4096-byte alignment.
  void read_range(Id id, int64_t offset, int64_t numel, const at::Tensor& host);
  void write_range(Id id, int64_t offset, int64_t numel, const at::Tensor& host);

  NvmeFile* nvme() { return nvme_.get(); }  // null until an NVMe slot exists
  const StoreOptions& options() const { return options_; }

 private:
  struct Slot {
    Tier tier;
    int64_t numel;
    at::ScalarType dtype;
    at::Tensor host;     // kHost
    int64_t offset = 0;  // kNvme: in the file
    int64_t bytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
  };
  Ticket submit(std::function<void()> job);
  void run();
  void copy_in(const Slot& slot, const at::Tensor& src);   // on the transfer thread
  void copy_out(const Slot& slot, const at::Tensor& dst);
  at::Tensor staging(int64_t bytes);  // a host buffer of at least `bytes`
  void release_staging(at::Tensor buffer);
  NvmeFile& nvme_file();

  StoreOptions options_;
  std::deque<Slot> slots_;  // a deque: queued transfers hold references to their slot
  std::unique_ptr<NvmeFile> nvme_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Ticket::State>>> queue_;
  int pending_ = 0;  // queued or running
  bool stopping_ = false;
  std::vector<at::Tensor> free_staging_;
  std::mutex staging_mutex_;
  std::thread worker_;
};

}  // namespace meshtrain::offload
