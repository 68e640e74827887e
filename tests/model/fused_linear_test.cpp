// The linear whose product adds the weight's gradient into its persistent
// .grad (Note [Weight gradients in place]): the gradients of at::linear, taken
// in place only where AccumulateGrad would have added in place, its
// post-hooks still told, and in a whole model's linear layers.
#include "meshtrain/model/fused/linear.h"

#include "meshtrain/model/gpt.h"
#include "tests/model/counting_post_hook.h"
#include "tests/model/in_place_gradients.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

namespace meshtrain::model {
namespace {

using in_place_test::seeded_normal;

struct Leaves {
  at::Tensor x, w, b;
};

Leaves linear_leaves(bool grads_defined) {
  Leaves l{seeded_normal({3, 5, 8}, 1).requires_grad_(true), seeded_normal({6, 8}, 2).requires_grad_(true),
           seeded_normal({6}, 3).requires_grad_(true)};
  if (grads_defined) {
    l.w.mutable_grad() = seeded_normal({6, 8}, 4);  // what earlier micro-batches left
    l.b.mutable_grad() = seeded_normal({6}, 5);
  }
  return l;
}

Leaves copy_of(const Leaves& l) {
  Leaves c{l.x.detach().clone().requires_grad_(true), l.w.detach().clone().requires_grad_(true),
           l.b.detach().clone().requires_grad_(true)};
  if (l.w.grad().defined()) c.w.mutable_grad() = l.w.grad().clone();
  if (l.b.grad().defined()) c.b.mutable_grad() = l.b.grad().clone();
  return c;
}

// Runs backward of a weighted sum of the outputs; the number of in-place products.
int run_backward(const at::Tensor& y) { return in_place_test::backward_counting(y, "meshtrain::weight_grad_in_place"); }

TEST(FusedLinear, AddsIntoAPersistentGradientAsAccumulateGradWould) {
  for (bool grads_defined : {true, false}) {
    SCOPED_TRACE(grads_defined ? "gradients held from before" : "no gradients yet");
    const Leaves ours = linear_leaves(grads_defined), want = copy_of(ours);
    const void* held = grads_defined ? ours.w.grad().const_data_ptr() : nullptr;
    int hook_calls = 0;
    const auto accumulator = torch::autograd::impl::grad_accumulator(ours.w);  // the tensor holds it weakly
    accumulator->add_post_hook(std::make_unique<CountingPostHook>(&hook_calls));
    const at::Tensor y = fused::linear(ours.x, ours.w, ours.b);
    EXPECT_TRUE(torch::allclose(y, at::linear(want.x, want.w, want.b)));
    EXPECT_EQ(run_backward(y), grads_defined ? 1 : 0) << "in place exactly where .grad persists";
    run_backward(at::linear(want.x, want.w, want.b));
    EXPECT_EQ(hook_calls, 1) << "the accumulator's post-hooks still run";
    if (held) EXPECT_EQ(ours.w.grad().const_data_ptr(), held) << "added into the held tensor, not replaced";
    EXPECT_TRUE(torch::allclose(ours.w.grad(), want.w.grad(), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(ours.b.grad(), want.b.grad(), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(ours.x.grad(), want.x.grad(), 1e-5, 1e-5));
  }
}

// Note [Weight gradients under autocast]: bf16 products of the fp32 weight, as
// at::linear under autocast makes them, with dW added into the fp32 .grad in
// one pass where it persists.
TEST(FusedLinear, UnderBfloat16AutocastMatchesAutocastsLinear) {
  for (bool grads_defined : {true, false}) {
    SCOPED_TRACE(grads_defined ? "gradients held from before" : "no gradients yet");
    const Leaves ours = linear_leaves(grads_defined), want = copy_of(ours);
    const void* held = grads_defined ? ours.w.grad().const_data_ptr() : nullptr;
    at::Tensor y, y_want;
    {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      y = fused::linear(ours.x, ours.w, ours.b);
      y_want = at::linear(want.x, want.w, want.b);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    ASSERT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(torch::equal(y, y_want));
    EXPECT_EQ(run_backward(y), grads_defined ? 1 : 0) << "in place exactly where .grad persists";
    run_backward(y_want);
    if (held) EXPECT_EQ(ours.w.grad().const_data_ptr(), held) << "added into the held tensor, not replaced";
    EXPECT_EQ(ours.w.grad().scalar_type(), at::kFloat);
    EXPECT_TRUE(torch::allclose(ours.w.grad(), want.w.grad(), 1e-6, 1e-6)) << "the same bf16 product, added in fp32";
    EXPECT_TRUE(torch::equal(ours.x.grad(), want.x.grad()));
    EXPECT_TRUE(torch::allclose(ours.b.grad(), want.b.grad(), 1e-6, 1e-6));
  }
}

TEST(FusedLinear, LeavesTheGradientToAutogradWhereSomethingWatchesIt) {
  {
    SCOPED_TRACE("a hook on the weight sees and doubles its gradient");
    const Leaves ours = linear_leaves(true), want = copy_of(ours);
    ours.w.register_hook([](const at::Tensor& g) { return g * 2; });
    want.w.register_hook([](const at::Tensor& g) { return g * 2; });
    EXPECT_EQ(run_backward(fused::linear(ours.x, ours.w, ours.b)), 0);
    run_backward(at::linear(want.x, want.w, want.b));
    EXPECT_TRUE(torch::allclose(ours.w.grad(), want.w.grad(), 1e-5, 1e-5));
  }
  {
    SCOPED_TRACE("autograd::grad over chosen inputs returns dW and leaves .grad alone");
    const Leaves ours = linear_leaves(true), want = copy_of(ours);
    const at::Tensor y = fused::linear(ours.x, ours.w, ours.b), g = seeded_normal(y.sizes(), 7);
    const at::Tensor dw = torch::autograd::grad({(y * g).sum()}, {ours.w})[0];
    const at::Tensor dw_want = torch::autograd::grad({(at::linear(want.x, want.w, want.b) * g).sum()}, {want.w})[0];
    EXPECT_TRUE(torch::allclose(dw, dw_want, 1e-5, 1e-5));
    EXPECT_TRUE(torch::equal(ours.w.grad(), want.w.grad()));
  }
  {
    SCOPED_TRACE("a frozen weight: at::linear itself, no weight gradient");
    const Leaves ours = linear_leaves(false);
    ours.w.requires_grad_(false);
    EXPECT_EQ(run_backward(fused::linear(ours.x, ours.w, ours.b)), 0);
    EXPECT_FALSE(ours.w.grad().defined());
    EXPECT_TRUE(ours.x.grad().defined());
  }
}

// A Llama-style model's linear layers (qkv, proj, gate, up, down) over two
// micro-batches into held zeroed gradients, as data parallel's buckets hold
// them: every product adds in place, and the gradients are the reference
// model's (model.fused off: ATen's linear and AccumulateGrad).
TEST(FusedLinear, AModelsLinearLayersAddIntoHeldGradients) {
  GptConfig config = GptConfig::preset("llama-tiny");
  config.layers = 2;
  config.context = 16;
  config.kv_heads = 2;
  EXPECT_EQ(in_place_test::micro_batches_into_held_gradients(config, "meshtrain::weight_grad_in_place"),
            2 * config.layers * 5)
      << "five products a block, two micro-batches";
}

}  // namespace
}  // namespace meshtrain::model
