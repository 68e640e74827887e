// Train a model of your own across processes with meshtrain, unchanged:
// data parallel (DDP), then ZeRO-3 (fully sharded: every parameter, gradient
// and optimizer state split over the ranks), each checked against the same
// training in one process.
//
//   mpirun -np 2 train_my_model        (any number of ranks dividing 24)
#include <meshtrain/comm/runtime.h>
#include <meshtrain/parallel/data_parallel.h>
#include <meshtrain/parallel/fully_sharded.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>

namespace {

// Your model: nothing in it knows about parallelism.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl() {
    torch::manual_seed(0);  // the same initial weights on every rank
    encoder = register_module("encoder", torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                                                               torch::nn::Linear(64, 64), torch::nn::ReLU()));
    head = register_module("head", torch::nn::Linear(64, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return head(encoder->forward(x)); }
  torch::nn::Sequential encoder{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Classifier);

constexpr int64_t kBatch = 24;
constexpr int kSteps = 5;

// Step `step`'s global batch: the same on every rank.
std::pair<at::Tensor, at::Tensor> batch(int step) {
  torch::manual_seed(1000 + step);
  const at::Tensor x = torch::randn({kBatch, 16});
  return {x, (x.sum(1) > 0).to(torch::kLong) + 2 * (x.select(1, 0) > 0).to(torch::kLong)};
}

// Trains with `parallel` on rows [rank, rank + 1) / ranks of every batch;
// returns the mean loss over all ranks after each step.
std::vector<double> train(Classifier& model, meshtrain::parallel::DataParallelism& parallel,
                          meshtrain::comm::Communicator& comm) {
  std::vector<double> losses;
  const int64_t rows = kBatch / comm.size();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    parallel.zero_grad();
    parallel.set_sync(true);  // this backward ends the step: reduce its gradients
    const at::Tensor loss = torch::cross_entropy_loss(model->forward(x.narrow(0, comm.rank() * rows, rows)),
                                                      y.narrow(0, comm.rank() * rows, rows));
    loss.backward();
    parallel.after_backward();
    parallel.clip_grad_norm(1.0);
    parallel.step(/*lr=*/1e-2);
    at::Tensor mean = loss.detach().reshape({1}).to(torch::kDouble);
    comm.all_reduce(mean, meshtrain::comm::ReduceOp::kAvg).wait();
    losses.push_back(mean.item<double>());
  }
  return losses;
}

bool same(const std::vector<double>& got, const std::vector<double>& want, const char* what, int rank) {
  bool ok = true;
  for (size_t s = 0; s < want.size(); ++s) {
    const bool close = std::abs(got[s] - want[s]) <= 1e-5 * std::abs(want[s]);
    ok = ok && close;
    if (rank == 0) {
      std::printf("%-18s step %zu: loss %.6f (one process %.6f)%s\n", what, s + 1, got[s], want[s], close ? "" : "  DIFFERS");
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::comm::Runtime runtime(&argc, &argv);
  const auto world = runtime.world();
  namespace parallel = meshtrain::parallel;

  // The reference: each rank alone, the whole batch.
  const auto alone = world->split(world->rank(), 0, "alone");
  Classifier reference;
  parallel::DataParallel one(*reference, alone);
  const std::vector<double> want = train(reference, one, *alone);

  // Data parallel: gradients averaged over the ranks, overlapped with backward.
  Classifier replicated;
  parallel::DataParallel ddp(*replicated, world);
  const bool ddp_ok = same(train(replicated, ddp, *world), want, "data parallel", world->rank());

  // ZeRO-3: a unit per encoder layer and the head; each rank holds 1/N of every state.
  Classifier sharded;
  const auto self = world->split(world->rank(), 0, "self");
  parallel::FullyShardedOptions options;
  options.stage = 3;
  options.units = parallel::UnitPolicy::submodules({"encoder.0", "encoder.2", "head"});
  parallel::FullySharded zero3(sharded.ptr(), {/*shard=*/world, /*replicate=*/self, /*all=*/world}, options);
  const bool zero3_ok = same(train(sharded, zero3, *world), want, "ZeRO-3", world->rank());
  if (world->rank() == 0) {
    std::printf("ZeRO-3: %lld units, %lld of %lld parameters held by each rank\n", (long long)zero3.unit_count(),
                (long long)zero3.shard_numel(), (long long)zero3.padded_numel());
    std::printf("%s on %d rank(s)\n", ddp_ok && zero3_ok ? "both equal one process" : "MISMATCH", world->size());
  }
  return ddp_ok && zero3_ok ? 0 : 1;
}
