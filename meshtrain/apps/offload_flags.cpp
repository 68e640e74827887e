#include "meshtrain/apps/offload_flags.h"

#include "meshtrain/offload/tier.h"
#include "meshtrain/util/memory.h"

namespace meshtrain::apps {

void add_offload_flags(CLI::App& command, InferenceOffloadFlags& flags) {
  command
      .add_option("--offload.weights", flags.weights,
                  "Keep the transformer blocks' weights in host memory (cpu) or a file on a local disk (nvme) and "
                  "stream each block to the device just before it computes (ZeRO-Inference); none: all resident")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->capture_default_str();
  command.add_option("--offload.nvme_dir", flags.nvme_dir, "Folder on a local disk for --offload.weights=nvme")
      ->capture_default_str();
  command.add_option("--offload.prefetch", flags.prefetch, "Blocks fetched ahead of the one computing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  command.add_option("--offload.kv", flags.kv, "Where the KV cache is kept: device or cpu (host memory)")
      ->check(CLI::IsMember({"device", "cpu"}))
      ->capture_default_str();
  command
      .add_option("--memory.limit_mb", flags.memory_limit_mb,
                  "Per-rank limit on counted device memory after loading (on the CPU: the counted CPU tensors; "
                  "offloaded weights and host tiers do not count); 0: none")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

serve::InferenceOffload inference_offload(const InferenceOffloadFlags& flags) {
  serve::InferenceOffload offload;
  offload.weights = offload::parse_tier(flags.weights, "offload.weights");
  offload.nvme_dir = flags.nvme_dir;
  offload.prefetch = flags.prefetch;
  offload.kv = offload::parse_tier(flags.kv, "offload.kv");
  return offload;
}

std::string apply_memory_limit(const InferenceOffloadFlags& flags, const serve::InferenceModel& model) {
  memory::set_limit(flags.memory_limit_mb << 20);
  memory::reset_peaks();
  std::string line;
  if (const offload::WeightStream* stream = model.weight_stream()) {
    line = "weights streamed from " + flags.weights + ": " + memory::format_mib(stream->streamed_bytes()) + " in " +
           std::to_string(stream->blocks()) + " blocks, " + std::to_string(flags.prefetch) + " prefetched; ";
  }
  if (flags.kv == "cpu") line += "KV cache in host memory; ";
  if (flags.memory_limit_mb > 0) line += "device memory limit " + std::to_string(flags.memory_limit_mb) + " MiB; ";
  if (!line.empty()) line = "meshtrain: " + line.substr(0, line.size() - 2) + "\n";
  return line;
}

}  // namespace meshtrain::apps
