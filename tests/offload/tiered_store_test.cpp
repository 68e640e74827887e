// The tiered store (host and NVMe tiers, asynchronous bounded transfers) and
// the fused CPU AdamW against torch::optim::AdamW.
#include "meshtrain/offload/cpu_adam.h"
#include "meshtrain/offload/host_memory.h"
#include "meshtrain/offload/tiered_store.h"
#include "meshtrain/util/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace meshtrain::offload {
namespace {

std::string temp_dir() {
  const auto dir = std::filesystem::temp_directory_path() / ("meshtrain-tier-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(HostTier, TensorsAreAlignedAndCountedOutsideTheDeviceTier) {
  memory::install();
  const int64_t device_before = memory::current_bytes();
  const int64_t host_before = tier_stats(Tier::kHost).current;
  {
    at::Tensor t = host_tensor(1000, at::kFloat);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % kIoAlignment, 0u);
    EXPECT_EQ(t.sum().item<float>(), 0.0f);
    EXPECT_EQ(tier_stats(Tier::kHost).current - host_before, round_up(4000));
    EXPECT_EQ(memory::current_bytes(), device_before);
  }
  EXPECT_EQ(tier_stats(Tier::kHost).current, host_before);
}

class TieredStoreTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TieredStoreTest, RoundTripsThroughEveryTierAndEngine) {
  StoreOptions options;
  options.nvme_dir = temp_dir();
  options.nvme.engine = GetParam();
  options.nvme.chunk_bytes = 64 << 10;  // several chunks in flight for the larger tensors
  std::string file;
  {
    TieredStore store(options);
    std::vector<at::Tensor> values;
    std::vector<TieredStore::Id> ids;
    for (int64_t n : {1, 7, 1024, 300001}) {
      for (Tier tier : {Tier::kHost, Tier::kNvme}) {
        values.push_back(torch::randn({n}));
        ids.push_back(store.put(values.back(), tier));
      }
    }
    ids.push_back(store.put(torch::randn({33, 5}).to(at::kBFloat16), Tier::kNvme));
    values.push_back(at::Tensor());
    file = store.nvme()->path();
    EXPECT_TRUE(std::filesystem::exists(file));
    EXPECT_GE(tier_stats(Tier::kNvme).current, round_up(4 * 300001) + round_up(4 * 1024));
    // Asynchronous fetches of everything (more than max_in_flight: submit waits), then compare.
    std::vector<at::Tensor> out;
    std::vector<Ticket> tickets;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      out.push_back(at::empty_like(values[i]));
      tickets.push_back(store.fetch(ids[i], out.back()));
    }
    for (size_t i = 0; i < tickets.size(); ++i) {
      tickets[i].wait();
      EXPECT_TRUE(at::equal(out[i], values[i])) << "slot " << i;
    }
    // Store new values, read them back.
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      values[i] = values[i] * 2 + 1;
      store.write(ids[i], values[i]);
      at::Tensor back = at::empty_like(values[i]);
      store.read(ids[i], back);
      EXPECT_TRUE(at::equal(back, values[i])) << "slot " << i;
    }
    // Ranges of an NVMe slot through a host buffer.
    const TieredStore::Id big = ids[7];
    at::Tensor host = host_tensor(2048, at::kFloat);
    store.read_range(big, 1024, 2048, host);
    EXPECT_TRUE(at::equal(host.narrow(0, 0, 2048), values[7].narrow(0, 1024, 2048)));
    host.fill_(3.0f);
    store.write_range(big, 1024, 2048, host);
    at::Tensor back = at::empty_like(values[7]);
    store.read(big, back);
    values[7].narrow(0, 1024, 2048).fill_(3.0f);
    EXPECT_TRUE(at::equal(back, values[7]));
  }
  EXPECT_FALSE(std::filesystem::exists(file)) << "the NVMe tier's file is removed with the store";
  std::filesystem::remove_all(options.nvme_dir);
}

INSTANTIATE_TEST_SUITE_P(Engines, TieredStoreTest, ::testing::Values("io_uring", "pread"));

TEST(TieredStore, TransfersAreBoundedAndErrorsReachTheTicket) {
  StoreOptions options;
  options.max_in_flight = 1;
  TieredStore store(options);
  const TieredStore::Id id = store.put(torch::arange(10, at::kFloat), Tier::kHost);
  at::Tensor wrong = at::empty({11});
  EXPECT_THROW(store.fetch(id, wrong), c10::Error);
  at::Tensor a = at::empty({10}), b = at::empty({10});
  Ticket first = store.fetch(id, a);
  Ticket second = store.fetch(id, b);  // waits for the first to leave the queue
  second.wait();
  EXPECT_TRUE(first.done());
  EXPECT_TRUE(at::equal(a, b));
  StoreOptions missing;
  missing.nvme_dir = "/nonexistent-meshtrain-dir";
  TieredStore bad(missing);
  try {
    bad.put(torch::ones({4}), Tier::kNvme);
    FAIL() << "an NVMe slot in a missing folder must fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("offload.nvme_dir"), std::string::npos) << e.what();
  }
}

// Several steps of the fused kernel equal torch::optim::AdamW's on the same
// values, with and without weight decay, on sizes around the vector width.
TEST(CpuAdamW, EqualsTorchAdamWOverSeveralSteps) {
  for (int64_t n : {1, 15, 16, 17, 100003}) {
    for (double decay : {0.0, 0.1}) {
      torch::manual_seed(n);
      at::Tensor reference = torch::randn({n}).set_requires_grad(true);
      at::Tensor p = reference.detach().clone(), m = at::zeros({n}), v = at::zeros({n});
      at::Tensor bf16 = at::empty({n}, at::kBFloat16);
      torch::optim::AdamW adamw({reference},
                                torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(decay));
      for (int64_t step = 1; step <= 5; ++step) {
        const at::Tensor g = torch::randn({n});
        reference.mutable_grad() = g.clone();
        adamw.step();
        cpu_adamw(p, g, m, v, {3e-3, 0.9, 0.95, 1e-8, decay, step}, bf16);
      }
      EXPECT_TRUE(at::allclose(p, reference.detach(), 1e-6, 1e-7))
          << "n " << n << " decay " << decay << " max diff " << (p - reference.detach()).abs().max().item<float>();
      EXPECT_TRUE(at::equal(bf16, p.to(at::kBFloat16))) << "the bf16 copy is the rounded parameter";
    }
  }
}

TEST(CpuAdamW, RefusesTensorsOfAnotherKind) {
  at::Tensor p = at::zeros({8});
  EXPECT_THROW(cpu_adamw(p, at::zeros({8}, at::kDouble), at::zeros({8}), at::zeros({8}), {}), c10::Error);
  EXPECT_THROW(cpu_adamw(p, at::zeros({7}), at::zeros({8}), at::zeros({8}), {}), c10::Error);
}

}  // namespace
}  // namespace meshtrain::offload
