// Distributed tensors under mpirun: operators on distributed inputs in
// every placement against the same operator on the global values (outputs
// and input gradients), and a user-style MLP split Megatron-style over tp
// (and its batch over dp) trained with AdamW like one process.
#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/annotate/rules.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace meshtrain::annotate {
namespace {

using placement::Placement;
using testing::world;

at::Tensor fixed(const std::vector<int64_t>& shape, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble);
}

std::shared_ptr<const mesh::DeviceMesh> one_axis() {
  return std::make_shared<mesh::DeviceMesh>(world(), mesh::MeshLayout::from_degrees({{"tp", world()->size()}}, world()->size()));
}

// `p` along tp, Replicate on the other axes.
std::vector<Placement> tp(const std::shared_ptr<const mesh::DeviceMesh>& mesh, const Placement& p) {
  return placements_on(*mesh, {{"tp", p}});
}

// The placements of a 2-D tensor along one axis worth trying.
std::vector<Placement> placements_of(int64_t rank) {
  std::vector<Placement> out = {Placement::replicate()};
  for (int64_t d = 0; d < rank; ++d) out.push_back(Placement::shard(d));
  return out;
}

// f on distributed inputs (every placement pair) equals f on the globals,
// and so do the gradients of sum(f * weights).
void expect_matches(const std::string& what, const std::vector<at::Tensor>& globals,
                    const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f) {
  auto mesh = one_axis();
  std::vector<at::Tensor> plain;
  for (const at::Tensor& g : globals) plain.push_back(g.clone().requires_grad_(true));
  const at::Tensor want = f(plain);
  const at::Tensor weights = fixed(want.sizes().vec(), 99);
  (want * weights).sum().backward();
  std::vector<std::vector<Placement>> combos = {{}};
  for (const at::Tensor& g : globals) {
    std::vector<std::vector<Placement>> next;
    for (const auto& c : combos) {
      for (const Placement& p : placements_of(g.dim())) {
        auto more = c;
        more.push_back(p);
        next.push_back(more);
      }
    }
    combos = next;
  }
  for (const auto& combo : combos) {
    std::string name = what;
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < globals.size(); ++i) {
      inputs.push_back(distribute(globals[i], mesh, tp(mesh, combo[i])).requires_grad_(true));
      name += " " + combo[i].str();
    }
    const at::Tensor got = f(inputs);
    ASSERT_TRUE(is_dist(got)) << name;
    EXPECT_TRUE(at::allclose(full_tensor(got), want.detach(), 1e-10, 1e-12)) << name << ": output";
    (got * distribute(weights, mesh, tp(mesh, Placement::replicate()))).sum().backward();
    for (size_t i = 0; i < inputs.size(); ++i) {
      ASSERT_TRUE(inputs[i].grad().defined()) << name << ": no gradient for input " << i;
      EXPECT_TRUE(at::allclose(full_tensor(inputs[i].grad()), plain[i].grad(), 1e-10, 1e-12))
          << name << ": gradient of input " << i;
    }
  }
}

// Sizes every rank count here (1, 2, 3, 4, 8) divides.
TEST(DistTensor, MatrixProductsMatchTheGlobalOperator) {
  expect_matches("mm", {fixed({24, 48}, 1), fixed({48, 24}, 2)}, [](const auto& x) { return at::mm(x[0], x[1]); });
  expect_matches("linear", {fixed({24, 48}, 1), fixed({24, 48}, 2), fixed({24}, 3)},
                 [](const auto& x) { return at::linear(x[0], x[1], x[2]); });
  expect_matches("bmm", {fixed({24, 24, 24}, 1), fixed({24, 24, 48}, 2)}, [](const auto& x) { return at::bmm(x[0], x[1]); });
  expect_matches("linear 3-d", {fixed({24, 24, 24}, 1), fixed({48, 24}, 2)}, [](const auto& x) { return at::linear(x[0], x[1]); });
}

TEST(DistTensor, PointwiseReductionsViewsAndSoftmaxMatchTheGlobalOperator) {
  expect_matches("add broadcast", {fixed({24, 48}, 1), fixed({48}, 2)}, [](const auto& x) { return x[0] + x[1] * 2.0; });
  expect_matches("mul", {fixed({24, 48}, 1), fixed({24, 48}, 2)}, [](const auto& x) { return at::gelu(x[0]) * x[1]; });
  expect_matches("sum dim", {fixed({24, 48}, 1)}, [](const auto& x) { return x[0].sum(0); });
  expect_matches("mean", {fixed({24, 48}, 1)}, [](const auto& x) { return x[0].pow(2).mean(); });
  expect_matches("mean keepdim", {fixed({24, 48}, 1)}, [](const auto& x) { return x[0].mean(1, true) * x[0]; });
  expect_matches("transpose view", {fixed({24, 48}, 1)}, [](const auto& x) { return x[0].t().reshape({24, 48}); });
  expect_matches("softmax", {fixed({24, 48}, 1)}, [](const auto& x) { return at::log_softmax(x[0], 1) + at::softmax(x[0], 0); });
  expect_matches("partial times scalar", {fixed({24, 48}, 1), fixed({48, 24}, 2)},
                 [](const auto& x) { return (at::mm(x[0], x[1]) * 3.0).tanh(); });
  expect_matches("partial plus a number", {fixed({24, 48}, 1), fixed({48, 24}, 2)},
                 [](const auto& x) { return (at::mm(x[0], x[1]) + 1.5) * (at::mm(x[0], x[1]) - 0.5); });
}

