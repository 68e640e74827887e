// The machines a plan can be for: named profiles of common GPUs, the GPUs the
// NVIDIA driver lists on this host, and this host's CPU (Note [This machine]).
#pragma once

#include "meshtrain/plan/layout.h"

#include <optional>
#include <string>
#include <vector>

namespace meshtrain::plan {

// Names machine_preset() knows ("h100", "h200", "a100").
std::vector<std::string> machine_preset_names();
// A named profile; throws std::invalid_argument listing the names.
Machine machine_preset(const std::string& name);

// The GPUs the NVIDIA driver lists under `driver_dir` (one folder per GPU with an
// `information` file whose "Model:" line names it), as a profile: the preset whose
// name the model contains, with devices_per_node the GPU count. An unknown model
// keeps the H100's figures, and `assumed` says so. nullopt: no GPU listed.
struct DetectedGpus {
  Machine machine;
  std::string model;    // "NVIDIA H100 80GB HBM3"
  std::string assumed;  // empty when the model is known
};
std::optional<DetectedGpus> detect_gpus(const std::string& driver_dir = "/proc/driver/nvidia/gpus");

// This host's CPU as the devices of `ranks_per_node` ranks: the physical memory
// shared among them, `measured_flops` (all cores) shared among them, and assumed
// shared-memory collective figures (`meshtrain plan --calibrate` measures them);
// `cores` the CPU's (0: not known; Note [Shared cores]).
Machine cpu_machine(double physical_memory, double measured_flops, int64_t ranks_per_node, const std::string& cpu_name,
                    int64_t cores = 0);

// "AMD EPYC 7B13" from /proc/cpuinfo's "model name" ("cpu" when there is none).
std::string cpu_model_name(const std::string& cpuinfo_path = "/proc/cpuinfo");

}  // namespace meshtrain::plan
