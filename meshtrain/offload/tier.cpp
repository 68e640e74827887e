#include "meshtrain/offload/tier.h"

#include <array>
#include <atomic>
#include <stdexcept>

namespace meshtrain::offload {

namespace {

struct Counters {
  std::atomic<int64_t> current{0}, peak{0}, read{0}, written{0};
};
std::array<Counters, kTierCount> g_counters;

Counters& of(Tier tier) { return g_counters[static_cast<int>(tier)]; }

}  // namespace

const char* tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

Tier parse_tier(const std::string& value, const std::string& key) {
  if (value == "none" || value == "device") return Tier::kDevice;
  if (value == "cpu") return Tier::kHost;
  if (value == "nvme") return Tier::kNvme;
  throw std::invalid_argument(key + " = \"" + value + "\": must be \"none\", \"cpu\" or \"nvme\"");
}

TierStats tier_stats(Tier tier) {
  const Counters& c = of(tier);
  return {c.current.load(), c.peak.load(), c.read.load(), c.written.load()};
}

void reset_tier_peaks() {
  for (Counters& c : g_counters) c.peak = c.current.load();
}

void count_resident(Tier tier, int64_t delta_bytes) {
  Counters& c = of(tier);
  const int64_t now = c.current.fetch_add(delta_bytes) + delta_bytes;
  int64_t seen = c.peak.load();
  while (now > seen && !c.peak.compare_exchange_weak(seen, now)) {
  }
}

void count_read(Tier tier, int64_t bytes) { of(tier).read += bytes; }
void count_written(Tier tier, int64_t bytes) { of(tier).written += bytes; }

}  // namespace meshtrain::offload