// The tp placement of a distributed argument, or Replicate.
Placement tp_of(const at::Tensor& t) {
  return is_dist(t) ? dist_state(t).placements[dist_state(t).mesh->layout().axis_index("tp")] : Placement::replicate();
}

// Integer ids (or targets) placed like the rows of `like` (dim `dim`) when those are split.
at::Tensor ids_like(const at::Tensor& ids, const at::Tensor& like, int64_t dim) {
  if (!is_dist(like) || !tp_of(like).is_shard(dim)) return ids;
  return distribute(ids, dist_state(like).mesh, tp(dist_state(like).mesh, Placement::shard(0)));
}

TEST(DistTensor, TransformerOperatorsMatchTheGlobalOperator) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor ids = at::randint(0, 48, {24}, g, at::kLong);
  // The table split by rows (vocabulary), by columns, or whole; ids whole.
  expect_matches("embedding", {fixed({48, 24}, 1)}, [&](const auto& x) { return at::embedding(x[0], ids); });
  expect_matches("embedding, ids split", {fixed({48, 24}, 1), fixed({24, 24}, 2)},
                 [&](const auto& x) { return at::embedding(x[0], ids_like(ids, x[1], 0)) * x[1]; });
  expect_matches("layer_norm", {fixed({24, 48}, 1), fixed({48}, 2), fixed({48}, 3)},
                 [](const auto& x) { return at::layer_norm(x[0], {48}, x[1], x[2]); });
  expect_matches("layer_norm after a partial sum", {fixed({24, 48}, 1), fixed({48, 48}, 2), fixed({48}, 3)},
                 [](const auto& x) { return at::layer_norm(at::mm(x[0], x[1]), {48}, x[2]); });
  expect_matches("rms_norm", {fixed({24, 48}, 1), fixed({48}, 2)},
                 [](const auto& x) { return at::rms_norm(x[0], {48}, x[1], 1e-5); });
  expect_matches("cat", {fixed({24, 48}, 1), fixed({24, 24}, 2)}, [](const auto& x) { return at::cat({x[0], x[1] * 2.0}, 1); });
  expect_matches("rotary halves", {fixed({24, 48}, 1)}, [](const auto& x) {
    return at::cat({x[0].narrow(1, 0, 24) * 2.0, x[0].narrow(1, 24, 24)}, 1);
  });
  // Cross-entropy with the vocabulary (or the rows) split: no gathering of logits.
  const at::Tensor targets = at::randint(0, 48, {24}, g, at::kLong);
  expect_matches("cross_entropy", {fixed({24, 48}, 1)}, [&](const auto& x) {
    return at::cross_entropy_loss(x[0], ids_like(targets, x[0], 0));
  });
  const at::Tensor ignored = targets.masked_fill(at::arange(24) % 5 == 0, -100);
  expect_matches("cross_entropy ignoring some", {fixed({24, 48}, 1)}, [&](const auto& x) {
    return at::cross_entropy_loss(x[0], ids_like(ignored, x[0], 0));
  });
  expect_matches("softmax over a split dim", {fixed({24, 48}, 1)}, [](const auto& x) { return at::softmax(x[0], 1) * 3.0; });
  // Dropout: the mask is one process's, whatever the placement.
  expect_matches("dropout", {fixed({24, 48}, 1)}, [](const auto& x) {
    torch::manual_seed(11);
    return at::dropout(x[0], 0.5, true);
  });
}

