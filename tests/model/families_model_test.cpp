// The open families' features in the model alone: parameter counts against
// the built modules, the KV cache against full recomputation with sliding
// windows, soft-caps and QK-norm, the rolling window's memory bounded by the
// window over a long generation (counting allocator), and bad settings
// refused by name.
#include "meshtrain/model/generate.h"
#include "meshtrain/model/gpt_config_keys.h"
#include "meshtrain/model/kv_cache.h"
#include "meshtrain/util/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

GptConfig llama_style() {
  GptConfig c = GptConfig::preset("llama-tiny");
  c.layers = 2, c.width = 64, c.heads = 4, c.context = 32, c.dropout = 0, c.vocab_size = 96;
  return c;
}

// One model per family's features, shrunk.
std::vector<std::pair<std::string, GptConfig>> variants() {
  std::vector<std::pair<std::string, GptConfig>> out;
  GptConfig mistral = llama_style();
  mistral.kv_heads = 2, mistral.sliding_window = 5;
  out.push_back({"mistral", mistral});
  GptConfig qwen3 = llama_style();
  qwen3.kv_heads = 2, qwen3.head_size = 24, qwen3.qk_norm = QkNorm::kHead, qwen3.qkv_bias = true;
  out.push_back({"qwen3", qwen3});
  GptConfig gemma = llama_style();
  gemma.mlp = MlpStyle::kGeglu, gemma.norm_placement = NormPlacement::kSandwich, gemma.norm_plus_one = true, gemma.embed_scale = true;
  gemma.attn_softcap = 3, gemma.logit_softcap = 4, gemma.query_scale = 10, gemma.sliding_window = 6;
  gemma.sliding_every = 2, gemma.tie_embeddings = true;
  out.push_back({"gemma2", gemma});
  GptConfig olmo = llama_style();
  olmo.norm_placement = NormPlacement::kPost, olmo.qk_norm = QkNorm::kWidth, olmo.attention_bias = true, olmo.mlp_bias = true;
  olmo.rope_scaling = RopeScaling::kYarn, olmo.rope_factor = 2, olmo.rope_original_context = 8, olmo.rotary_fraction = 0.5;
  out.push_back({"olmo2 + yarn, partial rotary, biases", olmo});
  GptConfig moe = llama_style();
  moe.moe_experts = 6, moe.moe_top_k = 3, moe.moe_every = 1, moe.moe_capacity_factor = 0, moe.moe_norm_topk = false;
  moe.moe_shared_hidden = 40, moe.moe_hidden = 24, moe.qk_norm = QkNorm::kHead, moe.rope_scaling = RopeScaling::kLlama3;
  moe.rope_factor = 4, moe.rope_original_context = 8;
  out.push_back({"qwen-moe + llama3 rope", moe});
  return out;
}

TEST(Families, ParameterCountsEqualTheBuiltModel) {
  for (const auto& [name, config] : variants()) {
    Gpt gpt(config, 1);
    int64_t built = 0;
    for (const at::Tensor& p : gpt->parameters()) built += p.numel();
    EXPECT_EQ(built, config.parameter_count()) << name;
  }
}

TEST(Families, KvCacheGivesTheFullForwardsLogits) {
  for (const auto& [name, config] : variants()) {
    Gpt gpt(config, 3);
    gpt->eval();
    torch::NoGradGuard no_grad;
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor tokens = at::randint(0, config.vocab_size, {2, 20}, g, at::kLong);
    const at::Tensor want = gpt->forward(tokens);
    for (bool rolling : {false, true}) {
      KvCache cache(gpt);
      cache.set_rolling(rolling);
      std::vector<at::Tensor> got;
      {
        const std::unique_ptr<AttentionSwap> attached = cache.attach(*gpt);
        got.push_back(gpt->forward(cache.next(tokens.narrow(1, 0, 7))));  // prefill 7
        got.push_back(gpt->forward(cache.next(tokens.narrow(1, 7, 3))));  // 3 at once
        for (int64_t t = 10; t < 20; ++t) got.push_back(gpt->forward(cache.next(tokens.narrow(1, t, 1))));
      }
      EXPECT_EQ(cache.length(), 20) << name;
      const double diff = (at::cat(got, 1) - want).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << name << (rolling ? ", rolling window" : "");
    }
  }
}

SampleOptions greedy(int64_t tokens) {
  SampleOptions options;
  options.tokens = tokens;
  options.temperature = 0;
  return options;
}

