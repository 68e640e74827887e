// meshtrain bench offload, part one: the tiers' bandwidth against fio reading
// the same file, and the CPU AdamW against libtorch's AdamW.
#include "meshtrain/apps/bench_offload.h"
#include "meshtrain/apps/command.h"

#include "meshtrain/apps/bench_util.h"
#include "meshtrain/offload/cpu_adam.h"
#include "meshtrain/offload/host_memory.h"
#include "meshtrain/offload/tiered_store.h"

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <memory>

namespace meshtrain::apps {

namespace offload_bench {

namespace {

// fio reading `path` sequentially with O_DIRECT through io_uring, 1 MiB
// requests, 16 in flight: its bandwidth in bytes/s, or 0 when fio is missing.
double fio_read_bandwidth(const std::string& path, int64_t bytes) {
  const std::string command = "fio --name=read --filename=" + path + " --rw=read --bs=1M --iodepth=16 "
                              "--ioengine=io_uring --direct=1 --readonly --size=" + std::to_string(bytes) +
                              " --output-format=json 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return 0;
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe.get())) out.append(buffer, n);
  const size_t json = out.find('{');
  if (json == std::string::npos) return 0;
  try {
    const nlohmann::json report = nlohmann::json::parse(out.substr(json));
    return report.at("jobs").at(0).at("read").at("bw_bytes").get<double>();
  } catch (const std::exception&) {
    return 0;
  }
}

template <typename F>
double median_seconds(int trials, F&& run) {
  std::vector<double> times;
  for (int t = 0; t < trials; ++t) {
    const auto start = BenchClock::now();
    run();
    times.push_back(seconds_since(start));
  }
  return median(times);
}

}  // namespace

TierBandwidth bench_tiers(const OffloadBenchOptions& options, const Emit& emit) {
  TierBandwidth out;
  const int64_t bytes = options.file_mb << 20;
  const int64_t numel = bytes / 4;
  at::Tensor device = at::empty({numel});
  {
    // Host tier -> device tensor, against a plain tensor copy of the same bytes.
    offload::TieredStore store;
    const auto slot = store.put(at::rand({numel}), offload::Tier::kHost);
    const at::Tensor source = at::rand({numel});
    store.read(slot, device);
    const double fetch = median_seconds(options.trials, [&] { store.read(slot, device); });
    const double copy = median_seconds(options.trials, [&] { device.copy_(source); });
    out.host = bytes / fetch;
    emit({{"part", "tiers"}, {"tier", "cpu"}, {"bytes", bytes}, {"fetch_gb_s", bytes / fetch / 1e9},
          {"tensor_copy_gb_s", bytes / copy / 1e9}, {"ratio", copy / fetch}});
  }
  for (const std::string engine : {"io_uring", "pread"}) {
    offload::StoreOptions store_options;
    store_options.nvme_dir = options.nvme_dir;
    store_options.nvme.engine = engine;
    offload::TieredStore store(store_options);
    const auto slot = store.put(at::rand({numel}), offload::Tier::kNvme);
    offload::NvmeFile& file = *store.nvme();
    at::Tensor host = offload::host_tensor(numel, at::kFloat);
    const double raw = median_seconds(options.trials, [&] { file.read(0, host.data_ptr(), offload::round_up(bytes)); });
    const double fetch = median_seconds(options.trials, [&] { store.read(slot, device); });
    const double write = median_seconds(options.trials, [&] { store.write(slot, device); });
    const double fio = engine == "io_uring" ? fio_read_bandwidth(file.path(), bytes) : 0;
    if (engine == "io_uring") out.nvme = bytes / fetch;
    nlohmann::json row = {{"part", "tiers"},
                          {"tier", "nvme"},
                          {"engine", file.engine()},
                          {"o_direct", file.direct()},
                          {"bytes", bytes},
                          {"read_gb_s", bytes / raw / 1e9},
                          {"fetch_to_device_gb_s", bytes / fetch / 1e9},
                          {"write_gb_s", bytes / write / 1e9}};
    if (fio > 0) row["fio_read_gb_s"] = fio / 1e9, row["ratio_vs_fio"] = bytes / raw / fio;
    emit(row);
  }
  return out;
}

