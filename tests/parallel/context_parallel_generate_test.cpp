// Generation with the KV cache split over cp ranks (Note [Context-parallel
// generation]) against model::generate in one process with its cache: the
// same tokens, greedy and sampled, for GPT-2 and Llama styles with GQA, a
// sliding window and a soft-cap, prompts of lengths the zigzag split does
// not divide; and each rank's cache holds its share of the sequence.
#include "meshtrain/comm/agree.h"
#include "meshtrain/parallel/context_parallel_generate.h"
#include "tests/harness/mpi_env.h"

#include <gtest/gtest.h>

namespace meshtrain::parallel {
namespace {

using testing::world;

model::Gpt small_model(const std::string& style) {
  model::GptConfig c = model::GptConfig::preset(style == "gpt-2" ? "tiny" : "llama-tiny");
  c.layers = 2, c.context = 96, c.dropout = 0;
  if (style == "gqa-window-softcap") c.kv_heads = c.heads / 2, c.sliding_window = 9, c.attn_softcap = 3.0;
  return model::Gpt(c, 7);
}

at::Tensor prompt_of(int64_t length) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < length; ++i) ids.push_back((i * 29 + 3) % 200);
  return at::tensor(ids, at::kLong);
}

TEST(ContextParallelGeneration, EqualsOneProcessWithTheCacheSplit) {
  const int cp = world()->size();
  if (cp < 2) GTEST_SKIP() << "run at 2 ranks or more";
  for (const std::string style : {"gpt-2", "llama", "gqa-window-softcap"}) {
    model::Gpt model = small_model(style);
    for (int64_t length : {1, 2, 23, 61}) {
      for (double temperature : {0.0, 0.9}) {
        model::SampleOptions o;
        o.tokens = 14;
        o.temperature = temperature;
        o.top_k = 0;
        o.seed = 5;
        const at::Tensor want = model::generate(model, prompt_of(length), o);
        std::vector<int64_t> cached;
        const at::Tensor got = generate_context_parallel(model, prompt_of(length), o, world(), &cached);
        const std::string what = style + ", prompt " + std::to_string(length) + ", temperature " +
                                 std::to_string(temperature) + ", cp " + std::to_string(cp);
        ASSERT_TRUE(at::equal(got, want)) << what << "\n got " << got << "\nwant " << want;
        // Every token but the last generated is cached once, spread evenly.
        int64_t total = 0, most = 0, least = length + o.tokens;
        for (int64_t c : cached) total += c, most = std::max(most, c), least = std::min(least, c);
        EXPECT_EQ(total, length + o.tokens - 1) << what;
        EXPECT_LE(most - least, 2) << what;
      }
    }
  }
}

TEST(ContextParallelGeneration, RefusesASequenceLongerThanTheContext) {
  model::Gpt model = small_model("gpt-2");
  model::SampleOptions o;
  o.tokens = 40;
  try {
    generate_context_parallel(model, prompt_of(60), o, world());
    ADD_FAILURE() << "100 tokens in a context of 96";
  } catch (const comm::AgreedError& e) {  // every rank alike: said once
    EXPECT_NE(std::string(e.what()).find("exceed the context 96"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::parallel
