// The CUDA path, run where a GPU is visible (elsewhere the binary reports
// SKIPPED, see tests/harness/mpi_main.cpp). One rank: the model against the
// CPU, the fused GPU kernels against the CPU's, the chunked loss with a
// padded vocabulary against the CPU, training
// on cuda:0 against the same training on the CPU, bfloat16
// autocast, the caching allocator's peak against the planner, the NCCL
// communicator (every collective through NCCL), FSDP's storage swap and
// activation checkpointing's random streams. Two ranks sharing the one GPU
// (NCCL refuses that; the host-staged MPI backend carries the CUDA tensors):
// data parallel, ZeRO-3, tensor + sequence parallel, a pipeline and expert
// parallel against one process on the GPU.
#include "meshtrain/comm/backend/nccl/nccl_communicator.h"
#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/parallel/random_streams.h"
#include "tests/parallel/training_fixture.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/cuda.h>

#include <cstring>
#include <functional>
#include <string_view>

namespace meshtrain::train {
namespace {

using Overrides = std::vector<std::string>;

Overrides on_gpu(Overrides layout) {
  layout.push_back("run.device=cuda");
  return layout;
}

std::string describe(const Overrides& layout) {
  std::string text;
  for (const std::string& o : layout) text += (text.empty() ? "" : " ") + o;
  return text.empty() ? "data parallel" : text;
}

void seed_everything(uint64_t seed) {
  at::manual_seed(seed);  // the CPU and every CUDA device
}

class CudaTest : public TrainingTest {};

// The GPU's operators against the CPU's on the same weights: GPT-2's and
// Llama's blocks in fp32, and grouped queries (2 key/value heads for 4) each
// way Note [Grouped queries in SDPA] takes them: repeated in fp32 and under a
// window's mask, as they are under bf16 autocast without one (near fp32:
// bf16's resolution).
TEST_F(CudaTest, ModelForwardBackwardMatchesTheCpu) {
  struct Case {
    std::string preset;
    int64_t kv_heads;
    bool bf16;
    int64_t window;
  };
  const at::ScalarType autocast_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  for (const Case& k : {Case{"tiny", 0, false, 0}, Case{"llama-tiny", 0, false, 0}, Case{"llama-tiny", 2, false, 0},
                        Case{"llama-tiny", 2, true, 0}, Case{"llama-tiny", 2, true, 16}}) {
    const std::string what = k.preset + (k.kv_heads ? " grouped" : "") + (k.bf16 ? " bf16" : "") +
                             (k.window ? " window " + std::to_string(k.window) : "");
    model::GptConfig c = model::GptConfig::preset(k.preset);
    c.context = 64;
    c.dropout = 0;
    c.kv_heads = k.kv_heads;
    c.sliding_window = k.window;
    model::Gpt cpu(c, 7), gpu(c, 7);
    gpu->to(at::Device(at::kCUDA, 0));
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor tokens = at::randint(c.vocab_size, {4, c.context + 1}, g, at::kLong);
    const at::Tensor x = tokens.narrow(1, 0, c.context).contiguous(), y = tokens.narrow(1, 1, c.context).contiguous();
    const at::Tensor want = cpu->loss(x, y);
    at::autocast::set_autocast_enabled(at::kCUDA, k.bf16);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    const at::Tensor got = gpu->loss(x.cuda(), y.cuda());
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::set_autocast_dtype(at::kCUDA, autocast_dtype);
    want.backward();
    got.backward();
    EXPECT_TRUE(got.is_cuda());
    const double loss_tolerance = k.bf16 ? 2e-2 : 1e-5, grad_tolerance = k.bf16 ? 5e-2 : 1e-4;
    EXPECT_NEAR(got.item<double>(), want.item<double>(), loss_tolerance * want.item<double>()) << what;
    auto cpu_params = cpu->named_parameters();
    for (const auto& item : gpu->named_parameters()) {
      const at::Tensor& expected = cpu_params[item.key()].grad();
      EXPECT_LE(relative_error(item.value().grad().cpu(), expected), grad_tolerance) << what << " gradient of " << item.key();
    }
  }
}

// Note [Chunked loss] on a GPU: a vocabulary of 259 entries is padded to 320
// rows of W there, not on the CPU; the loss and both gradients agree in fp32,
// with and without a soft-cap, gradients made in the forward or the backward,
// over uneven chunks; under bf16 autocast they stay near fp32's.
TEST_F(CudaTest, ChunkedLossWithAPaddedVocabularyMatchesTheCpu) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor h0 = at::randn({2, 45, 32}, g, at::kFloat), w0 = at::randn({259, 32}, g, at::kFloat) * 0.5;
  at::Tensor targets = at::randint(0, 259, {2, 45}, g, at::kLong);
  targets.narrow(1, 0, 3).fill_(model::kIgnoredTarget);
  const at::Device gpu(at::kCUDA, 0);
  for (model::LossGradients when : {model::LossGradients::kInForward, model::LossGradients::kInBackward}) {
    for (double cap : {0.0, 8.0}) {
      SCOPED_TRACE("cap " + std::to_string(cap) + (when == model::LossGradients::kInForward ? ", in the forward" : ""));
      auto run = [&](const at::Device& device, bool bf16, at::Tensor& dh, at::Tensor& dw) {
        // Leaves of their own on each device (h0.to(kCPU) would be h0 itself).
        const at::Tensor h = h0.to(device).detach().requires_grad_(true), w = w0.to(device).detach().requires_grad_(true);
        at::Tensor loss;
        {
          at::autocast::set_autocast_enabled(at::kCUDA, bf16);
          at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
          loss = model::chunked_cross_entropy(h, w, targets.to(device), cap, 17, {}, when);
          at::autocast::set_autocast_enabled(at::kCUDA, false);
        }
        loss.backward();
        dh = h.grad().cpu();
        dw = w.grad().cpu();
        return loss.item<double>();
      };
      at::Tensor dh_cpu, dw_cpu, dh_gpu, dw_gpu, dh_bf16, dw_bf16;
      const double want = run(at::Device(at::kCPU), false, dh_cpu, dw_cpu);
      const double got = run(gpu, false, dh_gpu, dw_gpu), bf16 = run(gpu, true, dh_bf16, dw_bf16);
      EXPECT_NEAR(got, want, 1e-5 * want);
      EXPECT_LE(relative_error(dh_gpu, dh_cpu), 1e-4);
      EXPECT_LE(relative_error(dw_gpu, dw_cpu), 1e-4);
      EXPECT_EQ(dw_gpu.sizes(), w0.sizes()) << "W's gradient without the padded rows";
      EXPECT_NEAR(bf16, want, 0.02 * want);
      EXPECT_LE(relative_error(dh_bf16, dh_cpu), 0.05);
      EXPECT_LE(relative_error(dw_bf16, dw_cpu), 0.05);
      EXPECT_GT(std::abs(bf16 - got), 0.0) << "autocast was not on";
    }
  }
}

// Each operator with a fused GPU kernel (Note [Fused CUDA kernels]) on cuda:0
// against the same operator's CPU kernel: forward and every input's gradient,
// fp32 and bf16; and the chunked loss's cross-entropy rows through the kernel
// (model.fused) against its ATen composition. The kernels' arithmetic is checked on every machine by
// the CPU emulation (tests/model/fused_cuda_kernels_test.cpp); this runs them.
TEST_F(CudaTest, FusedKernelsMatchTheCpu) {
  if (model::fused::kernel::gpu_table() == nullptr) GTEST_SKIP() << "built without the fused CUDA kernels";
  using Op = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
  const at::Device gpu(at::kCUDA, 0);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randn({6, 300}, g, at::kFloat), r = at::randn({6, 300}, g, at::kFloat);
  const at::Tensor w = at::randn({300}, g, at::kFloat), b = at::randn({300}, g, at::kFloat);
  auto check = [&](const std::string& what, const Op& op, const std::vector<at::Tensor>& values, at::ScalarType dtype) {
    SCOPED_TRACE(what + (dtype == at::kBFloat16 ? " bf16" : " fp32"));
    std::vector<at::Tensor> on_cpu, on_gpu;
    for (const at::Tensor& v : values) {
      const at::ScalarType type = v.dim() == 1 ? at::kFloat : dtype;  // weights and biases stay fp32
      on_cpu.push_back(v.to(type).detach().requires_grad_(true));
      on_gpu.push_back(v.to(type).to(gpu).detach().requires_grad_(true));
    }
    const at::Tensor want = op(on_cpu), got = op(on_gpu);
    const at::Tensor upstream = at::randn(want.sizes(), g, at::kFloat);
    (want.to(at::kFloat) * upstream).sum().backward();
    (got.to(at::kFloat) * upstream.to(gpu)).sum().backward();
    const double tolerance = dtype == at::kBFloat16 ? 1e-2 : 1e-5;
    EXPECT_LE(relative_error(got.cpu().to(at::kFloat), want.to(at::kFloat)), tolerance) << "forward";
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(on_gpu[i].grad().defined(), on_cpu[i].grad().defined()) << "input " << i;
      if (!on_cpu[i].grad().defined()) continue;  // RMSNorm's unused bias
      EXPECT_LE(relative_error(on_gpu[i].grad().cpu().to(at::kFloat), on_cpu[i].grad().to(at::kFloat)), tolerance)
          << "input " << i << "'s gradient";
    }
  };
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool rms : {false, true}) {
      check(rms ? "add + RMSNorm" : "add + LayerNorm",
            [rms](const std::vector<at::Tensor>& v) {
              const auto [h, y] = model::fused::add_norm(v[0], v[1], v[2], rms ? at::Tensor() : v[3], rms, 1e-5);
              return h * 0.5 + y.to(h.scalar_type());
            },
            {x, r, w, b}, dtype);
    }
    check("bias + GELU", [](const std::vector<at::Tensor>& v) { return model::fused::bias_gelu(v[0], v[1]); }, {x, b}, dtype);
    check("SwiGLU", [](const std::vector<at::Tensor>& v) { return model::fused::swiglu(v[0], v[1]); }, {x, r}, dtype);
    check("GeGLU", [](const std::vector<at::Tensor>& v) { return model::fused::geglu(v[0], v[1]); }, {x, r}, dtype);
  }
  // The chunked loss's chunks through the kernel on the GPU, against its composition there: a
  // vocabulary of 256 (a multiple of 64, so not padded: the chunks' logits are whole rows), one
  // target ignored.
  const at::Tensor h0 = at::randn({40, 32}, g, at::kFloat), w0 = at::randn({256, 32}, g, at::kFloat) * 0.5;
  at::Tensor t0 = at::randint(0, 256, {40}, g, at::kLong);
  t0[3] = model::kIgnoredTarget;
  std::vector<at::Tensor> grads[2];
  double losses[2];
  for (const bool fused : {false, true}) {
    const at::Tensor h = h0.to(gpu).detach().requires_grad_(true), wh = w0.to(gpu).detach().requires_grad_(true);
    static int kernel_rows = 0;
    kernel_rows = 0;
    const at::CallbackHandle counting = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::string_view(fn.name()) == "meshtrain::cross_entropy_rows") ++kernel_rows;
          return nullptr;
        }));
    const at::Tensor loss = model::chunked_cross_entropy(h, wh, t0.to(gpu), 0, 17, {}, model::LossGradients::kInForward,
                                                         0, fused);
    at::removeCallback(counting);
    EXPECT_EQ(kernel_rows > 0, fused) << "the kernel's rows where model.fused";
    loss.backward();
    losses[fused] = loss.item<double>();
    grads[fused] = {h.grad().cpu(), wh.grad().cpu()};
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * losses[0]);
  EXPECT_LE(relative_error(grads[1][0], grads[0][0]), 1e-5);
  EXPECT_LE(relative_error(grads[1][1], grads[0][1]), 1e-5);
}

