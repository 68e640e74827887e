// Robust aggregation (Note [Robust aggregation]) against hand-computed
// values, and against poisoned updates: f attackers of n move the median,
// the trimmed mean and Krum by a bounded amount, the mean without bound.
#include "meshtrain/fl/config.h"
#include "meshtrain/fl/robust.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::fl {
namespace {

// One parameter [2] and one [1] per client.
std::vector<at::Tensor> update(double a, double b, double c) {
  return {at::tensor({a, b}, at::kFloat), at::tensor({c}, at::kFloat)};
}

Aggregation rule(const std::string& name) {
  Aggregation r;
  r.name = name;
  return r;
}

void expect_values(const std::vector<at::Tensor>& got, std::vector<double> want, const std::string& what) {
  ASSERT_EQ(got.size(), 2u) << what;
  EXPECT_EQ(got[0].sizes(), at::IntArrayRef({2})) << what;
  const std::vector<double> values = {got[0][0].item<double>(), got[0][1].item<double>(), got[1][0].item<double>()};
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(values[i], want[i], 1e-6) << what << " coordinate " << i;
}

TEST(RobustAggregation, EachRuleEqualsItsHandComputedValue) {
  const std::vector<std::vector<at::Tensor>> five = {update(1, 10, -1), update(2, 20, -2), update(3, 30, -3),
                                                     update(4, 40, -4), update(100, -50, 7)};
  const std::vector<double> examples = {1, 1, 1, 1, 4};
  // mean by examples: (1+2+3+4+400)/8, (10+20+30+40-200)/8, (-1-2-3-4+28)/8
  expect_values(aggregate(rule("mean"), five, examples), {51.25, -12.5, 2.25}, "mean");
  // median per coordinate: sorted {1,2,3,4,100} -> 3; {-50,10,20,30,40} -> 20; {-4,-3,-2,-1,7} -> -2
  expect_values(aggregate(rule("median"), five, examples), {3, 20, -2}, "median");
  // even n: the mean of the two middle values
  expect_values(aggregate(rule("median"), {five[0], five[1], five[2], five[4]}, {1, 1, 1, 1}), {2.5, 15, -1.5},
                "median of 4");
  Aggregation trimmed = rule("trimmed_mean");
  trimmed.trim_fraction = 0.2;  // one value dropped at each end of 5
  // {2,3,4} -> 3; {10,20,30} -> 20; {-3,-2,-1} -> -2
  expect_values(aggregate(trimmed, five, examples), {3, 20, -2}, "trimmed mean");
  // Krum, f = 1: each scored by its n - f - 2 = 2 nearest. Squared distances between honest i, j:
  // (i-j)²·(1 + 100 + 1) = 102 (i-j)². Client 2 (values 2, 20, -2): 102 + 102 = 204; client 3: 204;
  // clients 1 and 4: 102 + 408 = 510; the outlier: far more. The lowest, first of the ties: client 2.
  const std::vector<double> scores = krum_scores(five, 1);
  EXPECT_NEAR(scores[1], 204, 1e-9);
  EXPECT_NEAR(scores[2], 204, 1e-9);
  EXPECT_NEAR(scores[0], 510, 1e-9);
  EXPECT_GT(scores[4], 10000);
  expect_values(aggregate(rule("krum"), five, examples), {2, 20, -2}, "krum");
  Aggregation multi = rule("multi_krum");
  multi.keep = 2;  // clients 2 and 3, by examples (1 each)
  expect_values(aggregate(multi, five, examples), {2.5, 25, -2.5}, "multi-krum of 2");
  multi.keep = 0;  // n - f = 4: the honest four
  expect_values(aggregate(multi, five, examples), {2.5, 25, -2.5}, "multi-krum of n - f");
}

TEST(RobustAggregation, PoisonedUpdatesMoveRobustRulesByABoundedAmount) {
  // 6 honest clients near 1.0 and f attackers sending 1e30 or the honest mean flipped and scaled.
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<std::vector<at::Tensor>> honest;
  for (int i = 0; i < 6; ++i) honest.push_back({1 + 0.1 * at::randn({64}, g), 1 + 0.1 * at::randn({8, 4}, g)});
  for (const char* attack : {"huge", "sign_flip"}) {
    for (int64_t f : {1, 2}) {
      std::vector<std::vector<at::Tensor>> updates = honest;
      std::vector<double> examples(updates.size(), 10);
      for (int64_t k = 0; k < f; ++k) {
        const double value = std::string(attack) == "huge" ? 1e30 : -10.0;
        updates.push_back({at::full({64}, value), at::full({8, 4}, value)});
        examples.push_back(std::string(attack) == "huge" ? 4.6e18 : 10);  // a claimed 2^62 examples
      }
      const std::string what = std::string(attack) + " x" + std::to_string(f);
      const auto mean = aggregate(rule("mean"), updates, examples);
      EXPECT_GT((mean[0] - 1).abs().max().item<double>(), 0.5) << what << ": the mean is poisoned (the test's premise)";
      Aggregation trimmed = rule("trimmed_mean");
      trimmed.trim_fraction = 0.25;  // 2 of 8 at each end
      Aggregation krum = rule("krum");
      krum.byzantine = 2;
      Aggregation multi = rule("multi_krum");
      multi.byzantine = 2;
      for (const Aggregation& r : {rule("median"), trimmed, krum, multi}) {
        const auto got = aggregate(r, updates, examples);
        for (const at::Tensor& t : got) {
          EXPECT_LT((t - 1).abs().max().item<double>(), 0.5) << what << ": " << r.name << " moved by the attack";
        }
      }
    }
  }
}

// fl.clip_norm: an update of 1e30 claiming 2^62 examples moves FedAvg's mean
// by at most the bound; updates within it are untouched.
TEST(RobustAggregation, ServerClipBoundsWhatOneClientCanDoToTheMean) {
  std::vector<std::vector<at::Tensor>> updates = {update(0.1, 0.2, 0.2), update(0.2, 0.1, 0.2), update(1e30, 1e30, 1e30)};
  std::vector<double> examples = {10, 10, 4.6e18};
  const double bound = 1.0;
  EXPECT_NEAR(clip_update(updates[0], bound), 0.3, 1e-6);
  EXPECT_NEAR(updates[0][0][0].item<double>(), 0.1, 1e-7);  // within the bound: as it was
  EXPECT_GT(clip_update(updates[2], bound), 1e30);
  const auto mean = aggregate(rule("mean"), updates, examples);
  double squares = 0;
  for (const at::Tensor& t : mean) squares += t.pow(2).sum().item<double>();
  EXPECT_LE(std::sqrt(squares), bound + 1e-6);
  EXPECT_TRUE(std::isfinite(squares));
}

TEST(RobustAggregation, TooFewUpdatesForKrumAndSecureAggregationAreRefusedByName) {
  const std::vector<std::vector<at::Tensor>> four = {update(1, 1, 1), update(2, 2, 2), update(3, 3, 3), update(4, 4, 4)};
  Aggregation krum = rule("krum");
  krum.byzantine = 1;  // needs 5
  try {
    aggregate(krum, four, {1, 1, 1, 1});
    ADD_FAILURE() << "krum ran on 4 updates with f = 1";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("at least 5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rule("mode").validate(), std::invalid_argument);
  FlConfig c;
  c.secagg = true;
  c.tls.insecure = true;
  c.min_fit = c.min_available = c.threshold = 2;
  c.aggregation.name = "median";
  try {
    c.validate();
    ADD_FAILURE() << "median with secure aggregation was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("sees only their sum"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::fl
