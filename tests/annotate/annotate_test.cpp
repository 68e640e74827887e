// Sharding annotations under mpirun: the four annotation forms, parameters
// annotated in place on an unchanged module, the GPT (both styles) trained
// from Megatron-style weight annotations over dp x tp like one process, and
// the sharding report against the bytes the communicators counted.
#include "meshtrain/annotate/annotate.h"
#include "meshtrain/annotate/gpt_annotations.h"
#include "meshtrain/annotate/report.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/annotated_tensor_parallel.h"
#include "meshtrain/parallel/parallel_state.h"
#include "meshtrain/parallel/step_engine.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace meshtrain::annotate {
namespace {

using placement::Placement;
using testing::world;

Mesh mesh_of(int dp, int tp) {
  return std::make_shared<mesh::DeviceMesh>(world(), mesh::MeshLayout::from_degrees({{"dp", dp}, {"tp", tp}}, world()->size()));
}

Placement on(const at::Tensor& t, const std::string& axis) {
  const DistState& s = dist_state(t);
  return s.placements[s.mesh->layout().axis_index(axis)];
}

// (dp, tp) pairs the world factors into, tp dividing `divides`.
std::vector<std::pair<int, int>> factorisations(int divides) {
  std::vector<std::pair<int, int>> out;
  const int n = world()->size();
  for (int tp = 1; tp <= n; ++tp) {
    if (n % tp == 0 && divides % tp == 0) out.push_back({n / tp, tp});
  }
  return out;
}

TEST(Annotations, TheFourFormsPlaceTensorsAsTheySay) {
  const int n = world()->size();
  const Mesh mesh = mesh_of(1, n);
  const at::Tensor x = at::arange(24 * 24, at::kFloat).reshape({24, 24});
  EXPECT_TRUE(on(replicate(x, mesh), "tp").is_replicate());
  if (n > 1) EXPECT_EQ(on(split(x, 0, n, mesh), "tp"), Placement::shard(0));
  if (n > 1) EXPECT_EQ(on(mesh_split(x, mesh, {-1, mesh->layout().axis_index("tp")}), "tp"), Placement::shard(1));
  EXPECT_TRUE(at::equal(full_tensor(split(x, 1, n, mesh, "tp")), x));
  if (n == 4) {
    // A 2 x 2 mesh: tiles [2, 2] with devices in column order put dim 0 on tp, dim 1 on dp.
    const Mesh square = mesh_of(2, 2);
    const at::Tensor t = shard(x, square, {2, 2}, {0, 2, 1, 3});
    EXPECT_EQ(on(t, "tp"), Placement::shard(0));
    EXPECT_EQ(on(t, "dp"), Placement::shard(1));
    EXPECT_TRUE(at::equal(full_tensor(t), x));
    const at::Tensor u = shard(x, square, {2, 2}, {0, 1, 2, 3});
    EXPECT_EQ(on(u, "dp"), Placement::shard(0));
    EXPECT_EQ(on(u, "tp"), Placement::shard(1));
    try {
      shard(x, square, {2, 2}, {0, 3, 1, 2});
      FAIL() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("device order [0,3,1,2]"), std::string::npos) << e.what();
    }
    try {
      split(x, 0, 2, square);
      FAIL() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("name the axis"), std::string::npos) << e.what();
    }
  }
  // On an activation: a constraint, with autograd.
  const at::Tensor leaf = x.clone().requires_grad_(true);
  const at::Tensor y = replicate(leaf * 2.0, mesh);  // a plain intermediate: distributed as given
  EXPECT_TRUE(is_dist(y));
}

