// Sampling options (top-p, the token callback) and the text stream (stop
// strings, text held back until final).
#include "meshtrain/model/generate.h"
#include "meshtrain/model/text_stream.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace meshtrain::model {
namespace {

TEST(Sampling, TopPKeepsTheLikeliestTokensUpToTheMassAndTheOneThatCrossesIt) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps tokens 0 and 1 (0.5 < 0.7; 0.8 crosses it).
  const at::Tensor logits = at::log(at::tensor({0.15f, 0.5f, 0.05f, 0.3f})).view({1, 4});
  SampleOptions options;
  options.temperature = 1, options.top_k = 0, options.top_p = 0.7;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<int> counts(4);
  for (int i = 0; i < 4000; ++i) ++counts[pick_next(logits, options, g).item<int64_t>()];
  EXPECT_EQ(counts[0] + counts[2], 0) << "tokens outside the nucleus were drawn";
  EXPECT_NEAR(counts[1] / 4000.0, 0.5 / 0.8, 0.03);
  options.top_p = 1e-6;  // only the likeliest: greedy
  for (int i = 0; i < 50; ++i) EXPECT_EQ(pick_next(logits, options, g).item<int64_t>(), 1);
  options.top_p = 1.5;
  EXPECT_THROW(options.validate(), std::invalid_argument);
}

// Note [Safe sampling]: settings that overflowed or masked everything, and ids
// that may not be sampled.
TEST(Sampling, ExtremeSettingsAreSafeAndMaskedIdsAreNeverPicked) {
  const at::Tensor logits = at::tensor({1.0f, 3.0f, 2.5f, -4.0f, 3.2f}).view({1, 5});
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
  SampleOptions options;
  options.top_k = 0;
  for (double t : {1e-38, 1e-5, 0.0099}) {  // below kGreedyBelow: greedy (dividing overflowed to NaN)
    options.temperature = t;
    EXPECT_EQ(pick_next(logits, options, g).item<int64_t>(), 4) << t;
  }
  options.temperature = 1.0;
  options.top_p = 1e-46;  // rounds to 0 in float: the likeliest is kept all the same
  for (int i = 0; i < 20; ++i) EXPECT_EQ(pick_next(logits, options, g).item<int64_t>(), 4);
  options.top_p = 1.0;
  options.temperature = 2.0;
  options.sampleable = at::tensor({1, 1, 0, 1, 0}).to(at::kBool);  // ids 2 and 4 cannot be decoded
  std::vector<int> counts(5);
  for (int i = 0; i < 2000; ++i) ++counts[pick_next(logits, options, g).item<int64_t>()];
  EXPECT_EQ(counts[2] + counts[4], 0);
  EXPECT_GT(counts[1], 0);
  options.temperature = 0;
  EXPECT_EQ(pick_next(logits, options, g).item<int64_t>(), 1) << "greedy picks the likeliest sampleable id";
  options.sampleable = at::ones({3}, at::kBool);  // a tokenizer shorter than the vocabulary: ids 3, 4 padding
  EXPECT_EQ(pick_next(logits, options, g).item<int64_t>(), 1);
  const at::Tensor broken = at::tensor({1.0f, NAN, 0.0f}).view({1, 3});
  EXPECT_THROW(pick_next(broken, options, g), std::runtime_error);
  options.temperature = std::numeric_limits<double>::infinity();
  EXPECT_THROW(options.validate(), std::invalid_argument);
}

TEST(Sampling, OnTokenSeesEveryTokenAndEndsTheGenerationEarly) {
  GptConfig c = GptConfig::preset("tiny");
  c.layers = 1, c.context = 32;
  Gpt gpt(c, 1);
  SampleOptions options;
  options.tokens = 10;
  std::vector<int64_t> seen;
  options.on_token = [&](int64_t t) {
    seen.push_back(t);
    return seen.size() < 4;
  };
  const at::Tensor out = generate(gpt, at::tensor({1, 2, 3}, at::kLong), options);
  ASSERT_EQ(out.numel(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i].item<int64_t>(), seen[i]);
  options.on_token = nullptr;
  EXPECT_TRUE(generate(gpt, at::tensor({1, 2, 3}, at::kLong), options).narrow(0, 0, 4).equal(out));
}

std::string bytes(const std::vector<int64_t>& tokens) { return std::string(tokens.begin(), tokens.end()); }

// Feeds `text` one byte per token; returns the pieces pushed, then finish()'s.
std::vector<std::string> stream(const std::string& text, std::vector<std::string> stop, bool* stopped = nullptr) {
  TextStream s(bytes, std::move(stop));
  std::vector<std::string> pieces;
  for (unsigned char c : text) pieces.push_back(s.push(c));
  pieces.push_back(s.finish());
  if (stopped) *stopped = s.stopped();
  return pieces;
}

std::string joined(const std::vector<std::string>& pieces) {
  std::string all;
  for (const std::string& p : pieces) all += p;
  return all;
}

TEST(TextStream, EndsBeforeTheFirstStopStringAndNeverTakesTextBack) {
  bool stopped = false;
  EXPECT_EQ(joined(stream("Hello, world. Bye", {"ld.", "Bye"}, &stopped)), "Hello, wor");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(joined(stream("Hello", {"xyz"}, &stopped)), "Hello");
  EXPECT_FALSE(stopped);
  // "wo" is held while it could begin "world"; "wa" then shows it cannot.
  const auto pieces = stream("a wave", {"world"});
  EXPECT_EQ(pieces[2], "");    // after "a w"
  EXPECT_EQ(pieces[3], "wa");  // after "a wa"
  EXPECT_EQ(joined(pieces), "a wave");
  // A stop string that begins inside held-back text.
  EXPECT_EQ(joined(stream("abab!", {"ab!"})), "ab");
}

TEST(TextStream, HoldsBackAnIncompleteUtf8Character) {
  const std::string text = "a\xC3\xA9\xE2\x82\xAC";  // a, é (2 bytes), € (3 bytes)
  const auto pieces = stream(text, {});
  EXPECT_EQ(pieces[0], "a");
  EXPECT_EQ(pieces[1], "");
  EXPECT_EQ(pieces[2], "\xC3\xA9");
  EXPECT_EQ(pieces[3], "");
  EXPECT_EQ(pieces[4], "");
  EXPECT_EQ(pieces[5], "\xE2\x82\xAC");
  EXPECT_EQ(incomplete_utf8_tail("x\xF0\x9F"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("x\xF0\x9F\x98\x80"), 0u);
  // Generation that ends inside a character (max tokens) leaves its first bytes out: no U+FFFD.
  const auto cut = stream("ab\xE2\x82", {});
  EXPECT_EQ(cut.back(), "");
  EXPECT_EQ(joined(cut), "ab");
}

}  // namespace
}  // namespace meshtrain::model
