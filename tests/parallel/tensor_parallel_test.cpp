// Tensor and sequence parallel against the unsharded computation: the
// collectives as autograd functions, every module of the model, whole-model
// training (alone and on a 2-D mesh with data parallel or sharding),
// random streams, activation memory against Korthikanti et al. 2022, and
// resume — over every tp group size the world allows.
#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/util/memory.h"
#include "tests/harness/same_values.h"
#include "tests/harness/error_of.h"
#include "tests/parallel/training_fixture.h"

#include <cstdio>

namespace meshtrain::parallel {
namespace {

using testing::world;
using train::relative_error;

// The tp group sizes to test on this world: 2, 3 and 4 where they divide it.
std::vector<int> tp_sizes() {
  std::vector<int> out;
  for (int t : {2, 3, 4}) {
    if (world()->size() % t == 0) out.push_back(t);
  }
  return out;
}

// Consecutive ranks in groups of t.
CommPtr group_of(int t) {
  return world()->split(world()->rank() / t, world()->rank(), "test:tp" + std::to_string(t));
}

// The same values on every rank (`seed`), or rank r's own (`seed`, r): any
// rank can compute any other rank's tensor, so oracles need no communication.
using testing::same;
at::Tensor of_rank(at::IntArrayRef shape, uint64_t seed, int rank) { return same(shape, seed * 1000 + rank); }

at::Tensor chunk(const at::Tensor& x, int64_t dim, int t, int r) { return x.chunk(t, dim)[r]; }

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, double tolerance = 1e-5) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_LE(relative_error(got, want), tolerance) << what;
}

TEST(TensorParallelOps, CopyAndReduceAreConjugate) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    const std::string where = "t = " + std::to_string(t);
    // f: identity forward, sum of every rank's gradient backward.
    at::Tensor x = same({4, 6}, 1).requires_grad_();
    const at::Tensor y = copy_to_tensor_parallel(x, comm);
    expect_close(y, x.detach(), "f forward, " + where);
    (y * of_rank({4, 6}, 2, r)).sum().backward();
    at::Tensor sum = at::zeros({4, 6});
    for (int q = 0; q < t; ++q) sum += of_rank({4, 6}, 2, q);
    expect_close(x.grad(), sum, "f backward, " + where);
    // g: sum forward, identity backward.
    at::Tensor part = of_rank({4, 6}, 3, r).requires_grad_();
    const at::Tensor z = reduce_from_tensor_parallel(part, comm);
    at::Tensor parts = at::zeros({4, 6});
    for (int q = 0; q < t; ++q) parts += of_rank({4, 6}, 3, q);
    expect_close(z, parts, "g forward, " + where);
    z.backward(same({4, 6}, 4));
    expect_close(part.grad(), same({4, 6}, 4), "g backward, " + where);
  }
}

TEST(TensorParallelOps, SequenceScatterGatherAndReduceScatterAreConjugate) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    const std::string where = "t = " + std::to_string(t);
    const std::vector<int64_t> full{2, 4 * t, 3}, local{2, 4, 3};
    const at::Tensor x = same(full, 5);

    at::Tensor whole = x.clone().requires_grad_();
    const at::Tensor mine = scatter_to_sequence(whole, comm, 1);
    expect_close(mine, chunk(x, 1, t, r), "scatter forward, " + where);
    mine.backward(of_rank(local, 6, r));
    std::vector<at::Tensor> grads;
    for (int q = 0; q < t; ++q) grads.push_back(of_rank(local, 6, q));
    expect_close(whole.grad(), at::cat(grads, 1), "scatter backward, " + where);

    at::Tensor piece = chunk(x, 1, t, r).clone().requires_grad_();
    const at::Tensor gathered = gather_from_sequence(piece, comm, 1);
    expect_close(gathered, x, "gather forward, " + where);
    gathered.backward(of_rank(full, 7, r));
    at::Tensor sum = at::zeros(full);
    for (int q = 0; q < t; ++q) sum += of_rank(full, 7, q);
    expect_close(piece.grad(), chunk(sum, 1, t, r), "gather backward, " + where);

    at::Tensor partial = of_rank(full, 8, r).requires_grad_();
    const at::Tensor reduced = reduce_scatter_to_sequence(partial, comm, 1);
    at::Tensor total = at::zeros(full);
    for (int q = 0; q < t; ++q) total += of_rank(full, 8, q);
    expect_close(reduced, chunk(total, 1, t, r), "reduce-scatter forward, " + where);
    reduced.backward(of_rank(local, 9, r));
    grads.clear();
    for (int q = 0; q < t; ++q) grads.push_back(of_rank(local, 9, q));
    expect_close(partial.grad(), at::cat(grads, 1), "reduce-scatter backward, " + where);
  }
}