TEST(DistTensor, AttentionSplitsBatchOrHeads) {
  auto mesh = one_axis();
  const std::vector<int64_t> shape = {8, 24, 24, 16};
  std::vector<at::Tensor> plain;
  for (uint64_t s : {1, 2, 3}) plain.push_back(fixed(shape, s).to(at::kFloat).requires_grad_(true));
  const at::Tensor want = at::scaled_dot_product_attention(plain[0], plain[1], plain[2], {}, 0.0, true);
  const at::Tensor weights = fixed(shape, 4).to(at::kFloat);
  (want * weights).sum().backward();
  for (const Placement& p : {Placement::shard(0), Placement::shard(1), Placement::replicate()}) {
    if (p.is_shard() && shape[p.dim] % world()->size() != 0) continue;
    std::vector<at::Tensor> qkv;
    for (const at::Tensor& t : plain) qkv.push_back(distribute(t.detach(), mesh, tp(mesh, p)).requires_grad_(true));
    const at::Tensor got = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, true);
    if (world()->size() > 1 && p.is_shard()) EXPECT_EQ(tp_of(got), p);  // (whole inputs may be cut: slicing is free)
    EXPECT_TRUE(at::allclose(full_tensor(got), want, 1e-4, 1e-5)) << p.str();
    (got * distribute(weights, mesh, tp(mesh, Placement::replicate()))).sum().backward();
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::allclose(full_tensor(qkv[i].grad()), plain[i].grad(), 1e-4, 1e-5)) << p.str() << " input " << i;
    }
  }
}

// Sizes 3 and 4 ranks split into uneven chunks (5 over 4: 2, 1, 1, 1).
TEST(DistTensor, UnevenSplitsMatchTheGlobalOperator) {
  expect_matches("mm", {fixed({10, 14}, 1), fixed({14, 6}, 2)}, [](const auto& x) { return at::mm(x[0], x[1]); });
  expect_matches("linear 3-d", {fixed({5, 7, 6}, 1), fixed({10, 6}, 2)}, [](const auto& x) { return at::linear(x[0], x[1]); });
  expect_matches("linear", {fixed({10, 14}, 1), fixed({6, 14}, 2), fixed({6}, 3)}, [](const auto& x) { return at::linear(x[0], x[1], x[2]); });
  expect_matches("add broadcast", {fixed({10, 14}, 1), fixed({14}, 2)}, [](const auto& x) { return x[0] + x[1] * 2.0; });
  expect_matches("sum dim", {fixed({10, 14}, 1)}, [](const auto& x) { return x[0].sum(0); });
  expect_matches("mean", {fixed({10, 14}, 1)}, [](const auto& x) { return x[0].pow(2).mean(); });
  expect_matches("mean keepdim", {fixed({10, 14}, 1)}, [](const auto& x) { return x[0].mean(1, true) * x[0]; });
  expect_matches("transpose view", {fixed({10, 14}, 1)}, [](const auto& x) { return x[0].t().reshape({10, 14}); });
  expect_matches("softmax", {fixed({10, 14}, 1)}, [](const auto& x) { return at::log_softmax(x[0], 1) + at::softmax(x[0], 0); });
  expect_matches("layer_norm", {fixed({10, 14}, 1), fixed({14}, 2), fixed({14}, 3)},
                 [](const auto& x) { return at::layer_norm(x[0], {14}, x[1], x[2]); });
  expect_matches("cat", {fixed({10, 14}, 1), fixed({10, 6}, 2)}, [](const auto& x) { return at::cat({x[0], x[1] * 2.0}, 1); });
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor targets = at::randint(0, 14, {10}, g, at::kLong);
  expect_matches("cross_entropy", {fixed({10, 14}, 1)}, [&](const auto& x) {
    return at::cross_entropy_loss(x[0], ids_like(targets, x[0], 0));
  });
  const at::Tensor ids = at::randint(0, 10, {7}, g, at::kLong);
  expect_matches("embedding", {fixed({10, 6}, 1)}, [&](const auto& x) { return at::embedding(x[0], ids); });
}

