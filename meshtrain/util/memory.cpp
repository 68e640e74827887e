#include "meshtrain/util/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#include <c10/core/CachingDeviceAllocator.h>
#define MESHTRAIN_HAVE_DEVICE_ALLOCATOR_STATS 1
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace meshtrain::memory {

namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::array<std::atomic<int64_t>, kPhaseCount> g_phase_peak{};
std::atomic<int64_t> g_limit{0};
std::atomic<int> g_phase{0};
std::atomic<int> g_rank{0};
std::atomic<bool> g_installed{false};
thread_local bool t_host_scope = false;

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Every block carries a header in front of the caller's bytes: the counted
// bytes, then the base allocation's size. The DataPtr's context is then its
// data pointer (raw_allocate(), which oneDNN uses, requires that) and freeing
// needs no lookup. 64 bytes keep the base allocator's alignment.
constexpr size_t kHeader = 64;
c10::DeleterFnPtr g_base_deleter = nullptr;

// Note [Block cache]
// A training step frees and allocates blocks of the same sizes every
// micro-batch. glibc serves large blocks with fresh mappings (or gives freed
// heap tops back to the kernel), so each micro-batch faulted its activations
// in again: the kernel zeroes every 4 KiB page on first touch, ~2.7 us a page
// in this project's VM (a 12 MiB output costs ~8 ms fresh, ~0.3 ms reused),
// ~65,000 faults per bf16 `small` step. Raising glibc's thresholds instead
// helped that run, but left its heap growing without bound on a simple
// repeated pattern of aligned blocks, so the counting allocator keeps freed
// blocks itself, as a GPU caching allocator does: a freed block of at least
// 128 KiB (glibc's initial mmap threshold; smaller ones come from its heap)
// is kept under its exact size and handed out again for the same size. Up to
// MESHTRAIN_HOST_CACHE_MB (default 1024; 0: off) per process is kept; a block
// that does not fit evicts blocks of other sizes. Counted bytes follow
// tensors, not the cache: a cached block is not in current_bytes(), nor held
// to the limit, but it is in the process's RSS.
class BlockCache {
 public:
  BlockCache() {
    const char* mib = std::getenv("MESHTRAIN_HOST_CACHE_MB");
    if (mib == nullptr) return;
    char* end = nullptr;
    const unsigned long long value = std::strtoull(mib, &end, 10);
    if (end == mib || *end != '\0') {
      // Before MPI is up: the launcher's rank variable keeps the message to one rank.
      const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
      if (rank != nullptr && std::string(rank) != "0") return;
      std::fprintf(stderr, "meshtrain: MESHTRAIN_HOST_CACHE_MB=%s is not a whole number of MiB; keeping %zu MiB\n",
                   mib, capacity_ >> 20);
      return;
    }
    capacity_ = static_cast<size_t>(value) << 20;
  }

  // A kept block of exactly `size` bytes, or nullptr.
  char* take(size_t size) {
    if (size < kMinimum) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    char* block = it->second.back();
    it->second.pop_back();
    cached_ -= size;
    return block;
  }

  // Keeps `block` for reuse, or frees it.
  void give(char* block, size_t size) {
    if (size < kMinimum || size > capacity_) return g_base_deleter(block);
    std::lock_guard<std::mutex> lock(mutex_);
    make_room(size);
    if (cached_ + size > capacity_) return g_base_deleter(block);
    free_[size].push_back(block);
    cached_ += size;
  }

  size_t cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

 private:
  // Frees kept blocks of other sizes until `size` more bytes fit.
  void make_room(size_t size) {
    for (auto it = free_.begin(); it != free_.end() && cached_ + size > capacity_; ++it) {
      if (it->first == size) continue;
      while (!it->second.empty() && cached_ + size > capacity_) {
        g_base_deleter(it->second.back());
        it->second.pop_back();
        cached_ -= it->first;
      }
    }
  }

  static constexpr size_t kMinimum = 128 << 10;
  size_t capacity_ = size_t{1024} << 20;
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<char*>> free_;
  size_t cached_ = 0;
};

// Lives for the process, like the allocator: tensors freed at exit still return blocks.
BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();
  return *cache;
}

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  int64_t header[2];
  std::memcpy(header, block, sizeof header);
  g_current.fetch_sub(header[0], std::memory_order_relaxed);  // 0 for a host-scope block
  block_cache().give(block, static_cast<size_t>(header[1]));
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    const auto bytes = static_cast<int64_t>(n);
    if (t_host_scope) return allocate_block(n, 0);
    const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    const int64_t limit = g_limit.load(std::memory_order_relaxed);
    if (limit > 0 && now > limit) {
      g_current.fetch_sub(bytes, std::memory_order_relaxed);
      const auto phase = static_cast<Phase>(g_phase.load(std::memory_order_relaxed));
      TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory on rank ", g_rank.load(), " during ",
                       phase_name(phase), ": allocating ", format_mib(bytes), " with ", format_mib(now - bytes),
                       " in use would exceed the per-rank limit of ", format_mib(limit),
                       " (memory.limit_mb). Shard more (a higher parallel.zero_stage, more ranks), use a smaller "
                       "training.micro_batch, split long sequences (parallel.cp), offload (the [offload] settings), or raise "
                       "the limit.");
    }
    raise_to(g_peak, now);
    raise_to(g_phase_peak[g_phase.load(std::memory_order_relaxed)], now);
    return allocate_block(n, bytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  // `counted`: the bytes release() gives back (0 for host-scope blocks, Note [Host scope]).
  c10::DataPtr allocate_block(size_t n, int64_t counted) {
    const size_t size = n + kHeader;
    char* start = block_cache().take(size);
    if (start == nullptr) {
      c10::DataPtr block = base_->allocate(size);
      start = static_cast<char*>(block.release_context());
    }
    const int64_t header[2] = {counted, static_cast<int64_t>(size)};
    std::memcpy(start, header, sizeof header);
    void* data = start + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::Allocator* base_;
};

}  // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kModelStates: return "model_states";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kEval: return "eval";
    case Phase::kCheckpoint: return "checkpoint";
  }
  return "unknown";
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Blocks are carved from the base allocator's simple (context == data) blocks.
    c10::Allocator* base = c10::GetCPUAllocator();
    g_base_deleter = base->raw_deleter();
    if (g_base_deleter == nullptr) return;  // not a simple allocator: leave it alone (installed() says so)
    // Lives for the process: tensors freed at exit still call into it.
    static CountingAllocator* allocator = new CountingAllocator(base);
    c10::SetCPUAllocator(allocator, std::numeric_limits<uint8_t>::max());
    g_installed = true;
  });
}