TEST(TensorParallelOps, SequenceGatheredLinearEqualsGatherThenLinear) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    const std::string where = "t = " + std::to_string(t);
    const at::Tensor x = same({2, 4 * t, 5}, 10);
    at::Tensor piece = chunk(x, 1, t, r).clone().requires_grad_();
    at::Tensor weight = of_rank({6, 5}, 11, r).requires_grad_(), bias = of_rank({6}, 12, r).requires_grad_();
    const at::Tensor y = sequence_gathered_linear(piece, weight, bias, comm, 1);
    // Oracle: each rank's linear on the whole input, done here for every rank.
    at::Tensor input_grad = at::zeros_like(x);
    at::Tensor want_y, want_weight_grad, want_bias_grad;
    for (int q = 0; q < t; ++q) {
      at::Tensor xq = x.clone().requires_grad_();
      at::Tensor wq = of_rank({6, 5}, 11, q).requires_grad_(), bq = of_rank({6}, 12, q).requires_grad_();
      const at::Tensor yq = at::linear(xq, wq, bq);
      yq.backward(of_rank({2, 4 * t, 6}, 13, q));
      input_grad += xq.grad();
      if (q == r) {
        want_y = yq.detach();
        want_weight_grad = wq.grad();
        want_bias_grad = bq.grad();
      }
    }
    expect_close(y, want_y, "forward, " + where);
    y.backward(of_rank({2, 4 * t, 6}, 13, r));
    expect_close(piece.grad(), chunk(input_grad, 1, t, r), "input gradient, " + where);
    expect_close(weight.grad(), want_weight_grad, "weight gradient, " + where);
    expect_close(bias.grad(), want_bias_grad, "bias gradient, " + where);
  }
}

TEST(TensorParallelOps, VocabParallelCrossEntropyNeverGathersLogits) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    const int64_t v = 8 * t;
    const at::Tensor logits = same({10, v}, 20) * 3;
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(21);
    const at::Tensor targets = at::randint(0, v, {10}, g, at::kLong);
    for (double beta : {0.0, 0.05}) {  // with the z-loss, β·mean(lse²)
      const std::string what = "t = " + std::to_string(t) + ", z-loss " + std::to_string(beta);
      at::Tensor full = logits.clone().requires_grad_();
      const at::Tensor want = at::cross_entropy_loss(full, targets) + beta * at::logsumexp(full, 1).square().mean();
      want.backward();
      at::Tensor mine = chunk(logits, 1, t, r).clone().requires_grad_();
      const at::Tensor got = vocab_parallel_cross_entropy(mine, targets, r * 8, comm, beta);
      got.backward();
      EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5 * want.item<double>()) << what;
      expect_close(mine.grad(), chunk(full.grad(), 1, t, r), "gradient, " + what);
    }
  }
}