TEST(Families, GreedyGenerationWithTheCacheEqualsFullRecompute) {
  for (const auto& [name, config] : variants()) {
    Gpt gpt(config, 4);
    SampleOptions options = greedy(24);
    const at::Tensor prompt = at::arange(5, 11, at::kLong);
    const at::Tensor cached = generate(gpt, prompt, options);
    options.kv_cache = false;
    EXPECT_TRUE(at::equal(cached, generate(gpt, prompt, options))) << name;
  }
}

// The serving path's batches: prompts of different lengths, left-padded in
// one cache (the padding hidden beside the window and the soft-cap).
TEST(Families, ABatchOfPromptsGivesEachPromptsOwnTokens) {
  for (const auto& [name, config] : variants()) {
    Gpt gpt(config, 6);
    const SampleOptions options = greedy(12);
    const std::vector<at::Tensor> prompts = {at::arange(3, 12, at::kLong), at::arange(20, 23, at::kLong)};
    const std::vector<at::Tensor> batch = generate_batch(gpt, prompts, options);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_TRUE(at::equal(batch[i], generate(gpt, prompts[i], options))) << name << ", prompt " << i;
    }
  }
}

// Bytes a generation of `tokens` tokens adds at its peak over what was held before.
int64_t generation_peak(Gpt& gpt, int64_t tokens) {
  const SampleOptions options = greedy(tokens);
  const at::Tensor prompt = at::arange(1, 5, at::kLong);
  const int64_t before = memory::current_bytes();
  memory::reset_peaks();
  generate(gpt, prompt, options);
  return memory::peak_bytes() - before;
}

TEST(Families, RollingWindowCacheStaysBoundedByTheWindow) {
  memory::install();
  GptConfig config = llama_style();
  config.context = 512, config.layers = 2, config.kv_heads = 4;
  GptConfig windowed = config;
  windowed.sliding_window = 8;
  Gpt full(config, 5), rolling(windowed, 5);
  // One slot of keys and values over both layers: 2 layers x (k + v) x 4 heads x 16 x 4 bytes.
  const int64_t slot = 2 * 2 * 4 * 16 * 4;
  const int64_t full_short = generation_peak(full, 60), full_long = generation_peak(full, 400);
  const int64_t rolling_short = generation_peak(rolling, 60), rolling_long = generation_peak(rolling, 400);
  // Without a window the cache grows with the sequence (340 more slots, rooms doubling);
  // with one, the longer generation holds no more than the shorter.
  EXPECT_GE(full_long - full_short, 300 * slot) << full_short << " -> " << full_long << " bytes";
  // (The generated ids themselves grow by 8 bytes a token.)
  EXPECT_LE(rolling_long - rolling_short, 8 * slot) << rolling_short << " -> " << rolling_long << " bytes";
  EXPECT_LE(rolling_long, full_long - 300 * slot);
}

TEST(Families, SettingsNoFamilyHasAreRefusedByName) {
  auto refused = [](const std::function<void(GptConfig&)>& change, const std::string& key) {
    GptConfig c = llama_style();
    change(c);
    try {
      c.validate();
      ADD_FAILURE() << key << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("model." + key), std::string::npos) << e.what();
    }
  };
  // A name no family has is refused as it is read (Note [Model keys]), naming the key and the names it takes.
  auto named = [](const std::string& key, const std::string& text) {
    GptConfig c = llama_style();
    config::Value v;
    v.s = text;
    try {
      find_model_key(key)->key.set(c, v);
      ADD_FAILURE() << key << " = " << text << " was accepted";
    } catch (const config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(named("rope_scaling", "dynamic"), "model.rope_scaling = \"dynamic\": use \"none\", \"linear\", \"llama3\" or \"yarn\"");
  EXPECT_EQ(named("qk_norm", "layer"), "model.qk_norm = \"layer\": use \"none\", \"head\" or \"width\"");
  EXPECT_EQ(named("norm_placement", "peri"), "model.norm_placement = \"peri\": use \"pre\", \"post\" or \"sandwich\"");
  refused([](GptConfig& c) { c.rope_scaling = RopeScaling::kLlama3, c.rope_factor = 8; }, "rope_original_context");
  refused([](GptConfig& c) { c.norm = NormStyle::kLayerNorm, c.norm_plus_one = true; }, "norm_plus_one");
  refused([](GptConfig& c) { c.rotary_fraction = 0; }, "rotary_fraction");
  refused([](GptConfig& c) { c.sliding_every = 0; }, "sliding_every");
  refused([](GptConfig& c) { c.moe_experts = 4, c.moe_top_k = 5; }, "moe_top_k");
}

}  // namespace
}  // namespace meshtrain::model
