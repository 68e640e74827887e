#include "meshtrain/plan/machines.h"

#include "meshtrain/util/cpu_features.h"

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace meshtrain::plan {

// Note [This machine]
// ~~~~~~~~~~~~~~~~~~~
// `meshtrain plan` plans for the machine it runs on unless told otherwise
// (`--machine h100`, a profile file, `--device-memory`). A GPU host is known
// by the models the NVIDIA driver lists (no CUDA needed): a known model brings
// its memory and dense bf16 peak; its interconnect figures are the preset's.
// A CPU host runs its ranks side by side: they share its physical memory and
// its cores, so each rank's memory and peak are the host's divided by the
// ranks on it. The CPU peak is measured (one matmul, by the caller); the
// collective figures are assumptions in the range a shared-memory all-reduce
// reaches on a small host (docs/BENCHMARKS.md measured 2–7 GB/s on 2 cores),
// and the header says so: `meshtrain run -n N plan --calibrate` measures them.

namespace {

constexpr double kGiB = 1073741824.0;

struct Preset {
  const char* name;
  const char* match;  // in the driver's model name
  double peak_tflops, memory_gib, intra_gbps, inter_gbps;
};

// Dense bf16 peaks and HBM sizes as the vendor states them; NVLink bus bandwidth
// of an all-reduce inside an 8-GPU node, and one 400 Gb/s NIC per GPU across nodes.
constexpr Preset kPresets[] = {
    {"h100", "H100", 989, 80, 360, 45},
    {"h200", "H200", 989, 141, 360, 45},
    {"a100", "A100", 312, 80, 230, 22},
};

Machine from_preset(const Preset& p) {
  Machine m;
  m.name = p.name;
  m.peak_flops = p.peak_tflops * 1e12;
  m.device_memory = p.memory_gib * kGiB;
  m.intra_bandwidth = p.intra_gbps * 1e9;
  m.inter_bandwidth = p.inter_gbps * 1e9;
  return m;
}

std::string trimmed(std::string s) {
  const size_t first = s.find_first_not_of(" \t");
  const size_t last = s.find_last_not_of(" \t\r\n");
  return first == std::string::npos ? "" : s.substr(first, last - first + 1);
}

// The value of the first "key: value" line of a file; empty when there is none.
std::string field_of(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon != std::string::npos && trimmed(line.substr(0, colon)) == key) return trimmed(line.substr(colon + 1));
  }
  return "";
}

}  // namespace

std::vector<std::string> machine_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

Machine machine_preset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return from_preset(p);
  }
  std::string known;
  for (const std::string& n : machine_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("machine '" + name + "' unknown: use this, " + known + " or a profile file (JSON)");
}

std::optional<DetectedGpus> detect_gpus(const std::string& driver_dir) {
  std::error_code error;
  if (!std::filesystem::is_directory(driver_dir, error)) return std::nullopt;
  std::vector<std::string> models;
  for (const auto& entry : std::filesystem::directory_iterator(driver_dir, error)) {
    const std::string model = field_of((entry.path() / "information").string(), "Model");
    if (!model.empty()) models.push_back(model);
  }
  if (models.empty()) return std::nullopt;
  DetectedGpus found{from_preset(kPresets[0]), models.front(), ""};
  bool known = false;
  for (const Preset& p : kPresets) {
    if (models.front().find(p.match) != std::string::npos) {
      found.machine = from_preset(p);
      known = true;
      break;
    }
  }
  if (!known) found.assumed = "'" + models.front() + "' has no profile here: an H100's figures assumed";
  found.machine.name = std::to_string(models.size()) + " x " + models.front();
  found.machine.devices_per_node = static_cast<int64_t>(models.size());
  return found;
}

Machine cpu_machine(double physical_memory, double measured_flops, int64_t ranks_per_node, const std::string& cpu_name,
                    int64_t cores) {
  if (ranks_per_node < 1) throw std::invalid_argument("cpu_machine: ranks_per_node must be >= 1");
  Machine m;
  m.name = cpu_name;
  m.devices_per_node = ranks_per_node;
  m.cores_per_node = cores;
  m.device_memory = physical_memory / static_cast<double>(ranks_per_node);
  m.peak_flops = measured_flops / static_cast<double>(ranks_per_node);
  m.intra_bandwidth = 4e9;     // a shared-memory all-reduce (assumed)
  m.inter_bandwidth = 1.25e9;  // 10 Gb/s Ethernet between hosts (assumed)
  m.latency = 20e-6;
  m.host_bandwidth = 20e9;     // offload to "host" memory is a copy in the same memory
  return m;
}

std::string cpu_model_name(const std::string& cpuinfo_path) { return util::cpu_model_name(cpuinfo_path); }

}  // namespace meshtrain::plan