// Note [Chunked loss] over a head split by the vocabulary, as tensor parallel
// calls it: several chunks, ignored targets, with and without the soft-cap
// and the z-loss; dW held to the backward, made in it, or added into the
// share's persistent .grad in the forward (Note [Head's gradient into .grad]).
TEST(TensorParallelOps, ChunkedLossOverVocabularySharesEqualsTheWholeLogits) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    const int64_t v = 8 * t;
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(22);
    at::Tensor targets = at::randint(0, v, {10}, g, at::kLong);
    targets.index_put_({at::arange(0, 10, 4)}, model::kIgnoredTarget);
    for (int k = 0; k < 6; ++k) {  // soft-cap or not; gradients in the forward, the backward, or into .grad
      const double cap = k % 2 ? 2.0 : 0.0, beta = k == 0 || k == 3 || k == 4 ? 0.05 : 0.0;
      const model::LossGradients when = k < 2   ? model::LossGradients::kInForward
                                        : k < 4 ? model::LossGradients::kInBackward
                                                : model::LossGradients::kIntoWeightGrad;
      const std::string what = "t = " + std::to_string(t) + ", case " + std::to_string(k);
      at::Tensor h = same({10, 6}, 23).requires_grad_(), w = same({v, 6}, 24).requires_grad_();
      at::Tensor z = at::mm(h, w.t());
      if (cap > 0) z = at::tanh(z / cap) * cap;
      const at::Tensor counted = (targets != model::kIgnoredTarget).to(at::kFloat);
      const at::Tensor z_term = beta * (at::logsumexp(z, 1).square() * counted).sum() / counted.sum();
      const at::Tensor want =
          (at::cross_entropy_loss(z, targets, {}, at::Reduction::Mean, model::kIgnoredTarget) + z_term) * 0.7;
      want.backward();
      at::Tensor mine_h = same({10, 6}, 23).requires_grad_();
      at::Tensor mine_w = chunk(same({v, 6}, 24), 0, t, r).clone().requires_grad_();
      if (when == model::LossGradients::kIntoWeightGrad) mine_w.mutable_grad() = at::zeros_like(mine_w);
      const at::Tensor mine_input = copy_to_tensor_parallel(mine_h, comm);
      const at::Tensor got = model::chunked_cross_entropy(mine_input, mine_w, targets, cap, 3, vocab_shard(r * 8, comm),
                                                          when, 0, false, 0.7, beta) *
                             0.7;
      if (when == model::LossGradients::kIntoWeightGrad) {
        EXPECT_GT(mine_w.grad().abs().max().item<double>(), 0.0) << "dW into .grad in the forward, " << what;
      }
      got.backward();
      EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5 * want.item<double>()) << what;
      expect_close(mine_h.grad(), h.grad(), "dh, " + what);
      expect_close(mine_w.grad(), chunk(w.grad(), 0, t, r), "dW, " + what);
    }
  }
}

// Records every call site's output (installed outermost).
class Recorder : public model::ForwardHooks {
 public:
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    at::Tensor y = forward(input);
    outputs[module] = y.detach().clone();
    return y;
  }
  std::map<std::string, at::Tensor> outputs;
};

// A model every group size here divides: heads 12, MLP 288 or 192, vocab 264,
// context 12; with grouped-query attention 24 heads sharing 12 key/value heads.
model::GptConfig divisible_model(bool llama, bool grouped_query = false) {
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.layers = 2;
  c.width = 72;
  c.heads = 12;
  c.context = 12;
  c.vocab_size = 264;
  if (llama) {
    c.norm = model::NormStyle::kRmsNorm;
    c.position = model::PositionStyle::kRope;
    c.mlp = model::MlpStyle::kSwiglu;
    c.tie_embeddings = false;
    c.bias = false;
  }
  if (grouped_query) c.width = 144, c.heads = 24, c.kv_heads = 12;
  return c;
}

// The part of a full-model output `want` that rank r of t holds in `got`:
// a sequence chunk (dim 1 with sequence parallel, dim 0 for positions), or a
// block of features (last dim; qkv holds q, k and v blocks).
at::Tensor part_held(const std::string& site, const at::Tensor& want, const at::Tensor& got, int t, int r,
                     bool grouped_query) {
  if (got.sizes() == want.sizes()) return want;
  const int64_t last = want.dim() - 1;
  for (int64_t d = 0; d < want.dim(); ++d) {
    if (got.size(d) == want.size(d)) continue;
    if (d != last) return chunk(want, d, t, r);
    const bool qkv = site.size() > 4 && site.compare(site.size() - 4, 4, ".qkv") == 0;
    const int64_t parts = qkv && !grouped_query ? 3 : 1;  // Note [Grouped-query layout]
    std::vector<int64_t> blocks = want.sizes().vec();
    blocks.back() = parts;
    blocks.push_back(t);
    blocks.push_back(want.size(last) / (parts * t));
    return want.reshape(blocks).select(-2, r).reshape(got.sizes());
  }
  return want;
}