TEST_F(CudaTest, OneRankTrainingTracksTheCpu) {
  if (world()->size() != 1) GTEST_SKIP() << "one rank";
  Trainer cpu(config(1, kBatch), alone());
  Trainer gpu(config(1, kBatch, "", on_gpu({})), alone());
  EXPECT_TRUE(gpu.device().is_cuda());
  EXPECT_TRUE(gpu.model()->parameters().front().is_cuda());
  for (int s = 0; s < 6; ++s) {
    const StepResult want = cpu.step(), got = gpu.step();
    EXPECT_NEAR(got.loss, want.loss, 1e-4 * want.loss) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-3 * want.grad_norm) << "step " << s + 1;
  }
  const auto [relative, largest] = parameter_errors(gpu.full_parameters(), cpu.full_parameters());
  EXPECT_LE(relative, 1e-3);
  EXPECT_LE(largest, 1e-3);
}

TEST_F(CudaTest, Bfloat16AutocastTracksFloat32) {
  if (world()->size() != 1) GTEST_SKIP() << "one rank";
  Trainer fp32(config(1, kBatch, "", on_gpu({})), alone());
  Trainer bf16(config(1, kBatch, "", on_gpu({"training.dtype=bfloat16"})), alone());
  double largest = 0;
  for (int s = 0; s < 6; ++s) {
    const StepResult want = fp32.step(), got = bf16.step();
    const double relative = std::abs(got.loss - want.loss) / want.loss;
    largest = std::max(largest, relative);
    EXPECT_LE(relative, 0.02) << "step " << s + 1 << ": " << got.loss << " vs " << want.loss;
  }
  EXPECT_GT(largest, 0.0) << "the bfloat16 run computed exactly what float32 did: autocast was not on";
  // Parameters stay float32 (autocast changes the matmuls only).
  EXPECT_EQ(bf16.model()->parameters().front().scalar_type(), at::kFloat);
}