// A constraint on an activation: the value goes where it says, and so does
// its gradient (a partial one summed there: Megatron's f).
TEST(Annotations, AConstraintPutsTheGradientWhereTheValueWent) {
  const int n = world()->size();
  const Mesh mesh = mesh_of(1, n);
  const int tp = mesh->layout().axis_index("tp");
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(4);  // the same values on every rank
  const at::Tensor a0 = at::randn({24, 48}, g, at::kDouble), b0 = at::randn({48, 24}, g, at::kDouble);
  const at::Tensor w0 = at::randn({24, 24}, g, at::kDouble);
  const at::Tensor a = mesh_split(a0.clone().requires_grad_(true), mesh, {-1, tp});
  const at::Tensor b = mesh_split(b0.clone().requires_grad_(true), mesh, {tp, -1});
  const at::Tensor w = mesh_split(w0.clone().requires_grad_(true), mesh, {-1, tp});
  const at::Tensor t = at::mm(a, b);  // a partial sum
  if (n > 1) EXPECT_TRUE(on(t, "tp").is_partial());
  at::Tensor seen;
  t.register_hook([&](const at::Tensor& grad) { seen = grad; });
  const at::Tensor c = replicate(t, mesh);
  EXPECT_TRUE(on(c, "tp").is_replicate());
  at::mm(c, w).pow(2).sum().backward();
  ASSERT_TRUE(seen.defined());
  EXPECT_TRUE(on(seen, "tp").is_replicate()) << on(seen, "tp").str();
  // The values: as on whole tensors.
  const at::Tensor pa = a0.clone().requires_grad_(true), pb = b0.clone().requires_grad_(true), pw = w0.clone().requires_grad_(true);
  at::mm(at::mm(pa, pb), pw).pow(2).sum().backward();
  EXPECT_TRUE(at::allclose(full_tensor(a.grad()), pa.grad()));
  EXPECT_TRUE(at::allclose(full_tensor(b.grad()), pb.grad()));
  EXPECT_TRUE(at::allclose(full_tensor(w.grad()), pw.grad()));
}

// Every (distributed) parameter of `got`, made whole, against `want`'s.
void expect_same_parameters(torch::nn::Module& got, torch::nn::Module& want, const std::string& where) {
  auto expected = want.named_parameters();
  for (const auto& item : got.named_parameters()) {
    const at::Tensor whole = full_tensor(item.value());
    EXPECT_TRUE(at::allclose(whole, expected[item.key()], 1e-4, 1e-5))
        << where << " " << item.key() << " differs by " << (whole - expected[item.key()]).abs().max().item<double>();
  }
}

// The user's model: nothing distributed in it.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : embed(register_module("embed", torch::nn::Embedding(48, 24))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({24})))),
        fc(register_module("fc", torch::nn::Linear(24, 96))),
        proj(register_module("proj", torch::nn::Linear(96, 24))),
        head(register_module("head", torch::nn::Linear(24, 48))) {}
  at::Tensor forward(const at::Tensor& ids) {
    const at::Tensor x = embed(ids);
    return head(norm(x + proj(torch::gelu(fc(x)))));
  }
  torch::nn::Embedding embed;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc, proj, head;
};
TORCH_MODULE(Net);

TEST(Annotations, ParametersAreAnnotatedInPlaceAndTheModelTrainsLikeOneProcess) {
  for (const auto& [dp, tp] : factorisations(24)) {
    const std::string where = "dp " + std::to_string(dp) + " x tp " + std::to_string(tp);
    const Mesh mesh = mesh_of(dp, tp);
    torch::manual_seed(3);
    Net single;
    torch::manual_seed(3);
    Net split_net;
    // Annotations only: the module's code and its fields are untouched.
    split(split_net->embed->weight, 0, tp, mesh, "tp");
    split(split_net->fc->weight, 0, tp, mesh, "tp");
    split(split_net->fc->bias, 0, tp, mesh, "tp");
    split(split_net->proj->weight, 1, tp, mesh, "tp");
    mesh_split(split_net->head->weight, mesh, {mesh->layout().axis_index("tp"), -1});
    for (at::Tensor& p : split_net->parameters()) {
      if (!is_dist(p)) replicate(p, mesh);
    }
    ASSERT_TRUE(is_dist(split_net->fc->weight)) << where;
    EXPECT_EQ(to_local(split_net->fc->weight).size(0), 96 / tp) << where;
    torch::optim::AdamW opt_single(single->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_split(split_net->parameters(), torch::optim::AdamWOptions(1e-2));
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(9);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor ids = at::randint(0, 48, {24, 4}, g, at::kLong), targets = at::randint(0, 48, {24 * 4}, g, at::kLong);
      const at::Tensor loss = at::cross_entropy_loss(single->forward(ids).reshape({-1, 48}), targets);
      opt_single.zero_grad();
      loss.backward();
      opt_single.step();
      const at::Tensor got = at::cross_entropy_loss(split_net->forward(split(ids, 0, dp, mesh, "dp")).reshape({-1, 48}),
                                                    split(targets, 0, dp, mesh, "dp"));
      opt_split.zero_grad();
      got.backward();
      settle_gradients(*split_net);
      opt_split.step();
      EXPECT_NEAR(got.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>()) << where << " step " << step;
    }
    expect_same_parameters(*split_net, *single, where);
  }
}