TEST(TensorParallelLayers, EveryModuleAndGradientMatchesTheFullModel) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    const int r = comm->rank();
    for (int style : {0, 1, 2}) {  // gpt2, llama, llama with grouped-query attention
      for (bool sp : {false, true}) {
        const bool llama = style > 0, grouped = style == 2;
        const std::string where = std::string(grouped ? "llama-style GQA" : llama ? "llama-style" : "gpt2-style") +
                                  (sp ? " + SP" : "") + ", t = " + std::to_string(t);
        const model::GptConfig config = divisible_model(llama, grouped);
        model::Gpt full(config, 7), split(config, 7);
        TensorParallel tp(split, comm, gpt_tensor_parallel_plan(config, sp), {sp, 7});
        auto full_record = std::make_shared<Recorder>(), split_record = std::make_shared<Recorder>();
        full->add_forward_hooks(full_record);
        split->add_forward_hooks(split_record);

        at::Generator g = at::make_generator<at::CPUGeneratorImpl>(8);
        const at::Tensor tokens = at::randint(0, config.vocab_size, {3, config.context + 1}, g, at::kLong);
        const at::Tensor inputs = tokens.narrow(1, 0, config.context), targets = tokens.narrow(1, 1, config.context);
        const at::Tensor want = full->loss(inputs, targets), got = split->loss(inputs, targets);
        EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5 * want.item<double>()) << where;
        want.backward();
        got.backward();

        ASSERT_EQ(split_record->outputs.size(), full_record->outputs.size()) << where;
        for (const auto& [site, out] : full_record->outputs) {
          const at::Tensor& mine = split_record->outputs.at(site);
          expect_close(mine, part_held(site, out, mine, t, r, grouped), "output of '" + site + "', " + where);
        }
        auto full_params = full->named_parameters();
        for (const auto& item : split->named_parameters()) {
          const at::Tensor grad = tp.gather(item.key(), item.value().grad());
          expect_close(grad, full_params[item.key()].grad(), "gradient of " + item.key() + ", " + where, 1e-4);
          EXPECT_EQ(tp.is_split(item.key()), item.value().sizes() != full_params[item.key()].sizes()) << item.key();
        }
      }
    }
  }
}

TEST(TensorParallelLayers, PlanNamingNoModuleIsRejected) {
  const CommPtr comm = group_of(1);
  const model::GptConfig config = divisible_model(false);
  model::Gpt gpt(config, 1);
  TensorParallelPlan plan = gpt_tensor_parallel_plan(config, false);
  plan.push_back({"blocks.*.attn.qkvv", TensorParallelStyle::kColwise});
  const std::string error = testing::error_of([&] { TensorParallel tp(gpt, comm, plan, {}); });
  EXPECT_EQ(error, "tensor parallel plan: 'blocks.*.attn.qkvv' matches no module of the model");
}

TEST(TensorParallelRandom, LocalStreamsDifferAndTheSharedStreamStaysInStep) {
  for (int t : tp_sizes()) {
    const CommPtr comm = group_of(t);
    model::GptConfig config = divisible_model(false);
    config.dropout = 0.2;
    model::Gpt gpt(config, 3);
    TensorParallel tp(gpt, comm, gpt_tensor_parallel_plan(config, false), {false, 3});
    torch::manual_seed(5);
    at::Tensor local;
    const at::Tensor before = at::rand({4});
    tp.with_local_random([&] { local = at::rand({4}); });
    const at::Tensor after = at::rand({4});
    torch::manual_seed(5);
    at::rand({4});
    EXPECT_TRUE(at::equal(after, at::rand({4}))) << "the local draw moved the shared stream";
    at::Tensor all = at::empty({t, 8});
    comm->all_gather(all, at::cat({local, after})).wait();
    for (int q = 1; q < t; ++q) {
      EXPECT_FALSE(at::equal(all[q].narrow(0, 0, 4), all[0].narrow(0, 0, 4))) << "local streams of ranks 0, " << q;
      EXPECT_TRUE(at::equal(all[q].narrow(0, 4, 4), all[0].narrow(0, 4, 4))) << "shared streams of ranks 0, " << q;
    }

    // Without sequence parallel the residual stream is replicated: with
    // dropout on, every rank must draw the same masks there (the attention
    // core draws its own), so block outputs agree across the group.
    auto record = std::make_shared<Recorder>();
    gpt->add_forward_hooks(record);
    torch::manual_seed(6);
    const at::Tensor tokens = at::randint(0, config.vocab_size, {2, config.context}, at::kLong);
    torch::NoGradGuard no_grad;
    gpt->forward(tokens);
    const at::Tensor out = record->outputs.at("blocks.1").contiguous();
    at::Tensor outs = at::empty({t * out.numel()});
    comm->all_gather(outs, out.view(-1)).wait();
    for (int q = 1; q < t; ++q) {
      EXPECT_TRUE(at::equal(outs.narrow(0, q * out.numel(), out.numel()), out.view(-1))) << "rank " << q;
    }
    gpt->eval();
    gpt->forward(tokens);
    EXPECT_FALSE(at::equal(record->outputs.at("blocks.1"), out)) << "dropout had no effect";
  }
}