// The fused kernel against torch::optim::AdamW (libtorch's loop of per-tensor
// operators, the C++ twin of PyTorch's single-tensor AdamW) on one flat
// tensor, and on the same elements as 64 tensors (a model's parameters).
void bench_adam(const OffloadBenchOptions& options, const Emit& emit) {
  for (int64_t numel : {int64_t{1} << 20, int64_t{16} << 20}) {
    torch::manual_seed(0);
    at::Tensor p = torch::randn({numel}), g = torch::randn({numel}) * 1e-2, m = at::zeros({numel}), v = at::zeros({numel});
    int64_t step = 0;
    const double fused = median_seconds(std::max(options.trials, 5), [&] {
      offload::cpu_adamw(p, g, m, v, {1e-3, 0.9, 0.95, 1e-8, 0.1, ++step});
    });
    at::Tensor bf16 = at::empty({numel}, at::kBFloat16);
    const double fused_bf16 = median_seconds(std::max(options.trials, 5), [&] {
      offload::cpu_adamw(p, g, m, v, {1e-3, 0.9, 0.95, 1e-8, 0.1, ++step}, bf16);
    });
    auto reference = [&](int64_t pieces) {
      std::vector<at::Tensor> params;
      for (const at::Tensor& piece : torch::randn({numel}).chunk(pieces)) {
        params.push_back(piece.clone().set_requires_grad(true));
        params.back().mutable_grad() = torch::randn_like(piece) * 1e-2;
      }
      torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1));
      adamw.step();  // states allocated outside the timing
      return median_seconds(std::max(options.trials, 5), [&] { adamw.step(); });
    };
    const double one = reference(1), many = reference(64);
    emit({{"part", "adam"},
          {"elements", numel},
          {"kernel", offload::cpu_adamw_kernel()},
          {"threads", at::get_num_threads()},
          {"fused_ms", fused * 1e3},
          {"fused_bf16_copy_ms", fused_bf16 * 1e3},
          {"fused_gb_s", 28.0 * numel / fused / 1e9},
          {"torch_adamw_ms", one * 1e3},
          {"torch_adamw_64_tensors_ms", many * 1e3},
          {"speedup_vs_torch_adamw", one / fused},
          {"speedup_vs_torch_adamw_64_tensors", many / fused}});
  }
}

}  // namespace offload_bench

int run_bench_offload(comm::Runtime& runtime, const OffloadBenchOptions& options) {
  const bool speaker = runtime.rank() == 0;
  std::ofstream json;
  if (!options.json_path.empty() && speaker) json.open(options.json_path, std::ios::app);
  const offload_bench::Emit emit = [&](const nlohmann::json& row) {
    if (!speaker) return;
    std::printf("%s\n", row.dump().c_str());
    std::fflush(stdout);
    if (json.is_open()) json << row.dump() << "\n" << std::flush;
  };
  auto wants = [&](const char* part) {
    return std::find(options.parts.begin(), options.parts.end(), part) != options.parts.end();
  };
  offload_bench::TierBandwidth bandwidth;
  const offload_bench::Emit quiet = [](const nlohmann::json&) {};
  if (wants("tiers") || wants("inference")) bandwidth = offload_bench::bench_tiers(options, wants("tiers") ? emit : quiet);
  if (wants("adam")) offload_bench::bench_adam(options, emit);
  if (wants("inference")) offload_bench::bench_inference(options, bandwidth, emit);
  if (wants("training")) offload_bench::bench_training(runtime, options, emit);
  return 0;
}

CommandPtr add_bench_offload(CLI::App& bench) {
  auto o = std::make_shared<OffloadBenchOptions>();
  CLI::App* sub = bench.add_subcommand(
      "offload", "Tiered memory, one JSON line per row: the host and NVMe tiers' bandwidth (the NVMe read against fio "
                 "on the same file), the fused CPU AdamW against torch::optim::AdamW, ZeRO-Inference decode tokens/s "
                 "per batch against the bound (streamed bytes / tier bandwidth), and training step time and memory "
                 "with the optimizer and parameters offloaded (bench/cpu_adam_vs_torch.py adds PyTorch's own AdamW)");
  sub->add_option("--parts", o->parts, "Which parts")
      ->check(CLI::IsMember({"tiers", "adam", "inference", "training"}))
      ->capture_default_str();
  sub->add_option("--nvme-dir", o->nvme_dir, "Folder on the disk to measure")->capture_default_str();
  sub->add_option("--file-mb", o->file_mb, "Size of the NVMe test file")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--trials", o->trials, "Timed trials (medians)")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--batches", o->batches, "Inference batch sizes")->capture_default_str();
  sub->add_option("--training-model", o->training_model, "Model preset of the training part")->capture_default_str();
  sub->add_option("--json", o->json_path, "Also append the rows to this file");
  return command(sub, [o](comm::Runtime& runtime) { return run_bench_offload(runtime, *o); });
}

}  // namespace meshtrain::apps