TEST_F(CudaTest, PeakMemoryWithinTenPercentOfThePlanner) {
  if (world()->size() != 1) GTEST_SKIP() << "one rank";
  const at::Device device(at::kCUDA, 0);
  // cuBLAS keeps a workspace per thread and stream (forward, and backward on
  // autograd's device thread): make both before the baseline.
  {
    at::Tensor w = torch::randn({256, 256}, at::TensorOptions().device(device).requires_grad(true));
    at::mm(w, w).sum().backward();
  }
  for (const Overrides& layout : {Overrides{}, Overrides{"parallel.activation_checkpoint=full"}}) {
    TrainConfig c = config(1, 8, "", on_gpu(layout));
    c.model.width = 512;
    c.model.heads = 8;
    c.model.layers = 4;
    c.model.context = 512;
    c.batch = 8;
    c.validate(1);
    torch::cuda::synchronize();
    const int64_t before = memory::device_stats(device).current;
    double measured = 0;
    {
      Trainer trainer(c, alone());
      for (int s = 0; s < 3; ++s) trainer.step();  // the first allocates gradients and optimizer states
      measured = static_cast<double>(memory::device_stats(device).peak - before);
    }
    const plan::PlannedRun run = plan::planned_run(c);
    const plan::RankMemory predicted = plan::estimate_memory(run.model, run.workload, run.layout, run.microbatches)[0];
    const double error = (predicted.memory.total() - measured) / measured;
    std::printf("  %-40s measured %8.1f MiB, predicted %8.1f MiB (states %7.1f, activations %7.1f): %+5.1f%%\n",
                describe(layout).c_str(), measured / 1048576, predicted.memory.total() / 1048576,
                predicted.memory.model_states() / 1048576, predicted.memory.activations / 1048576, 100 * error);
    EXPECT_LE(std::abs(error), 0.10) << describe(layout);
  }
}

