// Memory accounting: a counting CPU allocator that knows current and peak
// bytes per rank, by training phase, and can enforce a per-rank limit.
// See Note [Counting allocator].
#pragma once

#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <string>

namespace meshtrain::memory {

// What the process is doing; peaks are kept per phase.
enum class Phase : int {
  kModelStates = 0,  // between steps: parameters, gradients, optimizer states (and setup)
  kForward,
  kBackward,
  kOptimizer,        // gradient reduction tail, clipping, optimizer step, parameter gathers
  kEval,
  kCheckpoint,
};
constexpr int kPhaseCount = 6;
const char* phase_name(Phase phase);  // "model_states", "forward", ...

// Note [Counting allocator]
// install() wraps the CPU allocator (c10::SetCPUAllocator with the highest
// priority) so that every CPU tensor allocated afterwards is counted: its
// DataPtr carries its size, and its deleter subtracts it. Tensors allocated
// before install() are not counted and cost nothing to free. Counters are
// process-wide atomics (the communicators' progress threads allocate too).
// With a limit set, an allocation that would take the current total beyond it
// throws c10::OutOfMemoryError naming the rank, the phase, the request, the
// bytes in use and the limit, so an over-large layout fails at once and says
// where, instead of swapping or being killed.
// Only CPU tensors are counted; on CUDA, device_stats() reads the caching
// allocator's own counters. Freed blocks of 128 KiB or more are kept for
// reuse, uncounted (Note [Block cache] in memory.cpp).
void install();
bool installed();

int64_t current_bytes();
int64_t cached_bytes();               // freed blocks kept for reuse: not in current_bytes()
int64_t peak_bytes();                 // since install() or reset_peaks()
int64_t phase_peak_bytes(Phase phase);  // highest current_bytes() seen while in `phase`
void reset_peaks();                   // all peaks := current_bytes()

// 0: no limit.
void set_limit(int64_t bytes);
int64_t limit();
// The rank named in out-of-memory messages.
void set_rank(int rank);

Phase current_phase();

// Sets the phase for its lifetime, then restores the previous one.
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Phase previous_;
};

// Note [Host scope]
// On a machine without a GPU the counted memory plays the device's part, and
// host memory (the offload tiers) must be told apart from it. While a
// HostScope lives on a thread, that thread's CPU allocations are host memory:
// neither counted in current_bytes() nor held to the limit.
// A model is built and loaded this way before its weights move to the
// tiered store, as it would be built in CPU memory before a GPU sees it.
class HostScope {
 public:
  HostScope();
  ~HostScope();
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;

 private:
  bool previous_;
};

// Allocated and peak bytes of a CUDA device's caching allocator; zeros on the
// CPU or where libtorch does not expose them (before 2.9).
struct DeviceStats {
  int64_t current = 0;
  int64_t peak = 0;
};
DeviceStats device_stats(const c10::Device& device);
// Peak := current for a CUDA device's caching allocator (nothing on the CPU).
void reset_device_peak(const c10::Device& device);

std::string format_mib(int64_t bytes);  // "12.3 MiB"

}  // namespace meshtrain::memory
