// Continuous batching against generation alone: sequences joining a running
// batch at different steps, with different prompts, lengths and sampling,
// each give the tokens model::generate() gives that sequence by itself.
#include "meshtrain/serve/batch_engine.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>

namespace meshtrain::serve {
namespace {

model::Gpt small_model(bool llama) {
  model::GptConfig c = model::GptConfig::preset(llama ? "llama-tiny" : "tiny");
  c.layers = 2, c.context = 48, c.dropout = 0;
  return model::Gpt(c, 11);
}

GenerationRequest request(uint64_t id, int64_t prompt_length, int64_t tokens, double temperature, uint64_t seed) {
  GenerationRequest r;
  r.id = id;
  for (int64_t i = 0; i < prompt_length; ++i) r.prompt.push_back((id * 37 + i * 11) % 256);
  r.options.tokens = tokens;
  r.options.temperature = temperature;
  r.options.top_k = id % 2 ? 0 : 20;
  r.options.top_p = id % 3 ? 1.0 : 0.9;
  r.options.seed = seed;
  return r;
}

TEST(BatchEngine, SequencesJoiningAndLeavingGiveTheTokensOfEachAlone) {
  for (bool llama : {false, true}) {
    InferenceModel inference(small_model(llama), nullptr);
    // id -> (the step it arrives at, the request)
    std::vector<std::pair<int, GenerationRequest>> arrivals = {
        {0, request(1, 5, 12, 0.0, 1)}, {0, request(2, 9, 20, 0.8, 2)}, {0, request(3, 1, 6, 1.0, 3)},
        {2, request(4, 14, 10, 0.0, 4)}, {3, request(5, 3, 30, 0.7, 5)}, {7, request(6, 20, 8, 1.2, 6)},
        {7, request(7, 2, 16, 0.9, 7)}, {15, request(8, 30, 18, 0.0, 8)}};
    BatchEngine engine(inference, /*max_batch=*/4);
    std::map<uint64_t, std::vector<int64_t>> got;
    std::vector<GenerationRequest> waiting;
    size_t next = 0;
    int64_t largest_batch = 0;
    for (int step = 0; next < arrivals.size() || !waiting.empty() || engine.running() > 0; ++step) {
      while (next < arrivals.size() && arrivals[next].first <= step) waiting.push_back(arrivals[next++].second);
      const int64_t n = std::min<int64_t>(engine.room(), waiting.size());
      std::vector<GenerationRequest> joining(waiting.begin(), waiting.begin() + n);
      waiting.erase(waiting.begin(), waiting.begin() + n);
      for (const TokenEvent& e : engine.admit(joining)) got[e.id].push_back(e.token);
      largest_batch = std::max(largest_batch, engine.running());
      for (const TokenEvent& e : engine.step()) got[e.id].push_back(e.token);
    }
    EXPECT_EQ(largest_batch, 4);
    for (const auto& [step, r] : arrivals) {
      const at::Tensor alone = model::generate(inference.gpt(), at::tensor(r.prompt, at::kLong), r.options);
      const std::vector<int64_t> want(alone.data_ptr<int64_t>(), alone.data_ptr<int64_t>() + alone.numel());
      EXPECT_EQ(got[r.id], want) << (llama ? "llama" : "gpt2") << " request " << r.id;
    }
  }
}

TEST(BatchEngine, ACancelledSequenceLeavesTheOthersUnchanged) {
  InferenceModel inference(small_model(false), nullptr);
  BatchEngine engine(inference, 3);
  std::map<uint64_t, std::vector<int64_t>> got;
  for (const TokenEvent& e : engine.admit({request(1, 4, 10, 0.8, 1), request(2, 7, 10, 0.8, 2), request(3, 2, 10, 0.8, 3)})) {
    got[e.id].push_back(e.token);
  }
  for (int i = 0; engine.running() > 0; ++i) {
    if (i == 3) engine.cancel(2);
    for (const TokenEvent& e : engine.step()) got[e.id].push_back(e.token);
  }
  EXPECT_EQ(got[2].size(), 4u);
  for (uint64_t id : {1, 3}) {
    const GenerationRequest r = request(id, id == 1 ? 4 : 2, 10, 0.8, id);
    const at::Tensor alone = model::generate(inference.gpt(), at::tensor(r.prompt, at::kLong), r.options);
    EXPECT_EQ(got[id], std::vector<int64_t>(alone.data_ptr<int64_t>(), alone.data_ptr<int64_t>() + alone.numel()));
  }
}

// A request that fails leaves the batch alone: refused when admitted, or its
// sampling failing mid-way; the others give their tokens as if alone.
TEST(BatchEngine, AFailingRequestFailsAloneAndTheOthersGoOn) {
  InferenceModel inference(small_model(false), nullptr);
  BatchEngine engine(inference, 3);
  GenerationRequest bad = request(2, 5, 10, 0.8, 2);
  bad.options.temperature = std::numeric_limits<double>::quiet_NaN();  // past the server's own checks
  std::map<uint64_t, std::vector<int64_t>> got;
  std::map<uint64_t, std::string> errors;
  auto take = [&](const std::vector<TokenEvent>& events) {
    for (const TokenEvent& e : events) {
      if (!e.error.empty()) errors[e.id] = e.error;
      else got[e.id].push_back(e.token);
    }
  };
  take(engine.admit({request(1, 4, 10, 0.8, 1), bad, request(3, 2, 10, 0.8, 3)}));
  EXPECT_NE(errors[2].find("temperature"), std::string::npos) << errors[2];
  EXPECT_EQ(engine.running(), 2);
  // A row whose sampling throws (a vocabulary mask that leaves nothing: NaN
  // probabilities) fails at its step; the batch goes on.
  GenerationRequest empty = request(4, 3, 10, 0.8, 4);
  empty.options.sampleable = at::zeros({inference.config().vocab_size}, at::kBool);
  take(engine.admit({empty}));
  EXPECT_FALSE(errors[4].empty());
  while (engine.running() > 0) take(engine.step());
  EXPECT_EQ(got.count(2) + got.count(4), 0u);
  for (uint64_t id : {1, 3}) {
    const GenerationRequest r = request(id, id == 1 ? 4 : 2, 10, 0.8, id);
    const at::Tensor alone = model::generate(inference.gpt(), at::tensor(r.prompt, at::kLong), inference.with_split(r.options));
    EXPECT_EQ(got[id], std::vector<int64_t>(alone.data_ptr<int64_t>(), alone.data_ptr<int64_t>() + alone.numel())) << id;
  }
}

TEST(BatchEngine, RejectsWhatCannotBeServed) {
  InferenceModel inference(small_model(false), nullptr);
  BatchEngine engine(inference, 2);
  EXPECT_THROW(engine.check(request(1, 40, 9, 0.8, 1)), std::invalid_argument);  // 49 > 48
  EXPECT_NO_THROW(engine.check(request(1, 40, 8, 0.8, 1)));
  EXPECT_THROW(engine.check(request(1, 0, 8, 0.8, 1)), std::invalid_argument);
  EXPECT_THROW(engine.check(request(1, 3, 8, -1, 1)), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::serve