TEST_F(CudaTest, NcclCommunicatorRunsEveryCollectiveOnOneRank) {
  if (world()->size() != 1) GTEST_SKIP() << "NCCL refuses two ranks on one GPU; one rank, every op through NCCL";
  if (!comm::nccl_compiled()) GTEST_SKIP() << "this build has no NCCL backend";
  comm::CommOptions options = world()->options();
  options.one_rank_through_backend = true;
  auto nccl = comm::make_nccl_communicator(world()->split(0, 0, "nccl-host", options), at::Device(at::kCUDA, 0));
  EXPECT_STREQ(nccl->backend_name(), "nccl");
  const at::TensorOptions on_gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor values = at::arange(12, on_gpu.dtype(at::kFloat)).view({4, 3});
  for (comm::ReduceOp op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg, comm::ReduceOp::kMax, comm::ReduceOp::kMin}) {
    at::Tensor t = values.clone();
    nccl->all_reduce(t, op).wait();
    EXPECT_TRUE(t.equal(values)) << comm::reduce_name(op);
  }
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kDouble, at::kInt, at::kLong}) {
    at::Tensor t = values.to(dtype);
    nccl->all_reduce(t).wait();
    EXPECT_TRUE(t.equal(values.to(dtype))) << comm::dtype_name(dtype);
  }
  at::Tensor scattered = at::empty({4, 3}, on_gpu);
  nccl->reduce_scatter(scattered, values).wait();
  EXPECT_TRUE(scattered.equal(values));
  nccl->reduce_scatter(scattered, values, comm::ReduceOp::kSum, {4}).wait();
  EXPECT_TRUE(scattered.equal(values));
  at::Tensor gathered = at::empty({4, 3}, on_gpu);
  nccl->all_gather(gathered, values).wait();
  EXPECT_TRUE(gathered.equal(values));
  nccl->all_gather(gathered, values, {4}).wait();
  EXPECT_TRUE(gathered.equal(values));
  at::Tensor broadcast = values.clone();
  nccl->broadcast(broadcast, 0).wait();
  EXPECT_TRUE(broadcast.equal(values));
  at::Tensor exchanged = at::empty({4, 3}, on_gpu);
  nccl->all_to_all(exchanged, values).wait();
  EXPECT_TRUE(exchanged.equal(values));
  nccl->all_to_all(exchanged, values, {4}, {4}).wait();
  EXPECT_TRUE(exchanged.equal(values));
  nccl->barrier().wait();
  auto child = nccl->split(0, 0, "nccl-child");
  ASSERT_TRUE(child);
  EXPECT_STREQ(child->backend_name(), "nccl");
  at::Tensor t = values.clone();
  child->all_reduce(t).wait();
  torch::cuda::synchronize();
  EXPECT_TRUE(t.equal(values));
  EXPECT_EQ(nccl->stats()[comm::OpKind::kAllReduce].calls, 9);
  // A CPU tensor is refused, naming the device.
  at::Tensor on_cpu = at::zeros({2});
  try {
    nccl->all_reduce(on_cpu);
    ADD_FAILURE() << "a CPU tensor was accepted by the NCCL backend";
  } catch (const comm::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("cpu"), std::string::npos) << e.what();
  }
}

