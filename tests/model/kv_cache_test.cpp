// The KV cache against full recomputation: logits at every position, and the
// tokens of greedy and seeded sampling, for both GPT styles.
#include "meshtrain/model/generate.h"
#include "meshtrain/model/kv_cache.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

GptConfig small_model(bool llama) {
  GptConfig c = GptConfig::preset(llama ? "llama-tiny" : "tiny");
  c.layers = 2, c.context = 16, c.dropout = 0;
  return c;
}

TEST(KvCache, PrefillThenOneTokenAtATimeGivesTheFullForwardsLogits) {
  for (int style : {0, 1, 2}) {  // gpt2, llama, llama with grouped-query attention
    const bool llama = style > 0;
    GptConfig config = small_model(llama);
    if (style == 2) config.kv_heads = 2;
    Gpt gpt(config, 3);
    gpt->eval();
    torch::NoGradGuard no_grad;
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor tokens = at::randint(0, gpt->config().vocab_size, {2, 16}, g, at::kLong);
    const at::Tensor want = gpt->forward(tokens);
    KvCache cache(gpt);
    const std::unique_ptr<AttentionSwap> attached = cache.attach(*gpt);
    std::vector<at::Tensor> got = {gpt->forward(cache.next(tokens.narrow(1, 0, 5)))};  // prefill 5
    got.push_back(gpt->forward(cache.next(tokens.narrow(1, 5, 3))));                    // 3 at once
    for (int64_t t = 8; t < 16; ++t) got.push_back(gpt->forward(cache.next(tokens.narrow(1, t, 1))));
    EXPECT_EQ(cache.length(), 16);
    EXPECT_TRUE(at::allclose(at::cat(got, 1), want, 1e-5, 1e-5)) << (llama ? "llama" : "gpt2") << ": differs by "
        << (at::cat(got, 1) - want).abs().max().item<double>();
    EXPECT_THROW(cache.next(tokens.narrow(1, 0, 1)), std::invalid_argument);  // beyond the context
    cache.clear();
    EXPECT_TRUE(at::allclose(gpt->forward(cache.next(tokens)), want, 1e-5, 1e-5));  // cleared: a fresh sequence
  }
}

TEST(KvCache, GenerationGivesTheTokensOfFullRecomputation) {
  for (bool llama : {false, true}) {
    Gpt gpt(small_model(llama), 3);
    const at::Tensor prompt = at::tensor({72, 101, 108, 108, 111}, at::kLong);
    for (double temperature : {0.0, 0.9}) {
      SampleOptions o;
      o.tokens = 24;  // past the context (16): the window slides, each step a full forward
      o.temperature = temperature;
      o.seed = 7;
      o.kv_cache = true;
      const at::Tensor cached = generate(gpt, prompt, o);
      o.kv_cache = false;
      const at::Tensor full = generate(gpt, prompt, o);
      EXPECT_TRUE(at::equal(cached, full)) << (llama ? "llama" : "gpt2") << ", temperature " << temperature;
    }
  }
}

TEST(KvCache, ABatchOfPromptsOfDifferentLengthsGivesEachPromptsOwnTokens) {
  for (bool llama : {false, true}) {
    Gpt gpt(small_model(llama), 3);
    const std::vector<at::Tensor> prompts = {at::tensor({72, 101, 108, 108, 111}, at::kLong), at::tensor({87}, at::kLong),
                                             at::tensor({65, 32, 98}, at::kLong), at::empty({0}, at::kLong)};
    for (double temperature : {0.0, 0.9}) {
      SampleOptions o;
      o.tokens = 10;  // 5 + 10 <= the context (16)
      o.temperature = temperature;
      o.seed = 11;
      const std::vector<at::Tensor> batch = generate_batch(gpt, prompts, o);
      ASSERT_EQ(batch.size(), prompts.size());
      for (size_t r = 0; r < prompts.size(); ++r) {
        EXPECT_TRUE(at::equal(batch[r], generate(gpt, prompts[r], o)))
            << (llama ? "llama" : "gpt2") << ", temperature " << temperature << ", prompt " << r;
      }
    }
    SampleOptions too_long;
    too_long.tokens = 12;
    EXPECT_THROW(generate_batch(gpt, prompts, too_long), std::invalid_argument);
  }
}

}  // namespace
}  // namespace meshtrain::model
