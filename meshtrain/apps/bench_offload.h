// The parts of meshtrain bench offload (apps/bench_offload*.cpp).
#pragma once

#include "meshtrain/apps/commands.h"

#include <nlohmann/json.hpp>

#include <functional>

namespace meshtrain::apps::offload_bench {

using Emit = std::function<void(const nlohmann::json&)>;

struct TierBandwidth {
  double host = 0;  // bytes/s, host tier -> device tensor
  double nvme = 0;  // bytes/s, NVMe tier -> device tensor (through staging)
};
TierBandwidth bench_tiers(const OffloadBenchOptions& options, const Emit& emit);
void bench_adam(const OffloadBenchOptions& options, const Emit& emit);
void bench_inference(const OffloadBenchOptions& options, const TierBandwidth& bandwidth, const Emit& emit);
void bench_training(comm::Runtime& runtime, const OffloadBenchOptions& options, const Emit& emit);

}  // namespace meshtrain::apps::offload_bench