TEST_F(CudaTest, FullyShardedReleasesCudaStorageBetweenSteps) {
  const int n = world()->size();
  Trainer sharded(config(n, kBatch / n, "", on_gpu({"parallel.zero_stage=3"})), world());
  expect_same_training(sharded, one_process(config(1, kBatch, "", on_gpu({})), 3), 3, "ZeRO-3 on CUDA");
  // Outside forward and backward, a block's gathered parameters hold no memory.
  int released = 0, held = 0;
  for (const auto& item : sharded.model()->named_parameters()) {
    if (item.key().rfind("blocks.", 0) != 0) continue;
    (item.value().storage().data() == nullptr ? released : held) += 1;
  }
  EXPECT_GT(released, 0) << held << " block parameters still hold their storage";
}

// Note [Random streams] on a GPU: a per-rank stream reseeded for a CUDA run
// holds a CUDA generator's state (not a CPU one), which loads into the CUDA
// generator, and a checkpoint's copies restore the draws exactly.
TEST_F(CudaTest, RandomStreamsReseedAndRestoreCudaGenerators) {
  if (world()->size() != 1) GTEST_SKIP() << "one rank";
  const at::Device device(at::kCUDA, 0);
  at::Tensor own;
  parallel::RandomStream stream{[&] { return own.clone(); }, [&](const at::Tensor& s) { own = s.clone(); }};
  parallel::RandomStreams streams(device, {{"tensor_parallel", stream, 1}});
  streams.reseed(1337, 2);
  at::Generator cuda = at::globalContext().defaultGenerator(device);
  const at::Tensor saved = cuda.get_state();
  EXPECT_EQ(own.numel(), saved.numel()) << "the per-rank stream holds another device's state";
  EXPECT_NO_THROW(cuda.set_state(own));
  cuda.set_state(saved);
  placement::TrainingState state;
  streams.add_state(state, mesh::MeshLayout::from_degrees({{"dp", 1}}, 1));
  ASSERT_EQ(state.size(), 3u);  // rng/cpu, rng/cuda, rng/tensor_parallel
  EXPECT_EQ(state[1].name, "rng/cuda");
  const at::Tensor first = at::rand({8}, at::TensorOptions().device(device));
  streams.restore();
  EXPECT_TRUE(at::equal(at::rand({8}, at::TensorOptions().device(device)), first));
}

