// Continuous batching under tensor parallel: a request that fails leaves the
// batch on every rank alike, and the others give the tokens of one process.
#include "meshtrain/serve/batch_engine.h"
#include "tests/harness/mpi_env.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>

namespace meshtrain::serve {
namespace {

using testing::world;

model::Gpt small_model() {
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.layers = 2, c.context = 48, c.dropout = 0;
  return model::Gpt(c, 11);
}

GenerationRequest request(uint64_t id, int64_t prompt_length, double temperature) {
  GenerationRequest r;
  r.id = id;
  for (int64_t i = 0; i < prompt_length; ++i) r.prompt.push_back((id * 37 + i * 11) % 256);
  r.options.tokens = 12;
  r.options.temperature = temperature;
  r.options.top_k = 0;
  r.options.seed = id;
  return r;
}

TEST(TensorParallelServing, AFailingRequestFailsOnEveryRankAndTheOthersGoOn) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "tp over all ranks: 2 or 4 (the model has 4 heads)";
  InferenceModel split(small_model(), world());
  InferenceModel whole(small_model(), nullptr);
  BatchEngine engine(split, 3);
  GenerationRequest bad = request(2, 5, 0.8);
  bad.options.temperature = std::numeric_limits<double>::quiet_NaN();
  std::map<uint64_t, std::vector<int64_t>> got;
  std::map<uint64_t, std::string> errors;
  auto take = [&](const std::vector<TokenEvent>& events) {
    for (const TokenEvent& e : events) {
      if (!e.error.empty()) errors[e.id] = e.error;
      else got[e.id].push_back(e.token);
    }
  };
  take(engine.admit({request(1, 4, 0.8), bad, request(3, 2, 1.0)}));
  GenerationRequest empty = request(4, 3, 0.9);  // its sampling fails at every step on every rank
  empty.options.sampleable = at::zeros({split.config().vocab_size}, at::kBool);
  take(engine.admit({empty}));
  while (engine.running() > 0) take(engine.step());
  EXPECT_EQ(errors.size(), 2u);
  EXPECT_TRUE(errors.count(2) && errors.count(4));
  for (uint64_t id : {1, 3}) {
    const GenerationRequest r = request(id, id == 1 ? 4 : 2, id == 1 ? 0.8 : 1.0);
    const at::Tensor alone = model::generate(whole.gpt(), at::tensor(r.prompt, at::kLong), whole.with_split(r.options));
    EXPECT_EQ(got[id], std::vector<int64_t>(alone.data_ptr<int64_t>(), alone.data_ptr<int64_t>() + alone.numel()))
        << "rank " << world()->rank() << " request " << id;
  }
}

}  // namespace
}  // namespace meshtrain::serve