TEST(DistTensor, AnOperatorWithoutARuleIsAnErrorNamingIt) {
  auto mesh = one_axis();
  const at::Tensor t = distribute(fixed({24, 24}, 1), mesh, tp(mesh, Placement::shard(0)));
  try {
    at::cumsum(t, 0);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("aten::cumsum"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no sharding rule"), std::string::npos) << e.what();
  }
}

TEST(DistTensor, TheCheapestRedistributionIsChosenAlikeEverywhere) {
  const int n = world()->size();
  if (n == 1) GTEST_SKIP() << "one rank moves nothing";
  auto mesh = one_axis();
  // A large activation split on rows times a small weight split on columns:
  // gathering the weight (the small one) is cheaper than gathering the rows.
  const at::Tensor x = distribute(fixed({192, 48}, 1), mesh, tp(mesh, Placement::shard(0)));
  const at::Tensor w = distribute(fixed({48, 24}, 2), mesh, tp(mesh, Placement::shard(1)));
  const at::Tensor y = at::mm(x, w);
  const Placement got = dist_state(y).placements[mesh->layout().axis_index("tp")];
  EXPECT_EQ(got, Placement::shard(0)) << got.str();
  // Every rank chose alike: the choice, gathered.
  at::Tensor mine = at::tensor({static_cast<int64_t>(got.kind), got.dim}, at::kLong);
  at::Tensor all = at::empty({2 * world()->size()}, at::kLong);
  world()->all_gather(all, mine).wait();
  for (int r = 0; r < world()->size(); ++r) {
    EXPECT_EQ(all[2 * r].item<int64_t>(), mine[0].item<int64_t>()) << "rank " << r;
    EXPECT_EQ(all[2 * r + 1].item<int64_t>(), mine[1].item<int64_t>()) << "rank " << r;
  }
  // And it is the cheapest by the cost model: gathering w's columns against gathering x's rows.
  const double gather_w = redistribute_bytes(spec_of(w), Placement::shard(1), Placement::replicate(), n);
  const double gather_x = redistribute_bytes(spec_of(x), Placement::shard(0), Placement::replicate(), n);
  EXPECT_LT(gather_w, gather_x);
  // Summed columns: a matmul over the split inner dim leaves a partial sum, summed only when needed.
  const at::Tensor a = distribute(fixed({24, 48}, 3), mesh, tp(mesh, Placement::shard(1)));
  const at::Tensor b = distribute(fixed({48, 24}, 4), mesh, tp(mesh, Placement::shard(0)));
  EXPECT_TRUE(dist_state(at::mm(a, b)).placements[mesh->layout().axis_index("tp")].is_partial());
}

// The user's model: nothing distributed in it.
struct MlpImpl : torch::nn::Module {
  MlpImpl() : fc(register_module("fc", torch::nn::Linear(12, 48))), proj(register_module("proj", torch::nn::Linear(48, 12))) {}
  at::Tensor forward(const at::Tensor& x) { return proj(torch::gelu(fc(x))); }
  torch::nn::Linear fc, proj;
};
TORCH_MODULE(Mlp);

TEST(DistTensor, AnAnnotatedMlpTrainsLikeOneProcess) {
  const int n = world()->size();
  for (const int64_t tp : {int64_t{n}, int64_t{n % 2 == 0 ? 2 : 1}}) {
    const int64_t dp = n / tp;
    auto mesh = std::make_shared<mesh::DeviceMesh>(world(), mesh::MeshLayout::from_degrees({{"dp", static_cast<int>(dp)}, {"tp", static_cast<int>(tp)}}, n));
    torch::manual_seed(5);
    Mlp single, split;
    torch::manual_seed(5);
    split = Mlp();
    // Megatron: fc's rows and proj's columns over tp, copies over dp.
    {
      torch::NoGradGuard no_grad;
      split->fc->weight = distribute(split->fc->weight, mesh, placements_on(*mesh, {{"tp", Placement::shard(0)}})).requires_grad_(true);
      split->fc->bias = distribute(split->fc->bias, mesh, placements_on(*mesh, {{"tp", Placement::shard(0)}})).requires_grad_(true);
      split->proj->weight = distribute(split->proj->weight, mesh, placements_on(*mesh, {{"tp", Placement::shard(1)}})).requires_grad_(true);
      split->proj->bias = distribute(split->proj->bias, mesh, placements_on(*mesh, {})).requires_grad_(true);
    }
    std::vector<at::Tensor> params = {split->fc->weight, split->fc->bias, split->proj->weight, split->proj->bias};
    torch::optim::AdamW opt_single(single->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_split(params, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 4; ++step) {
      const at::Tensor x = fixed({24, 12}, 10 + step).to(at::kFloat), y = fixed({24, 12}, 20 + step).to(at::kFloat);
      const at::Tensor loss = (single->forward(x) - y).pow(2).mean();
      opt_single.zero_grad();
      loss.backward();
      opt_single.step();
      // The batch split over dp.
      const at::Tensor xs = distribute(x, mesh, placements_on(*mesh, {{"dp", Placement::shard(0)}})), ys = distribute(y, mesh, placements_on(*mesh, {{"dp", Placement::shard(0)}}));
      const at::Tensor got = (split->forward(xs) - ys).pow(2).mean();
      opt_split.zero_grad();
      got.backward();
      opt_split.step();
      EXPECT_NEAR(got.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>()) << "dp " << dp << " tp " << tp << " step " << step;
    }
    EXPECT_TRUE(at::allclose(full_tensor(split->fc->weight), single->fc->weight, 1e-5, 1e-6)) << "dp " << dp << " tp " << tp;
    EXPECT_TRUE(at::allclose(full_tensor(split->proj->weight), single->proj->weight, 1e-5, 1e-6)) << "dp " << dp << " tp " << tp;
    EXPECT_EQ(to_local(split->fc->weight).size(0), placement::chunk_sizes(48, tp)[mesh->coordinate("tp")]);
  }
}

}  // namespace
}  // namespace meshtrain::annotate