bool installed() { return g_installed.load(); }
int64_t current_bytes() { return g_current.load(std::memory_order_relaxed); }
int64_t cached_bytes() { return static_cast<int64_t>(block_cache().cached()); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
int64_t phase_peak_bytes(Phase phase) { return g_phase_peak[static_cast<int>(phase)].load(std::memory_order_relaxed); }

void reset_peaks() {
  const int64_t now = current_bytes();
  g_peak = now;
  for (auto& peak : g_phase_peak) peak = now;
}

void set_limit(int64_t bytes) { g_limit = bytes; }
int64_t limit() { return g_limit.load(); }
void set_rank(int rank) { g_rank = rank; }
Phase current_phase() { return static_cast<Phase>(g_phase.load(std::memory_order_relaxed)); }

HostScope::HostScope() : previous_(t_host_scope) { t_host_scope = true; }
HostScope::~HostScope() { t_host_scope = previous_; }

PhaseScope::PhaseScope(Phase phase) : previous_(current_phase()) {
  g_phase = static_cast<int>(phase);
  raise_to(g_phase_peak[static_cast<int>(phase)], current_bytes());
}

PhaseScope::~PhaseScope() { g_phase = static_cast<int>(previous_); }

DeviceStats device_stats(const c10::Device& device) {
  DeviceStats stats;
#ifdef MESHTRAIN_HAVE_DEVICE_ALLOCATOR_STATS
  if (device.is_cuda()) {
    const auto raw = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
    const auto& all = raw.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    stats.current = all.current;
    stats.peak = all.peak;
  }
#else
  (void)device;
#endif
  return stats;
}

void reset_device_peak(const c10::Device& device) {
#ifdef MESHTRAIN_HAVE_DEVICE_ALLOCATOR_STATS
  if (device.is_cuda()) c10::getDeviceAllocator(device.type())->resetPeakStats(device.index());
#else
  (void)device;
#endif
}

std::string format_mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

}  // namespace meshtrain::memory
