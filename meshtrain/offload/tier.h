// Memory tiers of the tiered store, and the bytes each one holds and moves.
// See Note [Tiered store] in tiered_store.h.
#pragma once

#include <cstdint>
#include <string>

namespace meshtrain::offload {

// Where a tensor lives: the compute device (on the CPU, the memory the
// counting allocator counts under memory.limit_mb), host memory outside it
// (pinned when the device is CUDA), or a file on a local disk (NVMe).
enum class Tier : int { kDevice = 0, kHost, kNvme };
constexpr int kTierCount = 3;

// "device", "cpu", "nvme": the names the config uses ([offload] ... = "cpu").
const char* tier_name(Tier tier);
// "none" and "device" -> kDevice, "cpu" -> kHost, "nvme" -> kNvme; anything
// else throws std::invalid_argument naming `key` and the allowed values.
Tier parse_tier(const std::string& value, const std::string& key);

// Bytes resident in the host or NVMe tier (current and peak since the last
// reset_tier_peaks()), and bytes read from it and written to it so far.
// The device tier's bytes are the counting allocator's (util/memory.h).
struct TierStats {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t read = 0;
  int64_t written = 0;
};
TierStats tier_stats(Tier tier);
void reset_tier_peaks();

// For the tier's owners (host buffers, NVMe regions, transfers).
void count_resident(Tier tier, int64_t delta_bytes);
void count_read(Tier tier, int64_t bytes);
void count_written(Tier tier, int64_t bytes);

}  // namespace meshtrain::offload
