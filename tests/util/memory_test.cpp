// The counting CPU allocator: exact byte counts, per-phase peaks, the limit.
#include "meshtrain/util/memory.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <vector>

namespace meshtrain::memory {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(CountingAllocator, CountsEveryTensorExactly) {
  install();
  ASSERT_TRUE(installed());
  const int64_t before = current_bytes();
  {
    at::Tensor a = at::empty({kMiB / 4}, at::kFloat);
    EXPECT_EQ(current_bytes() - before, kMiB);
    at::Tensor b = at::empty({1000}, at::kBFloat16);
    EXPECT_EQ(current_bytes() - before, kMiB + 2000);
  }
  EXPECT_EQ(current_bytes(), before);
  // raw_allocate (oneDNN's way in) needs context == data: it works and is counted.
  void* raw = c10::GetCPUAllocator()->raw_allocate(4096);
  EXPECT_EQ(current_bytes() - before, 4096);
  c10::GetCPUAllocator()->raw_deallocate(raw);
  EXPECT_EQ(current_bytes(), before);
}

TEST(CountingAllocator, KeepsPeaksPerPhase) {
  install();
  reset_peaks();
  const int64_t base = current_bytes();
  {
    PhaseScope forward(Phase::kForward);
    at::Tensor big = at::zeros({2 * kMiB}, at::kByte);
    EXPECT_EQ(current_phase(), Phase::kForward);
    {
      PhaseScope backward(Phase::kBackward);
      at::Tensor small = at::zeros({kMiB / 2}, at::kByte);
    }
    EXPECT_EQ(current_phase(), Phase::kForward);
  }
  EXPECT_EQ(phase_peak_bytes(Phase::kForward), base + 2 * kMiB);
  EXPECT_EQ(phase_peak_bytes(Phase::kBackward), base + 2 * kMiB + kMiB / 2);
  EXPECT_EQ(phase_peak_bytes(Phase::kOptimizer), base);
  EXPECT_EQ(peak_bytes(), base + 2 * kMiB + kMiB / 2);
  EXPECT_STREQ(phase_name(Phase::kModelStates), "model_states");
}

TEST(CountingAllocator, LimitFailsTheAllocationWithAClearMessage) {
  install();
  set_rank(3);
  set_limit(current_bytes() + kMiB);
  at::Tensor fits = at::empty({kMiB / 2}, at::kByte);
  const int64_t before = current_bytes();
  std::string message;
  {
    PhaseScope phase(Phase::kBackward);
    try {
      at::Tensor too_big = at::empty({kMiB}, at::kByte);
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what();
    }
  }
  set_limit(0);
  EXPECT_EQ(current_bytes(), before) << "a refused allocation must not be counted";
  EXPECT_NE(message.find("out of memory on rank 3 during backward: allocating 1.0 MiB"), std::string::npos) << message;
  EXPECT_NE(message.find("memory.limit_mb"), std::string::npos) << message;
  at::Tensor now_fine = at::empty({4 * kMiB}, at::kByte);
}

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Note [Block cache]: the blocks of one micro-batch are reused by the next
// without the kernel mapping and zeroing their pages again. glibc alone faults
// most of these pages in every round (its heap keeps growing on this pattern).
TEST(CountingAllocator, ReusesFreedBlocksWithoutPageFaults) {
  install();
  if (std::getenv("MESHTRAIN_HOST_CACHE_MB") != nullptr) GTEST_SKIP() << "MESHTRAIN_HOST_CACHE_MB is set";
  const std::vector<int64_t> sizes = {12 * kMiB, 24 * kMiB, 6 * kMiB, 12 * kMiB, 24 * kMiB};
  const int64_t kept_before = cached_bytes();  // other tests' blocks
  auto micro_batch = [&] {
    std::vector<at::Tensor> blocks;
    for (int64_t size : sizes) blocks.push_back(at::empty({size}, at::kByte).fill_(1));
    EXPECT_EQ(cached_bytes(), kept_before);
  };
  micro_batch();
  const int64_t in_use = current_bytes();
  EXPECT_GE(cached_bytes() - kept_before, 78 * kMiB);  // kept, but not counted
  const long before = minor_faults();
  for (int round = 0; round < 3; ++round) micro_batch();
  const long pages = 3 * 78 * kMiB / 4096;
  EXPECT_LT(minor_faults() - before, pages / 20) << "of " << pages << " pages touched";
  EXPECT_EQ(current_bytes(), in_use);
}

}  // namespace
}  // namespace meshtrain::memory
