// The lookup whose backward adds its rows' gradients into the table's
// persistent .grad (Note [Embedding gradients in place]): ATen's gradients,
// taken in place only where AccumulateGrad would have added in place, its
// post-hooks still told, a table tied to a head, and a whole model's lookups.
#include "meshtrain/model/fused/embedding.h"

#include "meshtrain/model/gpt.h"
#include "tests/model/counting_post_hook.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <string>
#include <string_view>

// A namespace of its own: the suite compiles several test files as one unit.
namespace meshtrain::model::embedding_test {
namespace {

at::Tensor seeded_normal(at::IntArrayRef sizes, uint64_t seed) {
  return at::randn(sizes, at::make_generator<at::CPUGeneratorImpl>(seed), at::kFloat);
}

std::atomic<int> lookups_in_place{0};

std::unique_ptr<at::ObserverContext> count_lookups_in_place(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()) == "meshtrain::embedding_grad_in_place") ++lookups_in_place;
  return nullptr;
}

// Runs backward of a weighted sum of the outputs; the number of lookups whose rows went in place.
int run_backward(const at::Tensor& y) {
  lookups_in_place = 0;
  const at::CallbackHandle counting = at::addGlobalCallback(at::RecordFunctionCallback(count_lookups_in_place));
  (y * seeded_normal(y.sizes(), 6)).sum().backward();
  at::removeCallback(counting);
  return lookups_in_place;
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
  GptConfig reference_config = config;
  reference_config.fused = false;
  Gpt fused_model(config, 3), reference(reference_config, 3);
  std::map<std::string, const void*> held;
  for (Gpt* model : {&fused_model, &reference}) {
    for (auto& item : (*model)->named_parameters()) {
      item.value().mutable_grad() = at::zeros_like(item.value());
      if (model == &fused_model) held[item.key()] = item.value().grad().const_data_ptr();
    }
  }
  const at::Tensor tokens =
      at::randint(config.vocab_size, {2, 3, 17}, at::make_generator<at::CPUGeneratorImpl>(4), at::kLong);
  int taken = 0;
  for (int64_t micro = 0; micro < 2; ++micro) {
    const at::Tensor input = tokens[micro].narrow(1, 0, 16), targets = tokens[micro].narrow(1, 1, 16);
    taken += run_backward(fused_model->loss(input, targets));
    run_backward(reference->loss(input, targets));
  }
  EXPECT_EQ(taken, 2 * 2) << "token and position lookups, two micro-batches";
  const auto fused_parameters = fused_model->named_parameters();
  for (const auto& item : reference->named_parameters()) {
    const at::Tensor& grad = fused_parameters[item.key()].grad();
    EXPECT_EQ(grad.const_data_ptr(), held[item.key()]) << item.key();
    EXPECT_TRUE(torch::allclose(grad, item.value().grad(), 1e-4, 1e-6)) << item.key();
  }
}

}  // namespace
}  // namespace meshtrain::model::embedding_test
