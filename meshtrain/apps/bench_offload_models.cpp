// meshtrain bench offload, part two: ZeRO-Inference decode speed against the
// transfer bound per batch size, and training step time and memory with the
// optimizer (and parameters) offloaded.
#include "meshtrain/apps/bench_offload.h"

#include "meshtrain/apps/bench_util.h"
#include "meshtrain/offload/tier.h"
#include "meshtrain/serve/batch_engine.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/memory.h"

#include <optional>

namespace meshtrain::apps::offload_bench {

namespace {

// 8 blocks of width 512: 25M parameters, 100 MB in fp32.
model::GptConfig inference_model() {
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.width = 512, c.heads = 8, c.layers = 8, c.context = 128, c.dropout = 0;
  return c;
}

struct Decode {
  double tokens_per_s = 0, forwards_per_s = 0;
};

// Median decode speed of `batch` sequences (prompt 16, 8 new tokens, greedy).
Decode decode_speed(serve::InferenceModel& model, int64_t batch, int trials) {
  constexpr int64_t prompt = 16, fresh = 8;
  serve::GenerationRequest request;
  for (int64_t i = 0; i < prompt; ++i) request.prompt.push_back((7 * i + 3) % model.config().vocab_size);
  request.options.tokens = fresh;
  request.options.temperature = 0;
  std::vector<double> seconds;
  for (int t = 0; t < trials + 1; ++t) {
    serve::BatchEngine engine(model, batch);
    std::vector<serve::GenerationRequest> requests(batch, request);
    for (int64_t r = 0; r < batch; ++r) requests[r].id = r;
    engine.admit(requests);
    const auto start = BenchClock::now();
    while (engine.running() > 0) engine.step();
    if (t > 0) seconds.push_back(seconds_since(start));
  }
  const double s = median(seconds);
  return {batch * (fresh - 1) / s, (fresh - 1) / s};
}

}  // namespace

void bench_inference(const OffloadBenchOptions& options, const TierBandwidth& bandwidth, const Emit& emit) {
  memory::install();
  std::map<int64_t, double> resident;
  for (const std::string weights : {"none", "cpu", "nvme"}) {
    serve::InferenceOffload offload;
    offload.weights = offload::parse_tier(weights, "offload.weights");
    offload.nvme_dir = options.nvme_dir, offload.prefetch = 1;
    model::Gpt gpt{nullptr};
    {
      std::optional<memory::HostScope> host;
      if (weights != "none") host.emplace();
      gpt = model::Gpt(inference_model(), 1);
    }
    serve::InferenceModel model(gpt, nullptr, "bench", offload);
    for (int64_t batch : options.batches) {
      memory::reset_peaks();
      const Decode d = decode_speed(model, batch, options.trials);
      nlohmann::json row = {{"part", "inference"}, {"weights", weights}, {"batch", batch},
                            {"decode_tokens_per_s", d.tokens_per_s}, {"forwards_per_s", d.forwards_per_s},
                            {"peak_counted_mib", memory::peak_bytes() / 1048576.0}};
      if (weights == "none") resident[batch] = d.tokens_per_s;
      if (const offload::WeightStream* stream = model.weight_stream()) {
        // The bound: every forward moves the blocks' bytes at the tier's measured bandwidth.
        const double tier = weights == "cpu" ? bandwidth.host : bandwidth.nvme;
        const double bound = batch * tier / static_cast<double>(stream->streamed_bytes());
        row["streamed_mib_per_forward"] = stream->streamed_bytes() / 1048576.0;
        row["tier_gb_s"] = tier / 1e9;
        row["bound_tokens_per_s"] = bound;
        row["fraction_of_bound"] = d.tokens_per_s / bound;
        if (resident.count(batch)) {
          // The roofline: neither faster than the transfer nor than the resident model computes.
          const double roof = std::min(bound, resident[batch]);
          row["vs_resident"] = d.tokens_per_s / resident[batch];
          row["roofline_tokens_per_s"] = roof;
          row["fraction_of_roofline"] = d.tokens_per_s / roof;
        }
      }
      emit(row);
    }
  }
}

void bench_training(comm::Runtime& runtime, const OffloadBenchOptions& options, const Emit& emit) {
  using Overrides = std::vector<std::string>;
  const std::string out = options.nvme_dir + "/meshtrain-bench-offload-" + std::to_string(runtime.rank());
  const std::vector<Overrides> variants = {
      {"parallel.zero_stage=1"},
      {"parallel.zero_stage=1", "offload.optimizer=cpu"},
      {"parallel.zero_stage=3"},
      {"parallel.zero_stage=3", "offload.optimizer=cpu"},
      {"parallel.zero_stage=3", "offload.optimizer=nvme"},
      {"parallel.zero_stage=3", "offload.optimizer=cpu", "offload.params=cpu"},
      {"parallel.zero_stage=3", "offload.optimizer=nvme", "offload.params=nvme"}};
  auto make_config = [&](const Overrides& variant) {
    Overrides all = {"model.preset=" + options.training_model, "training.batch=8", "training.micro_batch=8", "training.sample_tokens=0",
                     "training.eval_every=0", "training.log_every=1000", "checkpoint.every=0", "checkpoint.resume=false",
                     "run.out=" + out, "offload.nvme_dir=" + out + "/nvme"};
    all.insert(all.end(), variant.begin(), variant.end());
    train::TrainConfig config = train::TrainConfig::load("", all);
    config.steps = 1000;
    config.validate(runtime.size());
    return config;
  };
  // Memory: one variant at a time, after two steps (they are the timing's
  // warm-up): what each adds to the counters, the variants built before it
  // idle and alive, as the timing below needs them.
  struct Memory {
    double states = 0, peak = 0, host = 0, nvme = 0;
  };
  std::vector<Memory> memory(variants.size());
  std::vector<std::unique_ptr<train::Trainer>> trainers;
  for (size_t v = 0; v < variants.size(); ++v) {
    const int64_t before = memory::current_bytes();
    const int64_t host = offload::tier_stats(offload::Tier::kHost).current;
    const int64_t nvme = offload::tier_stats(offload::Tier::kNvme).current;
    trainers.push_back(std::make_unique<train::Trainer>(make_config(variants[v]), runtime.world()));
    train::StepResult result;
    for (int s = 0; s < 2; ++s) result = trainers.back()->step();
    memory[v] = {(result.memory.model_states - before) / 1048576.0, (result.memory.peak() - before) / 1048576.0,
                 (offload::tier_stats(offload::Tier::kHost).current - host) / 1048576.0,
                 (offload::tier_stats(offload::Tier::kNvme).current - nvme) / 1048576.0};
  }
  // Time: every variant alive, one step of each in turn per round (the
  // machine's drift touches them alike), medians over the rounds.
  std::vector<std::vector<double>> seconds(variants.size());
  for (int round = 0; round < 2 * options.trials + 1; ++round) {
    for (size_t v = 0; v < variants.size(); ++v) {
      const auto start = BenchClock::now();
      trainers[v]->step();
      seconds[v].push_back(seconds_since(start));
    }
  }
  std::map<std::string, double> baseline;  // median step of the resident run per stage
  for (size_t v = 0; v < variants.size(); ++v) {
    const double step = median(seconds[v]);
    if (variants[v].size() == 1) baseline[variants[v].front()] = step;
    std::string name;
    for (const std::string& o : variants[v]) name += (name.empty() ? "" : " ") + o;
    emit({{"part", "training"},
          {"layout", name},
          {"ranks", runtime.size()},
          {"parameters", trainers[v]->config().model.parameter_count()},
          {"step_s", step},
          {"vs_resident", baseline[variants[v].front()] / step},
          {"model_states_mib", memory[v].states},
          {"peak_mib", memory[v].peak},
          {"host_tier_mib", memory[v].host},
          {"nvme_tier_mib", memory[v].nvme}});
  }
}

}  // namespace meshtrain::apps::offload_bench