// Note [Activation memory, fp32]
// Korthikanti et al. 2022 count, per layer, fp16 activations plus 1-byte
// dropout masks: sbh(34 + 5as/h) unsplit, sbh(10 + 24/t + 5as/(ht)) with
// tensor parallel, (sbh/t)(34 + 5as/h) with sequence parallel. Here: fp32 (4
// bytes), dropout 0 (no masks), and attention by the fused CPU kernel (Note
// [CPU attention]), which keeps the causal softmax's blocks, k = 3s/4 entries
// per query and head (ATen's kernel, where it takes over, keeps k = 1: the
// log-sum-exp). What one block keeps for backward (and its output), in units
// of sbh bytes:
//   replicated: input of norm1 4, input of qkv 4, input of norm2 4, input of fc 4   = 16
//   split:      q, k, v 12 (contiguous copies; the qkv output is not kept, or,
//               under ATen's kernel, q, k, v are views of it), attention output
//               4 (proj's [b, s, h] input), fc output 16, gelu output 16       = 48
// plus the softmax 4ak/h: unsplit sbh(64 + 4ak/h), tensor parallel
// sbh(16 + (48 + 4ak/h)/t), sequence parallel (sbh/t)(64 + 4ak/h) (the column
// linears keep their sequence chunk and gather again in backward).
double activation_formula(int64_t s, int64_t b, int64_t h, int64_t a, int t, bool sp) {
  const bool batched = model::fused::batched_attention_applies(true, s, h / a, 0.0);
  const double k = batched ? double(model::fused::batched_attention_scores(s, s, true)) / double(s) : 1.0;
  const double sbh = double(s) * b * h, scores = 4.0 * a * k / h;
  if (t == 1) return sbh * (64 + scores);
  if (!sp) return sbh * (16 + (48 + scores) / t);
  return sbh / t * (64 + scores);
}

// Measures, with the counting allocator, what each block adds to memory in a
// training forward (kept for backward, plus its output).
class BlockMemory : public model::ForwardHooks {
 public:
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    if (module.rfind("blocks.", 0) != 0 || module.find('.', 7) != std::string::npos) return forward(input);
    const int64_t before = memory::current_bytes();
    at::Tensor y = forward(input);
    per_block.push_back(memory::current_bytes() - before);
    return y;
  }
  std::vector<int64_t> per_block;
};

TEST(TensorParallelMemory, ActivationsPerLayerFollowKorthikanti) {
  memory::install();
  std::vector<int> sizes = {1};
  for (int t : tp_sizes()) sizes.push_back(t);
  for (int t : sizes) {
    const CommPtr comm = group_of(t);
    for (bool sp : {false, true}) {
      if (sp && t == 1) continue;
      model::GptConfig config = model::GptConfig::preset("tiny");
      config.layers = 3;
      config.width = 192;
      config.heads = 12;
      config.context = 48;
      config.vocab_size = 264;
      const int64_t b = 4;
      model::Gpt gpt(config, 1);
      std::unique_ptr<TensorParallel> tp;
      if (t > 1) tp = std::make_unique<TensorParallel>(gpt, comm, gpt_tensor_parallel_plan(config, sp), TensorParallelOptions{sp, 1});
      auto meter = std::make_shared<BlockMemory>();
      gpt->add_forward_hooks(meter);
      const at::Tensor tokens = at::randint(0, config.vocab_size, {b, config.context}, at::kLong);
      const at::Tensor loss = gpt->loss(tokens, tokens);
      // The middle block (the first may share allocations with the embeddings).
      const double measured = double(meter->per_block.at(1));
      const double formula = activation_formula(config.context, b, config.width, config.heads, t, sp);
      const std::string where = "t = " + std::to_string(t) + (sp ? " + SP" : "");
      if (world()->rank() == 0) {
        std::printf("activations per layer, %s: measured %.0f bytes, formula %.0f, ratio %.3f\n", where.c_str(), measured,
                    formula, measured / formula);
      }
      EXPECT_NEAR(measured / formula, 1.0, 0.15) << where;
    }
  }
}

}  // namespace
}  // namespace meshtrain::parallel