// A GPT whose heads (12) every tp here divides; `vocab` 263 splits unevenly.
model::GptConfig divisible_model(bool llama, int64_t vocab = 264) {
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.layers = 2, c.width = 72, c.heads = 12, c.context = 12, c.vocab_size = vocab;
  if (llama) {
    c.norm = model::NormStyle::kRmsNorm, c.position = model::PositionStyle::kRope, c.mlp = model::MlpStyle::kSwiglu, c.tie_embeddings = false, c.bias = false;
  }
  return c;
}

// Uneven too: the vocabulary (263) over tp, the batch (10) over dp.
TEST(Annotations, GptFromWeightAnnotationsTrainsLikeOneProcess) {
  for (bool llama : {false, true}) {
    const model::GptConfig config = divisible_model(llama, 263);
    for (const auto& [dp, tp] : factorisations(12)) {
      const std::string where = std::string(llama ? "llama" : "gpt2") + ", dp " + std::to_string(dp) + " x tp " + std::to_string(tp);
      const Mesh mesh = mesh_of(dp, tp);
      model::Gpt single(config, 7), split_gpt(config, 7);
      const std::vector<std::string> annotated = annotate_module(*split_gpt, mesh, gpt_megatron_annotations(config, *mesh));
      EXPECT_EQ(annotated.empty(), tp == 1) << where;
      // SGD with momentum: its steps are linear in the gradients, so a
      // difference shows at its size (AdamW's sign-like first steps turn a
      // near-zero gradient's last bits into a whole step either way).
      torch::optim::SGD opt_single(single->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      torch::optim::SGD opt_split(split_gpt->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(8);
      for (int step = 0; step < 3; ++step) {
        const at::Tensor tokens = at::randint(0, config.vocab_size, {10, config.context + 1}, g, at::kLong);
        const at::Tensor inputs = tokens.narrow(1, 0, config.context).contiguous();
        const at::Tensor targets = tokens.narrow(1, 1, config.context).contiguous();
        const at::Tensor loss = single->loss(inputs, targets);
        opt_single.zero_grad();
        loss.backward();
        opt_single.step();
        const at::Tensor got = split_gpt->loss(split(inputs, 0, dp, mesh, "dp"), split(targets, 0, dp, mesh, "dp"));
        opt_split.zero_grad();
        got.backward();
        settle_gradients(*split_gpt);
        auto grads = single->named_parameters();
        for (const auto& item : split_gpt->named_parameters()) {
          const at::Tensor mine = full_tensor(item.value().grad()), want_grad = grads[item.key()].grad();
          const double scale = want_grad.abs().max().item<double>();
          EXPECT_LE((mine - want_grad).abs().max().item<double>(), 1e-4 * scale) << where << " gradient of " << item.key();
        }
        opt_split.step();
        EXPECT_NEAR(got.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>()) << where << " step " << step;
      }
      expect_same_parameters(*split_gpt, *single, where);
    }
  }
}

int64_t wire_bytes(const comm::Communicator& comm) {
  int64_t total = 0;
  for (const auto& op : comm.stats().per_op) total += op.wire_bytes;
  return total;
}

TEST(Annotations, TheReportListsEveryCollectiveWithItsBytes) {
  const int n = world()->size();
  if (12 % n != 0) GTEST_SKIP() << "tp = " << n << " does not divide the heads";
  const model::GptConfig config = divisible_model(false);
  const Mesh mesh = mesh_of(1, n);
  model::Gpt gpt(config, 7);
  annotate_module(*gpt, mesh, gpt_megatron_annotations(config, *mesh));
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(8);
  const at::Tensor tokens = at::randint(0, config.vocab_size, {4, config.context + 1}, g, at::kLong);
  const int64_t before = wire_bytes(*mesh->comm("tp"));
  ReportScope scope;
  gpt->loss(tokens.narrow(1, 0, config.context), tokens.narrow(1, 1, config.context)).backward();
  settle_gradients(*gpt);
  const ShardingReport& report = scope.report();
  EXPECT_EQ(report.bytes(), wire_bytes(*mesh->comm("tp")) - before) << report.summary();
  if (n == 1) return;
  // Megatron's pattern: activations summed before each norm (embedding, 2 per block), never the logits gathered.
  int64_t norm_sums = 0;
  for (const ReportedCollective& c : report.collectives) {
    EXPECT_NE(c.kind, "all_gather") << c.op << " " << c.tensor << "\n" << report.summary();
    if (c.op == "native_layer_norm" && c.kind == "all_reduce") ++norm_sums;
  }
  EXPECT_EQ(norm_sums, 1 + 2 * config.layers) << report.summary();
  const int64_t activation = 4 * config.context * config.width * 4;  // [4, 12, 72] fp32
  EXPECT_EQ(report.bytes("all_reduce") >= norm_sums * 2 * activation * (n - 1) / n, true) << report.summary();
  EXPECT_FALSE(report.operators.empty());
  EXPECT_NE(report.jsonl().find("\"collective\":\"all_reduce\""), std::string::npos);
}

// The trainer's model: tp_impl "annotations" against the hand-written plan,
// the same layout (dp x tp), steps and micro-batches: the same losses,
// parameters and bytes over tp.
TEST(Annotations, TheTrainersAnnotatedTensorParallelEqualsThePlan) {
  const int n = world()->size();
  for (const auto& [dp, tp] : factorisations(12)) {
    if (tp == 1) continue;
    for (int zero : {0, 1, 2}) {
    if (zero > 0 && dp == 1) continue;
    const std::string where = "dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + ", zero " + std::to_string(zero);
    for (bool llama : {false, true}) {
      const model::GptConfig config = divisible_model(llama);
      std::vector<double> losses[2];
      std::map<std::string, at::Tensor> params[2];
      int64_t bytes[2] = {0, 0};
      for (int impl = 0; impl < 2; ++impl) {
        parallel::ParallelizeOptions o;
        o.spec.dims.tp = tp;
        o.spec.dims.zero_stage = zero;
        o.spec.dims.resolve(n);
        o.microbatches = 2;
        o.micro_batch = 2;
        o.spec.tp_impl = impl == 0 ? parallel::TensorParallelImpl::kPlan : parallel::TensorParallelImpl::kAnnotations;
        o.adamw.lr = 1e-3;
        auto model = std::make_unique<parallel::StepEngine>(parallel::parallelize(model::Gpt(config, 7), world(), o));
        const auto& tp_comm = model->parts().tensor->comm();
        at::Generator g = at::make_generator<at::CPUGeneratorImpl>(31 + model->parts().data->rank());
        for (int step = 0; step < 3; ++step) {
          std::vector<model::Batch> batches;
          for (int m = 0; m < 2; ++m) {
            const at::Tensor tokens = at::randint(0, config.vocab_size, {2, config.context + 1}, g, at::kLong);
            batches.emplace_back(tokens.narrow(1, 0, config.context).contiguous(),
                                 tokens.narrow(1, 1, config.context).contiguous(), 0.5);
          }
          const int64_t before = wire_bytes(*tp_comm);
          model->zero_grad();
          const double loss = model->forward_backward(batches);
          model->clip_grad_norm(1.0);
          model->step(1e-3);
          if (step == 0) bytes[impl] = wire_bytes(*tp_comm) - before;
          losses[impl].push_back(model->mean_loss(loss));
        }
        params[impl] = parallel::full_parameters(model->parts());
      }
      const std::string what = where + (llama ? ", llama" : ", gpt2");
      for (int step = 0; step < 3; ++step) {
        EXPECT_NEAR(losses[1][step], losses[0][step], 1e-5 * losses[0][step]) << what << " step " << step;
      }
      // The trainer's AdamW (lr 1e-3) turns last-bit gradient differences of
      // near-zero entries into up to a few percent of a step: 1e-4 absolute.
      for (const auto& [name, want] : params[0]) {
        EXPECT_TRUE(at::allclose(params[1].at(name), want, 1e-4, 1e-4))
            << what << " " << name << " differs by " << (params[1].at(name) - want).abs().max().item<double>();
      }
      // The same collectives over tp (Megatron's), give or take the loss's few numbers.
      EXPECT_NEAR(static_cast<double>(bytes[1]), static_cast<double>(bytes[0]), 0.02 * bytes[0]) << what;
    }
    }
  }
}

}  // namespace
}  // namespace meshtrain::annotate
