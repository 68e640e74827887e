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
#include <cstring>
#include <limits>
#include <mutex>

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

// Every block carries its size in a header in front of the caller's bytes, so
// that the DataPtr's context is its data pointer (raw_allocate(), which oneDNN
// uses, requires that) and freeing needs no lookup. 64 bytes keep the base
// allocator's alignment.
constexpr size_t kHeader = 64;
c10::DeleterFnPtr g_base_deleter = nullptr;

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, block, sizeof bytes);
  g_current.fetch_sub(bytes, std::memory_order_relaxed);  // 0 for a host-scope block
  g_base_deleter(block);
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
                       "training.micro_batch, offload (the [offload] settings), or raise the limit.");
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
    c10::DataPtr block = base_->allocate(n + kHeader);
    char* start = static_cast<char*>(block.release_context());
    std::memcpy(start, &counted, sizeof counted);
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
