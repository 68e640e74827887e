// Split a model of your own over ranks by annotating a few of its weights:
// meshtrain places every other tensor (the sharding rules) and runs the
// unchanged model on the pieces. Here Megatron's layout over a "tp" axis
// (the MLP's first layer by rows, its second by columns, the vocabulary of
// the embedding and of the head by rows), the batch over a "dp" axis, and a
// check against the same training in one process.
//
//   mpirun -np 2 annotate_my_model     (2 ranks: tp 2; 4 ranks: dp 2 x tp 2; ...)
#include <meshtrain/annotate/annotate.h>
#include <meshtrain/annotate/report.h>
#include <meshtrain/comm/runtime.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>

namespace {

namespace annotate = meshtrain::annotate;

// Your model: nothing in it knows about parallelism.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl() {
    torch::manual_seed(0);  // the same initial weights on every rank
    embed = register_module("embed", torch::nn::Embedding(96, 32));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    fc = register_module("fc", torch::nn::Linear(32, 128));
    proj = register_module("proj", torch::nn::Linear(128, 32));
    head = register_module("head", torch::nn::Linear(32, 96));
  }
  at::Tensor forward(const at::Tensor& ids) {
    const at::Tensor x = embed(ids);
    const at::Tensor h = x + proj(torch::gelu(fc(norm(x))));
    return head(h);
  }
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& targets) {
    return torch::cross_entropy_loss(forward(ids).reshape({-1, 96}), targets.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc{nullptr}, proj{nullptr}, head{nullptr};
};
TORCH_MODULE(TinyLm);

constexpr int64_t kBatch = 12, kLength = 8;
constexpr int kSteps = 5;

std::pair<at::Tensor, at::Tensor> batch(int step) {  // the same on every rank
  torch::manual_seed(1000 + step);
  const at::Tensor tokens = torch::randint(0, 96, {kBatch, kLength + 1});
  return {tokens.narrow(1, 0, kLength).contiguous(), tokens.narrow(1, 1, kLength).contiguous()};
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::comm::Runtime runtime(&argc, &argv);
  const auto world = runtime.world();
  const int n = world->size(), tp = n % 2 == 0 ? 2 : 1, dp = n / tp;
  auto mesh = std::make_shared<meshtrain::mesh::DeviceMesh>(
      world, meshtrain::mesh::MeshLayout::from_degrees({{"dp", dp}, {"tp", tp}}, n));

  // The reference: one process, the whole batch.
  TinyLm single;
  torch::optim::SGD single_opt(single->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));

  // The same model, annotated: these five lines are all that changes.
  TinyLm split;
  annotate::split(split->fc->weight, 0, tp, mesh, "tp");      // Megatron: rows (output features)
  annotate::split(split->fc->bias, 0, tp, mesh, "tp");
  annotate::split(split->proj->weight, 1, tp, mesh, "tp");    // columns (input features)
  annotate::split(split->embed->weight, 0, tp, mesh, "tp");   // the vocabulary
  annotate::split(split->head->weight, 0, tp, mesh, "tp");
  for (at::Tensor& p : split->parameters()) {
    if (!annotate::is_dist(p)) annotate::replicate(p, mesh);  // the rest whole on every rank
  }
  torch::optim::SGD split_opt(split->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));

  bool ok = true;
  for (int step = 0; step < kSteps; ++step) {
    auto [ids, targets] = batch(step);
    const at::Tensor want = single->loss(ids, targets);
    single_opt.zero_grad();
    want.backward();
    single_opt.step();

    std::optional<annotate::ReportScope> report;
    if (step == 0) report.emplace();
    // The batch split over dp; everything else follows from the annotations.
    const at::Tensor got = split->loss(annotate::split(ids, 0, dp, mesh, "dp"), annotate::split(targets, 0, dp, mesh, "dp"));
    split_opt.zero_grad();
    got.backward();
    annotate::settle_gradients(*split);  // gradients in their parameters' placements
    split_opt.step();

    const double a = got.item<double>(), b = want.item<double>();
    const bool close = std::abs(a - b) <= 1e-5 * std::abs(b);
    ok = ok && close;
    if (world->rank() == 0) {
      if (report) std::printf("step 1, what the sharding rules decided:\n%s", report->report().summary().c_str());
      std::printf("step %d: loss %.6f (one process %.6f)%s\n", step + 1, a, b, close ? "" : "  DIFFERS");
    }
  }
  auto want = single->named_parameters();
  for (const auto& item : split->named_parameters()) {
    const at::Tensor whole = annotate::full_tensor(item.value());
    const bool close = at::allclose(whole, want[item.key()], 1e-4, 1e-5);
    ok = ok && close;
    if (!close && world->rank() == 0) std::printf("parameter %s DIFFERS\n", item.key().c_str());
  }
  if (world->rank() == 0) {
    std::printf("%s on %d rank(s) (dp %d x tp %d)\n", ok ? "equal to one process" : "MISMATCH", n, dp, tp);
  }
  return ok ? 0 : 1;
}
