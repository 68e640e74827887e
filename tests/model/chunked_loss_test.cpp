// The chunked loss (Note [Chunked loss]): the loss and gradients of the
// materialised logits, soft-capped, with ignored targets and the z-loss,
// under autocast and
// in a whole model; its peak memory without the [tokens, vocabulary] logits;
// and the tied head's whole logits, whose gradient joins the embedding's in
// place; the head's gradient added into .grad in the forward.
#include "meshtrain/model/chunked_loss.h"

#include "meshtrain/model/attention.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/util/memory.h"
#include "tests/model/counting_post_hook.h"

#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <ATen/record_function.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <string_view>

namespace meshtrain::model {
namespace {

at::Tensor randn(at::IntArrayRef sizes, uint64_t seed, double std = 1.0) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, g, at::kFloat) * std;
}

// The loss through the logits, as GptImpl::cross_entropy's reference path computes it.
at::Tensor materialised(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double cap) {
  const at::Tensor z = soft_cap(at::linear(h, w).reshape({-1, w.size(0)}).to(at::kFloat), cap);
  const at::Tensor flat = targets.reshape({-1});
  return at::cross_entropy_loss(z, flat, {}, at::Reduction::Sum, kIgnoredTarget) /
         (flat != kIgnoredTarget).sum().clamp_min(1);
}

// The same plus the z-loss β·lse² over the counted rows, as its definition reads.
at::Tensor materialised_with_z(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double cap,
                               double beta) {
  const at::Tensor z = soft_cap(at::linear(h, w).reshape({-1, w.size(0)}).to(at::kFloat), cap);
  const at::Tensor counted = (targets.reshape({-1}) != kIgnoredTarget).to(at::kFloat);
  return materialised(h, w, targets, cap) + beta * (at::logsumexp(z, 1).square() * counted).sum() / counted.sum();
}

// Calls of the fused cross-entropy kernel's reductions (meshtrain::cross_entropy_rows) while counted.
std::atomic<int> kernel_calls{0};

std::unique_ptr<at::ObserverContext> count_kernel_calls(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()) == "meshtrain::cross_entropy_rows") ++kernel_calls;
  return nullptr;
}

