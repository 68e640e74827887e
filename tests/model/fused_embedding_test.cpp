// The lookup whose backward adds its rows' gradients into the table's
// persistent .grad (Note [Embedding gradients in place]): ATen's gradients,
// taken in place only where AccumulateGrad would have added in place, its
// post-hooks still told, a table tied to a head, and a whole model's lookups.
#include "meshtrain/model/fused/embedding.h"

#include "meshtrain/model/gpt.h"
#include "tests/model/counting_post_hook.h"
#include "tests/model/in_place_gradients.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

// A namespace of its own: the suite compiles several test files as one unit.
namespace meshtrain::model::embedding_test {
namespace {

using in_place_test::seeded_normal;

// Runs backward of a weighted sum of the outputs; the number of lookups whose rows went in place.
int run_backward(const at::Tensor& y) {
  return in_place_test::backward_counting(y, "meshtrain::embedding_grad_in_place");
}

// A table of 10 rows; ids that repeat rows and leave others untouched.
const at::Tensor& ids() {
  static const at::Tensor t = torch::tensor({{3, 1, 3, 9}, {0, 3, 1, 1}}, at::kLong);
  return t;
}

at::Tensor table(bool grad_defined) {
  at::Tensor w = seeded_normal({10, 6}, 1).requires_grad_(true);
  if (grad_defined) w.mutable_grad() = seeded_normal({10, 6}, 2);  // what earlier micro-batches left
  return w;
}

at::Tensor copy_of(const at::Tensor& w) {
  at::Tensor c = w.detach().clone().requires_grad_(true);
  if (w.grad().defined()) c.mutable_grad() = w.grad().clone();
  return c;
}

TEST(FusedEmbedding, AddsRowsIntoAPersistentGradientAsAccumulateGradWould) {
  for (bool grad_defined : {true, false}) {
    SCOPED_TRACE(grad_defined ? "a gradient held from before" : "no gradient yet");
    const at::Tensor ours = table(grad_defined), want = copy_of(ours);
    const void* held = grad_defined ? ours.grad().const_data_ptr() : nullptr;
    int hook_calls = 0;
    const auto accumulator = torch::autograd::impl::grad_accumulator(ours);  // the tensor holds it weakly
    accumulator->add_post_hook(std::make_unique<CountingPostHook>(&hook_calls));
    const at::Tensor y = fused::embedding(ours, ids());
    EXPECT_TRUE(torch::equal(y, at::embedding(want, ids())));
    EXPECT_EQ(run_backward(y), grad_defined ? 1 : 0) << "in place exactly where .grad persists";
    run_backward(at::embedding(want, ids()));
    EXPECT_EQ(hook_calls, 1) << "the accumulator's post-hooks still run";
    if (held) EXPECT_EQ(ours.grad().const_data_ptr(), held) << "added into the held tensor, not replaced";
    EXPECT_TRUE(torch::allclose(ours.grad(), want.grad(), 1e-6, 1e-6));
  }
}

TEST(FusedEmbedding, LeavesTheGradientToAutogradWhereSomethingWatchesIt) {
  {
    SCOPED_TRACE("a hook on the table sees and doubles its gradient");
    const at::Tensor ours = table(true), want = copy_of(ours);
    ours.register_hook([](const at::Tensor& g) { return g * 2; });
    want.register_hook([](const at::Tensor& g) { return g * 2; });
    EXPECT_EQ(run_backward(fused::embedding(ours, ids())), 0);
    run_backward(at::embedding(want, ids()));
    EXPECT_TRUE(torch::allclose(ours.grad(), want.grad(), 1e-6, 1e-6));
  }
  {
    SCOPED_TRACE("autograd::grad over chosen inputs returns the dense gradient and leaves .grad alone");
    const at::Tensor ours = table(true), want = copy_of(ours);
    const at::Tensor g = seeded_normal({2, 4, 6}, 7);
    const at::Tensor dw = torch::autograd::grad({(fused::embedding(ours, ids()) * g).sum()}, {ours})[0];
    const at::Tensor dw_want = torch::autograd::grad({(at::embedding(want, ids()) * g).sum()}, {want})[0];
    EXPECT_TRUE(torch::allclose(dw, dw_want, 1e-6, 1e-6));
    EXPECT_TRUE(torch::equal(ours.grad(), want.grad()));
  }
  {
    SCOPED_TRACE("a frozen table: ATen's lookup, no gradient");
    const at::Tensor ours = table(false).requires_grad_(false);
    const at::Tensor y = fused::embedding(ours, ids());
    EXPECT_FALSE(y.requires_grad());
    EXPECT_FALSE(ours.grad().defined());
  }
}

// A table read twice, by the lookup and as a head's weight: both gradients
// end in the one held .grad, the lookup's rows in place, the head's through
// AccumulateGrad.
TEST(FusedEmbedding, ATableTiedToAHeadGetsBothGradients) {
  const at::Tensor ours = table(true), want = copy_of(ours);
  EXPECT_EQ(run_backward(at::linear(fused::embedding(ours, ids()), ours)), 1);
  run_backward(at::linear(at::embedding(want, ids()), want));
  EXPECT_TRUE(torch::allclose(ours.grad(), want.grad(), 1e-5, 1e-6));
}

// A GPT-2-style model (learned positions, a tied head) over two micro-batches
// into held zeroed gradients, as data parallel's buckets hold them: both
// lookups add in place every micro-batch, and every gradient is the reference
// model's (model.fused off: ATen's lookups, products and AccumulateGrad).
TEST(FusedEmbedding, AModelsLookupsAddIntoHeldGradients) {
  GptConfig config = GptConfig::preset("tiny");
  config.layers = 2;
  config.context = 16;
  ASSERT_TRUE(config.tie_embeddings);
  EXPECT_EQ(in_place_test::micro_batches_into_held_gradients(config, "meshtrain::embedding_grad_in_place"), 2 * 2)
      << "token and position lookups, two micro-batches";
}

}  // namespace
}  // namespace meshtrain::model::embedding_test
