// ZeRO-Inference: a model several times larger than the device's memory
// limit generates, with its blocks streamed from the host or NVMe tier, the
// tokens it generates fully resident, and the counted peak stays under the
// limit. Also through the serving engine (continuous batching).
#include "meshtrain/offload/tier.h"
#include "meshtrain/serve/batch_engine.h"
#include "meshtrain/util/memory.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>

namespace meshtrain::offload {
namespace {

model::GptConfig deep_config(bool llama) {
  model::GptConfig c = model::GptConfig::preset(llama ? "llama-tiny" : "tiny");
  c.layers = 16, c.width = 128, c.heads = 4, c.context = 64, c.dropout = 0;
  if (llama) c.kv_heads = 2;
  return c;
}

int64_t parameter_bytes(model::Gpt& gpt) {
  int64_t total = 0;
  for (const at::Tensor& p : gpt->parameters()) total += p.numel() * p.element_size();
  return total;
}

std::vector<int64_t> tokens_of(const at::Tensor& t) { return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()}; }

struct Generated {
  std::vector<std::vector<int64_t>> tokens;  // greedy, sampled, and a batch of two
  int64_t peak = 0;
};

Generated generate_all(serve::InferenceModel& inference) {
  memory::reset_peaks();
  Generated run;
  model::SampleOptions greedy;
  greedy.tokens = 24, greedy.temperature = 0;
  model::SampleOptions sampled = greedy;
  sampled.temperature = 0.9, sampled.top_k = 0, sampled.seed = 5;
  const at::Tensor prompt = at::tensor(std::vector<int64_t>{3, 17, 99, 4, 200, 31}, at::kLong);
  run.tokens.push_back(tokens_of(model::generate(inference.gpt(), prompt, inference.with_split(greedy))));
  run.tokens.push_back(tokens_of(model::generate(inference.gpt(), prompt, inference.with_split(sampled))));
  for (const at::Tensor& t : model::generate_batch(inference.gpt(), {prompt, prompt.narrow(0, 0, 2)}, inference.with_split(sampled))) {
    run.tokens.push_back(tokens_of(t));
  }
  run.peak = memory::peak_bytes();
  return run;
}

TEST(WeightStream, AModelFourTimesTheLimitGeneratesTheResidentTokens) {
  memory::install();
  const std::string nvme_dir = (std::filesystem::temp_directory_path() / "meshtrain-weight-stream-test").string();
  std::filesystem::create_directories(nvme_dir);
  for (bool llama : {false, true}) {
    Generated resident;
    int64_t model_bytes = 0;
    {
      serve::InferenceModel inference(model::Gpt(deep_config(llama), 7), nullptr);
      model_bytes = parameter_bytes(inference.gpt());
      resident = generate_all(inference);
    }
    const int64_t limit = model_bytes / 4;
    for (const char* tier : {"cpu", "nvme"}) {
      for (const char* kv : {"device", "cpu"}) {
        serve::InferenceOffload offload;
        offload.weights = parse_tier(tier, "offload.weights"), offload.kv = parse_tier(kv, "offload.kv");
        offload.nvme_dir = nvme_dir, offload.prefetch = 1;
        const int64_t host_before = tier_stats(Tier::kHost).current, nvme_before = tier_stats(Tier::kNvme).current;
        model::Gpt gpt{nullptr};
        {
          memory::HostScope host;  // built in host memory, as a large model would be
          gpt = model::Gpt(deep_config(llama), 7);
        }
        serve::InferenceModel inference(gpt, nullptr, "streamed", offload);
        const int64_t streamed = inference.weight_stream()->streamed_bytes();
        EXPECT_GT(streamed, model_bytes * 3 / 4);
        EXPECT_GE((std::string(tier) == "cpu" ? tier_stats(Tier::kHost).current - host_before
                                              : tier_stats(Tier::kNvme).current - nvme_before),
                  streamed);
        memory::set_limit(limit);
        Generated run;
        try {
          run = generate_all(inference);
        } catch (...) {
          memory::set_limit(0);
          throw;
        }
        memory::set_limit(0);
        const std::string what = std::string(llama ? "llama" : "gpt2") + " weights " + tier + " kv " + kv;
        EXPECT_EQ(run.tokens, resident.tokens) << what;
        EXPECT_LT(run.peak, limit) << what;
        // At most the block computing and the one prefetched are on the device.
        EXPECT_LT(run.peak, model_bytes - streamed + 2 * inference.weight_stream()->largest_block_bytes() + (4 << 20)) << what;
      }
    }
  }
  std::filesystem::remove_all(nvme_dir);
}

TEST(WeightStream, ContinuousBatchingWithStreamedWeightsGivesTheResidentTokens) {
  memory::install();
  auto run = [](serve::InferenceOffload offload) {
    serve::InferenceModel inference(model::Gpt(deep_config(false), 3), nullptr, "m", offload);
    serve::BatchEngine engine(inference, 3);
    std::vector<serve::GenerationRequest> requests(3);
    for (uint64_t i = 0; i < 3; ++i) {
      requests[i].id = i;
      for (int64_t t = 0; t < 3 + 4 * static_cast<int64_t>(i); ++t) requests[i].prompt.push_back((i * 31 + t * 7) % 256);
      requests[i].options.tokens = 10 + 3 * static_cast<int64_t>(i);
      requests[i].options.temperature = i == 0 ? 0.0 : 0.8;
      requests[i].options.seed = i;
    }
    std::map<uint64_t, std::vector<int64_t>> got;
    for (const serve::TokenEvent& e : engine.admit({requests[0], requests[1]})) got[e.id].push_back(e.token);
    for (int step = 0; engine.running() > 0; ++step) {
      if (step == 2) {
        for (const serve::TokenEvent& e : engine.admit({requests[2]})) got[e.id].push_back(e.token);
      }
      for (const serve::TokenEvent& e : engine.step()) got[e.id].push_back(e.token);
    }
    return got;
  };
  const auto resident = run({});
  serve::InferenceOffload offload;
  offload.weights = Tier::kHost, offload.kv = Tier::kHost, offload.prefetch = 2;
  EXPECT_EQ(run(offload), resident);
}

TEST(WeightStream, BadOptionsAreRefusedByName) {
  // A tier's name is read once, into the typed tier (offload::parse_tier), naming the key when it is none.
  EXPECT_THROW(
      {
        try {
          parse_tier("disk", "offload.weights");
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("offload.weights"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
  serve::InferenceOffload offload;
  offload.weights = Tier::kHost, offload.kv = Tier::kNvme;
  EXPECT_THROW(offload.validate(), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::offload