double relative(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

// The GPU's padded path (Note [Chunked loss]), taken on the CPU: W's 50 rows
// padded to 64, the loss and gradients those of the unpadded logits, in fp32
// and under bf16 autocast, gradients made in the forward or the backward.
TEST(ChunkedLoss, APaddedVocabularyEqualsTheLogits) {
  at::Tensor targets = at::randint(0, 50, {3, 37}, at::make_generator<at::CPUGeneratorImpl>(4), at::kLong);
  targets.narrow(1, 0, 5).fill_(kIgnoredTarget);
  for (LossGradients when : {LossGradients::kInForward, LossGradients::kInBackward}) {
    for (double cap : {0.0, 5.0}) {
      for (bool bf16 : {false, true}) {
        SCOPED_TRACE("cap " + std::to_string(cap) + (bf16 ? ", bf16" : "") +
                     (when == LossGradients::kInForward ? ", gradients in the forward" : ", in the backward"));
        const at::Tensor h = randn({3, 37, 16}, 1, 2.0).requires_grad_(true);
        const at::Tensor w = randn({50, 16}, 2).requires_grad_(true);
        const at::Tensor hr = h.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
        at::autocast::set_autocast_enabled(at::kCPU, bf16);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        const at::Tensor ours = chunked_cross_entropy(h, w, targets, cap, 7, {}, when, /*pad_rows_to=*/64);
        const at::Tensor want = chunked_cross_entropy(hr, wr, targets, cap, 7, {}, when);  // unpadded on the CPU
        at::autocast::set_autocast_enabled(at::kCPU, false);
        EXPECT_LT(relative(ours, want), bf16 ? 1e-2 : 1e-6);  // 16-bit products of other shapes round apart
        ours.backward();
        want.backward();
        EXPECT_LT(relative(h.grad(), hr.grad()), bf16 ? 1e-2 : 1e-5);
        EXPECT_LT(relative(w.grad(), wr.grad()), bf16 ? 1e-2 : 1e-5);
        EXPECT_EQ(w.grad().sizes(), w.sizes()) << "W's gradient without the padded rows";
      }
    }
  }
}

// Through ATen's operators and (fused, no cap, no z-loss) the fused
// cross-entropy kernel; with the output z-loss (Note [Chunked loss]) against
// its composition on the logits, and without grad mode the cross-entropy alone.
TEST(ChunkedLoss, EqualsTheLossAndGradientsOfTheLogits) {
  at::Tensor targets = at::randint(0, 50, {3, 37}, at::make_generator<at::CPUGeneratorImpl>(3), at::kLong);
  targets.narrow(1, 0, 5).fill_(kIgnoredTarget);  // masked targets count toward nothing
  targets[2][20] = kIgnoredTarget;
  for (LossGradients when : {LossGradients::kInForward, LossGradients::kInBackward}) {
    for (double cap : {0.0, 5.0}) {
      for (int64_t rows : {int64_t{7}, int64_t{0}}) {  // uneven chunks; one chunk
        for (int variant = 0; variant < 3; ++variant) {  // ATen's; fused; fused with the z-loss
          const bool fused = variant > 0;
          const double beta = variant == 2 ? 0.05 : 0.0;  // large, so that the term shows: lse² is about 25 here
          SCOPED_TRACE("cap " + std::to_string(cap) + " rows " + std::to_string(rows) + (fused ? " fused" : "") +
                       (beta > 0 ? " z-loss" : "") +
                       (when == LossGradients::kInForward ? ", gradients in the forward" : ", in the backward"));
          const at::Tensor h = randn({3, 37, 16}, 1, 2.0).requires_grad_(true);
          const at::Tensor w = randn({50, 16}, 2).requires_grad_(true);
          const at::Tensor hr = h.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
          kernel_calls = 0;
          const at::CallbackHandle counting = at::addGlobalCallback(at::RecordFunctionCallback(count_kernel_calls));
          const at::Tensor ours = chunked_cross_entropy(h, w, targets, cap, rows, {}, when, 0, fused, 1.0, beta) * 0.7;
          at::removeCallback(counting);
          EXPECT_EQ(kernel_calls > 0, fused && cap == 0 && beta == 0)
              << "the fused kernel's reductions, where they apply";
          const at::Tensor want = materialised_with_z(hr, wr, targets, cap, beta) * 0.7;
          const double z_term = (want - materialised(hr, wr, targets, cap) * 0.7).item<double>();
          if (beta > 0) EXPECT_GT(z_term, 0.1) << "the z-loss shows";
          EXPECT_LT(relative(ours, want), 1e-6);
          ours.backward();
          want.backward();
          EXPECT_LT(relative(h.grad(), hr.grad()), 1e-5);
          EXPECT_LT(relative(w.grad(), wr.grad()), 1e-5);
          EXPECT_TRUE(h.grad().narrow(1, 0, 5).abs().max().item<double>() < 1e-7) << "ignored rows get no gradient";
          torch::NoGradGuard evaluation;
          EXPECT_LT(relative(chunked_cross_entropy(h, w, targets, cap, rows, {}, when, 0, fused, 1.0, beta),
                             materialised(h, w, targets, cap)), 1e-6) << "without grad mode, the cross-entropy";
        }
      }
    }
  }
  // Every target ignored: 0, as the materialised loss.
  const at::Tensor none = at::full({2, 4}, kIgnoredTarget, at::kLong);
  EXPECT_EQ(chunked_cross_entropy(randn({2, 4, 8}, 4), randn({10, 8}, 5), none).item<double>(), 0.0);
}

TEST(ChunkedLoss, UnderAutocastItComputesInBfloat16AsTheHeadWould) {
  const at::Tensor targets = at::randint(0, 64, {2, 24}, at::make_generator<at::CPUGeneratorImpl>(6), at::kLong);
  for (LossGradients when : {LossGradients::kInForward, LossGradients::kInBackward}) {
    const at::Tensor h = randn({2, 24, 32}, 7).requires_grad_(true), w = randn({64, 32}, 8).requires_grad_(true);
    const at::Tensor hr = h.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
    at::Tensor ours, want;
    {
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      ours = chunked_cross_entropy(h, w, targets, 0, 11, {}, when);
      want = materialised(hr, wr, targets, 0);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    EXPECT_LT(relative(ours, want), 1e-5);
    ours.backward();
    want.backward();
    EXPECT_EQ(h.grad().scalar_type(), at::kFloat);
    EXPECT_LT(relative(h.grad(), hr.grad()), 2e-2);  // bf16 products
    EXPECT_LT(relative(w.grad(), wr.grad()), 2e-2);
  }
}

// A whole model's step with model.chunked_loss on and off: the same loss and
// gradients (Gemma 2's tied embedding and logit soft-cap; a Llama-style head).
TEST(ChunkedLoss, AModelsLossAndGradientsAreThoseOfTheLogits) {
  GptConfig llama = GptConfig::preset("llama-tiny");
  llama.layers = 2, llama.width = 64, llama.heads = 4, llama.kv_heads = 2, llama.context = 32, llama.dropout = 0;
  llama.vocab_size = 300;
  GptConfig gemma = llama;
  gemma.tie_embeddings = true, gemma.logit_softcap = 3.0;
  for (const GptConfig& config : {llama, gemma}) {
    SCOPED_TRACE(config.tie_embeddings ? "tied, soft-capped" : "untied");
    GptConfig whole = config;
    whole.chunked_loss = false;
    Gpt chunked(config, 5), reference(whole, 5);
    const at::Tensor tokens = at::randint(0, config.vocab_size, {2, 33}, at::make_generator<at::CPUGeneratorImpl>(9), at::kLong);
    const Batch batch(tokens.narrow(1, 0, 32).contiguous(), tokens.narrow(1, 1, 32).contiguous());
    const at::Tensor ours = chunked->loss(batch), want = reference->loss(batch);
    EXPECT_LT(relative(ours, want), 1e-6);
    ours.backward();
    want.backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : reference->named_parameters()) grads[p.key()] = p.value().grad();
    for (const auto& p : chunked->named_parameters()) EXPECT_LT(relative(p.value().grad(), grads.at(p.key())), 1e-5) << p.key();
    torch::NoGradGuard no_grad;  // evaluation: the loss alone
    EXPECT_LT(relative(chunked->loss(batch), reference->loss(batch)), 1e-6);
  }
}

// What a loss holds from its forward to its backward: dh and dW made in the
// forward, or (a pipeline stage's several losses) only its input's
// log-sum-exp; and a second backward through one loss is refused.
TEST(ChunkedLoss, GradientsMadeInTheBackwardHoldNoWeightSizedTensor) {
  memory::install();
  const at::Tensor targets = at::randint(0, 4096, {256}, at::make_generator<at::CPUGeneratorImpl>(13), at::kLong);
  const double weight_bytes = 4096.0 * 64 * 4;
  for (LossGradients when : {LossGradients::kInForward, LossGradients::kInBackward}) {
    const at::Tensor h = randn({256, 64}, 14).requires_grad_(true), w = randn({4096, 64}, 15).requires_grad_(true);
    const int64_t before = memory::current_bytes();
    const at::Tensor loss = chunked_cross_entropy(h, w, targets, 0, 64, {}, when);
    const int64_t held = memory::current_bytes() - before;
    if (when == LossGradients::kInForward) {
      EXPECT_GT(held, weight_bytes);
    } else {
      EXPECT_LT(held, weight_bytes / 8);
    }
    loss.backward({}, /*retain_graph=*/true);
    EXPECT_THROW(loss.backward(), c10::Error);
  }
}

// Note [Head's gradient into .grad]: where W's .grad persists (an earlier
// micro-batch's gradient in it), the forward adds dW · weight / count into it
// and holds no W-sized tensor; the backward hands AccumulateGrad none, whose
// post-hooks still run; the gradients are the logits'. Without a .grad, or
// with a hook on W, dW is held to the backward as kInForward holds it; a loss
// not multiplied by the weight it was told is refused in its backward.
TEST(ChunkedLoss, IntoWeightGradAddsTheHeadsGradientInTheForward) {
  memory::install();
  const at::Tensor targets = at::randint(0, 4096, {2, 128}, at::make_generator<at::CPUGeneratorImpl>(20), at::kLong);
  targets[1][5] = kIgnoredTarget;
  const double weight_bytes = 4096.0 * 64 * 4;
  const at::Tensor earlier = randn({4096, 64}, 21, 0.01);  // an earlier micro-batch's gradient
  for (const std::string how : {"into .grad", "soft-capped, into .grad", "unfused, into .grad", "no .grad", "a hook"}) {
    SCOPED_TRACE(how);
    const double cap = how == "soft-capped, into .grad" ? 5.0 : 0.0;
    const bool fused = how != "unfused, into .grad", into = how.find("into") != std::string::npos;
    const at::Tensor h = randn({2, 128, 64}, 22).requires_grad_(true), w = randn({4096, 64}, 23).requires_grad_(true);
    const at::Tensor hr = h.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
    if (how != "no .grad") {
      w.mutable_grad() = earlier.clone();
      wr.mutable_grad() = earlier.clone();
    }
    int hook_calls = 0, seen = 0;
    const auto accumulator = torch::autograd::impl::grad_accumulator(w);  // the tensor holds it weakly
    accumulator->add_post_hook(std::make_unique<CountingPostHook>(&hook_calls));
    if (how == "a hook") w.register_hook([&seen](const at::Tensor& g) { seen += g.defined() ? 1 : 0; });
    const void* held = w.grad().defined() ? w.grad().const_data_ptr() : nullptr;
    const int64_t before = memory::current_bytes();
    const at::Tensor ours = chunked_cross_entropy(h, w, targets, cap, 96, {}, LossGradients::kIntoWeightGrad, 0, fused,
                                                  0.7) * 0.7;
    const int64_t kept = memory::current_bytes() - before;
    if (into) {
      EXPECT_LT(kept, weight_bytes / 4) << "no dW held to the backward";
      EXPECT_GT(relative(w.grad(), earlier), 1e-3) << "dW added in the forward";
    } else {
      EXPECT_GT(kept, weight_bytes) << "dW held to the backward";
    }
    const at::Tensor want = materialised(hr, wr, targets, cap) * 0.7;
    EXPECT_LT(relative(ours, want), 1e-6);
    ours.backward();
    want.backward();
    EXPECT_EQ(hook_calls, 1) << "the accumulator's post-hooks still run";
    EXPECT_EQ(seen, how == "a hook" ? 1 : 0) << "a hook on W sees its gradient";
    if (held) {
      EXPECT_EQ(w.grad().const_data_ptr(), held) << "added into the held tensor, not replaced";
    }
    EXPECT_LT(relative(w.grad(), wr.grad()), 1e-5);
    EXPECT_LT(relative(h.grad(), hr.grad()), 1e-5);
  }
  // Under bf16 autocast dW's 16-bit products go into the fp32 .grad a slice at a time: the gradients
  // of the same loss holding dW to its backward.
  {
    const at::Tensor h = randn({2, 128, 64}, 26).requires_grad_(true), w = randn({4096, 64}, 27).requires_grad_(true);
    const at::Tensor hr = h.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
    w.mutable_grad() = earlier.clone();
    wr.mutable_grad() = earlier.clone();
    const int64_t before = memory::current_bytes();
    at::Tensor ours, want;
    {
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      ours = chunked_cross_entropy(h, w, targets, 0, 96, {}, LossGradients::kIntoWeightGrad, 0, true, 0.7) * 0.7;
      EXPECT_LT(memory::current_bytes() - before, weight_bytes / 4) << "bf16: no dW held to the backward";
      want = chunked_cross_entropy(hr, wr, targets, 0, 96, {}, LossGradients::kInForward, 0, true) * 0.7;
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    ours.backward();
    want.backward();
    EXPECT_LT(relative(w.grad(), wr.grad()), 1e-5);
    EXPECT_LT(relative(h.grad(), hr.grad()), 1e-5);
  }
  // Told 0.7, multiplied by 0.5: its backward refuses rather than leave a wrong .grad unnoticed.
  const at::Tensor h = randn({2, 128, 64}, 24).requires_grad_(true), w = randn({4096, 64}, 25).requires_grad_(true);
  w.mutable_grad() = at::zeros_like(w);
  const at::Tensor loss = chunked_cross_entropy(h, w, targets, 0, 0, {}, LossGradients::kIntoWeightGrad, 0, true, 0.7);
  EXPECT_THROW((loss * 0.5).backward(), c10::Error);
}

// A model's micro-batches as a training step runs them (the loss times its
// weight, its backward at once), into .grad that persists: the gradients of
// the model whose loss holds dW to the backward, untied and tied (the
// embedding's gradient joins the head's in the same .grad), and with the z-loss.
TEST(ChunkedLoss, AModelsMicroBatchesIntoWeightGradAreTheLogitsGradients) {
  GptConfig llama = GptConfig::preset("llama-tiny");
  llama.layers = 2, llama.width = 64, llama.heads = 4, llama.kv_heads = 2, llama.context = 32, llama.dropout = 0;
  llama.vocab_size = 300;
  GptConfig tied = llama, z_loss = llama;
  tied.tie_embeddings = true;
  z_loss.z_loss = 0.01;  // the whole logits' z-loss (GptImpl::cross_entropy) against the chunked loss's
  for (const GptConfig& config : {llama, tied, z_loss}) {
    SCOPED_TRACE(std::string(config.tie_embeddings ? "tied" : "untied") + (config.z_loss > 0 ? ", z-loss" : ""));
    GptConfig whole = config;
    whole.chunked_loss = false;
    Gpt chunked(config, 5), reference(whole, 5);
    for (Gpt* m : {&chunked, &reference}) {
      for (auto& p : (*m)->parameters()) p.mutable_grad() = at::zeros_like(p);  // persistent, as buckets are
    }
    const at::Tensor tokens =
        at::randint(0, config.vocab_size, {2, 2, 33}, at::make_generator<at::CPUGeneratorImpl>(26), at::kLong);
    const at::Tensor& head = config.tie_embeddings ? chunked->wte->weight : chunked->head->weight;
    for (int64_t a = 0; a < 2; ++a) {
      const Batch batch(tokens[a].narrow(1, 0, 32).contiguous(), tokens[a].narrow(1, 1, 32).contiguous(),
                        a == 0 ? 0.25 : 0.75);
      const at::Tensor before = head.grad().clone();
      const at::Tensor loss = chunked->loss(batch, LossGradients::kIntoWeightGrad);
      EXPECT_FALSE(head.grad().equal(before)) << "the head's gradient went into .grad in the forward";
      (loss * batch.weight).backward();
      (reference->loss(batch) * batch.weight).backward();
    }
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : reference->named_parameters()) grads[p.key()] = p.value().grad();
    for (const auto& p : chunked->named_parameters()) EXPECT_LT(relative(p.value().grad(), grads.at(p.key())), 1e-5) << p.key();
  }
}

// The counting allocator's peak over a loss and its backward: the logits
// [1024, 4096] (16 MiB in fp32, and their gradient) never exist whole.
TEST(ChunkedLoss, PeakMemoryHoldsNoWholeLogits) {
  memory::install();
  const at::Tensor targets = at::randint(0, 4096, {1024}, at::make_generator<at::CPUGeneratorImpl>(10), at::kLong);
  auto peak = [&](bool chunked) {
    const at::Tensor h = randn({1024, 64}, 11).requires_grad_(true), w = randn({4096, 64}, 12).requires_grad_(true);
    memory::reset_peaks();
    const int64_t before = memory::current_bytes();
    const at::Tensor loss = chunked ? chunked_cross_entropy(h, w, targets, 0, 128) : materialised(h, w, targets, 0);
    loss.backward();
    return memory::peak_bytes() - before;
  };
  const double logits = 1024.0 * 4096 * 4;
  const int64_t ours = peak(true), whole = peak(false);
  EXPECT_GT(whole, 2 * logits);  // logits and their gradient at least
  EXPECT_LT(ours, logits / 2) << "chunked " << ours << " bytes against " << whole;
  std::printf("loss peak: chunked %.1f MiB, logits whole %.1f MiB\n", ours / 1048576.0, whole / 1048576.0);
}

// A head tied to the embedding (Note [Tied head's gradient]): W's two
// gradients, the head's and the embedding's, are summed in place, so the
// backward holds two tensors of W's size, not three as through ATen's linear;
// and the gradients are linear's.
TEST(TiedHead, ItsGradientJoinsTheEmbeddingsInPlace) {
  memory::install();
  const at::Tensor tokens = at::randint(0, 4096, {16}, at::make_generator<at::CPUGeneratorImpl>(16), at::kLong);
  const at::Tensor upstream = randn({16, 4096}, 17);
  const double weight_bytes = 4096.0 * 64 * 4;
  auto backward = [&](bool ours, at::Tensor& grad) {
    const at::Tensor w = randn({4096, 64}, 18).requires_grad_(true);
    const at::Tensor x = at::embedding(w, tokens) * 2.0;
    const at::Tensor z = ours ? tied_head_logits(x, w) : at::linear(x, w);
    const at::Tensor loss = (z * upstream).sum();
    memory::reset_peaks();
    const int64_t before = memory::current_bytes();
    loss.backward();
    grad = w.grad();
    return static_cast<double>(memory::peak_bytes() - before);
  };
  at::Tensor ours_grad, linear_grad;
  const double ours = backward(true, ours_grad), linear = backward(false, linear_grad);
  EXPECT_LT(relative(ours_grad, linear_grad), 1e-6);
  EXPECT_LT(ours, 2.5 * weight_bytes) << "the backward held " << ours / weight_bytes << " weights";
  EXPECT_GT(linear, 2.5 * weight_bytes) << "ATen's linear no longer hands back a view: the product may go";
}

}  // namespace
}  // namespace meshtrain::model