TEST_F(CudaTest, CheckpointingReplaysCudaRandomStreams) {
  const int n = world()->size();
  Overrides base = {"model.dropout=0.1"};
  if (n == 2) base = {"model.dropout=0.1", "parallel.tp=2", "parallel.sequence_parallel=true"};
  const int64_t micro = n == 2 ? kBatch : kBatch / n;
  for (const std::string mode : {"full", "selective"}) {
    Overrides with = base;
    with.push_back("parallel.activation_checkpoint=" + mode);
    Trainer plain(config(n, micro, "", on_gpu(base)), world());
    Trainer checkpointed(config(n, micro, "", on_gpu(with)), world());
    for (int s = 0; s < 3; ++s) {
      seed_everything(100 + s);
      const StepResult a = plain.step();
      seed_everything(100 + s);
      const StepResult b = checkpointed.step();
      EXPECT_NEAR(a.loss, b.loss, 1e-6 * a.loss) << mode << " step " << s + 1;
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * a.grad_norm) << mode << " step " << s + 1;
    }
  }
}

TEST_F(CudaTest, TwoRanksOnOneGpuEqualOneProcess) {
  if (world()->size() != 2) GTEST_SKIP() << "two ranks sharing the GPU";
  const std::vector<std::pair<Overrides, int64_t>> layouts = {
      {{}, kBatch / 2},
      {{"parallel.zero_stage=3"}, kBatch / 2},
      {{"parallel.tp=2", "parallel.sequence_parallel=true"}, kBatch},
      {{"parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4"}, kBatch / 4},
  };
  const OneProcessRun single = one_process(config(1, kBatch, "", on_gpu({})), 3);
  for (const auto& [layout, micro] : layouts) {
    Trainer parallel(config(2, micro, "", on_gpu(layout)), world());
    EXPECT_NE(std::string(parallel.mesh().comm("dp")->backend_name()).find("host-staged"), std::string::npos)
        << "two ranks on one GPU should go through the host";
    expect_same_training(parallel, single, 3, describe(layout) + " on CUDA");
  }
}

TEST_F(CudaTest, ExpertParallelOnOneGpuEqualsOneProcess) {
  if (world()->size() != 2) GTEST_SKIP() << "two ranks sharing the GPU";
  // Mixture of experts with ep = 2 through the host-staged backend, against one
  // process on the GPU reading the same micro-batches (kBatch / 2 each).
  const Overrides moe = {"model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=1",
                         "model.moe_second_expert=always"};
  Overrides layout = moe;
  layout.push_back("parallel.ep=2");
  Trainer parallel(config(2, kBatch / 2, "", on_gpu(layout)), world());
  expect_same_training(parallel, one_process(config(1, kBatch / 2, "", on_gpu(moe)), 3), 3, "ep 2 on CUDA");
}

}  // namespace
}  // namespace meshtrain::train