namespace meshtrain::train {
namespace {

class TensorParallelTraining : public TrainingTest {
 protected:
  // tp = 2 and 4 alone (with data parallel over the rest), with and without
  // sequence parallel; and 2-D: sharded over fsdp x tp.
  std::vector<Overrides> layouts() const {
    const int n = world()->size();
    std::vector<Overrides> out;
    for (int t : {2, 4}) {
      if (n % t != 0) continue;
      out.push_back({"parallel.tp=" + std::to_string(t)});
      out.push_back({"parallel.tp=" + std::to_string(t), "parallel.sequence_parallel=true"});
    }
    if (n == 4) {
      out.push_back({"parallel.tp=2", "parallel.zero_stage=3"});
      out.push_back({"parallel.tp=2", "parallel.zero_stage=3", "parallel.sequence_parallel=true"});
    }
    if (n == 8) {
      out.push_back({"parallel.tp=4", "parallel.zero_stage=3", "parallel.sequence_parallel=true"});
      out.push_back({"parallel.tp=2", "parallel.zero_stage=2", "parallel.dp=2"});
    }
    return out;
  }
};

TEST_F(TensorParallelTraining, EqualsOneProcess) {
  const int n = world()->size();
  for (const Overrides& layout : layouts()) {
    const TrainConfig split = config(n, 1, "", layout);
    const int64_t micro = kBatch / split.data_ranks();
    Trainer parallel(config(n, micro, "", layout), world());
    expect_same_training(parallel, one_process_of(micro, {}, 5), 5, describe(layout));
  }
}

// bfloat16 autocast: the fused gathered linear computes in the autocast dtype
// as at::linear does; roundings differ in order, so the stated tolerance of the
// data-parallel bfloat16 test (2% on the loss) applies.
TEST_F(TensorParallelTraining, Bfloat16AutocastTracksOneProcess) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  const Overrides layout = {"parallel.tp=2", "parallel.sequence_parallel=true", "training.dtype=bfloat16"};
  const int64_t micro = kBatch / (n / 2);
  Trainer parallel(config(n, micro, "", layout), world());
  const OneProcessRun single = one_process(config(1, micro, "", {"training.dtype=bfloat16"}), 5);
  for (int s = 0; s < 5; ++s) {
    const StepResult got = parallel.step(), &want = single.steps[s];
    EXPECT_LE(std::abs(got.loss - want.loss) / want.loss, 0.02) << "step " << s + 1;
  }
}

// The fused CPU operators (model.fused, the default) in the split layers, the
// MLP's bias added with the GELU after the column-parallel linear, against one
// process on the reference operators; GPT-2 and Llama styles.
TEST_F(TensorParallelTraining, FusedOperatorsEqualTheReferenceProcess) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  const Overrides llama = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                           "model.tie_embeddings=false"};
  for (const Overrides& style : {Overrides{}, llama}) {
    for (const char* sp : {"parallel.sequence_parallel=false", "parallel.sequence_parallel=true"}) {
      Overrides layout = {"parallel.tp=2", sp, "model.fused=true"}, reference = {"model.fused=false"};
      layout.insert(layout.end(), style.begin(), style.end());
      reference.insert(reference.end(), style.begin(), style.end());
      const int64_t micro = kBatch / (n / 2);
      Trainer parallel(config(n, micro, "", layout), world());
      expect_same_training(parallel, one_process_of(micro, reference, 5), 5, describe(layout));
    }
  }
}

TEST_F(TensorParallelTraining, ResumeContinuesBitExactly) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  for (const Overrides& layout : {Overrides{"parallel.tp=2"},
                                  Overrides{"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=3"}}) {
    const std::string checkpoints = util::join_path(dir_, "checkpoints-" + std::to_string(layout.size()));
    const int64_t micro = kBatch / (n / 2);
    std::vector<double> straight;
    {
      Trainer trainer(config(n, micro, "", layout), world());
      for (int s = 0; s < 6; ++s) straight.push_back(trainer.step().loss);
    }
    {
      Trainer first_half(config(n, micro, checkpoints, layout), world());
      for (int s = 0; s < 3; ++s) EXPECT_EQ(first_half.step().loss, straight[s]) << s;
      first_half.save_checkpoint();
    }
    Trainer second_half(config(n, micro, checkpoints, layout), world());
    ASSERT_TRUE(second_half.resumed());
    for (int s = 3; s < 6; ++s) EXPECT_EQ(second_half.step().loss, straight[s]) << describe(layout) << ", step " << s + 1;
  }
}

}  // namespace
}  // namespace meshtrain::train
