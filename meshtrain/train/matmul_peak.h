#pragma once

#include <torch/torch.h>

#include <string>

namespace meshtrain::train {

// One rank's matmul rate (FLOP/s) on `device` in `dtype` with its threads, the
// peak MFU is quoted against: 2·n³ / t, best of 3, n = 8192 on a GPU; on a
// CPU the best over n = 256 ... 2048, stopping after a size whose product
// takes over half a second (a CPU without bf16 instructions runs a 2048
// product in bf16 for a minute, slower per FLOP than small ones). On a CPU
// kept per machine (Note [Matmul peak]): measured once per process at most,
// and not at all where the machine's cache file holds it, unless `afresh`
// (the measuring commands), which measures and keeps the best seen.
double measure_matmul_peak(at::Device device = at::kCPU, at::ScalarType dtype = at::kFloat, bool afresh = false);

// The cache file: $MESHTRAIN_CACHE, else $XDG_CACHE_HOME/meshtrain, else ~/.cache/meshtrain, then
// /matmul-peak.json ("" where none of them is set).
std::string matmul_peak_cache_path();

}  // namespace meshtrain::train
