// The fused CPU operators under an autocast dtype their kernels do not have
// (fp16): ATen's compositions run instead (fused::eligible), so a model with
// them on equals the same model with them off, where the kernels would have
// written fp32 values into fp16 tensors.
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/gpt.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

// A namespace of its own: the suite compiles several test files as one unit.
namespace meshtrain::model::fused_autocast_test {
namespace {

// Runs `work` under CPU autocast to `dtype`; autocast and its dtype are put
// back as they were, also when `work` throws.
template <typename Work>
auto under_autocast(at::ScalarType dtype, Work work) {
  struct Restore {
    bool enabled = at::autocast::is_autocast_enabled(at::kCPU);
    at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
    ~Restore() {
      at::autocast::set_autocast_enabled(at::kCPU, enabled);
      at::autocast::set_autocast_dtype(at::kCPU, dtype);
      at::autocast::clear_cache();
    }
  } restore;
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  return work();
}

TEST(FusedAutocast, OnlyTheKernelsDtypesAreEligible) {
  const at::Tensor x = at::ones({4, 8});
  EXPECT_TRUE(fused::eligible(x));
  EXPECT_TRUE(under_autocast(at::kBFloat16, [&] { return fused::eligible(x); }));
  EXPECT_FALSE(under_autocast(at::kHalf, [&] { return fused::eligible(x); }));
  EXPECT_FALSE(fused::eligible(x.to(at::kHalf)));
}

TEST(FusedAutocast, HalfAutocastModelsEqualTheirUnfusedSelves) {
  for (const std::string preset : {"tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    GptConfig config = GptConfig::preset(preset);
    config.layers = 2;
    config.context = 32;
    GptConfig reference_config = config;
    reference_config.fused = false;
    Gpt fused_model(config, 5), reference(reference_config, 5);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(6);
    const at::Tensor tokens = at::randint(config.vocab_size, {2, 33}, gen, at::kLong);
    auto loss_of = [&](Gpt& model) {
      at::Tensor loss = under_autocast(at::kHalf, [&] { return model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32)); });
      loss.backward();
      return loss.item<double>();
    };
    const double a = loss_of(fused_model), b = loss_of(reference);
    ASSERT_TRUE(std::isfinite(a));
    EXPECT_NEAR(a, b, 1e-6 * std::abs(b));
    const auto pa = fused_model->named_parameters(), pb = reference->named_parameters();
    for (const auto& item : pb) {
      ASSERT_TRUE(pa[item.key()].grad().defined()) << item.key();
      const at::Tensor want = item.value().grad(), got = pa[item.key()].grad();
      const double error = (got - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
      // The gradients' fp16 products meet in other orders (gradients in place): 4e-4 seen, fp16's step is 1e-3.
      EXPECT_LT(error, 2e-3) << item.key();
    }
  }
}

}  // namespace
}  // namespace meshtrain::model::fused_autocast_test
