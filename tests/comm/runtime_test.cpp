// The runtime's view of this process: rank, local rank (torchrun's LOCAL_RANK
// wins), and the default device.
#include "meshtrain/comm/runtime.h"
#include "tests/harness/mpi_env.h"

#include <torch/cuda.h>

#include <gtest/gtest.h>

#include <cstdlib>

namespace meshtrain::comm {
namespace {

using testing::runtime;

TEST(Runtime, LocalRankHonoursLocalRankElseCountsRanksOnThisNode) {
  // The CTest entry that sets LOCAL_RANK also says what it expects, so the
  // test cannot pass by never seeing the variable.
  if (const char* expected = std::getenv("MESHTRAIN_TEST_EXPECT_LOCAL_RANK")) {
    ASSERT_NE(std::getenv("LOCAL_RANK"), nullptr) << "LOCAL_RANK did not reach this rank";
    EXPECT_EQ(runtime().local_rank(), std::atoi(expected));
  }
  if (const char* env = std::getenv("LOCAL_RANK")) {
    EXPECT_EQ(runtime().local_rank(), std::atoi(env));
  } else {
    // Every rank of these tests runs on this one machine.
    EXPECT_EQ(runtime().local_rank(), runtime().rank());
  }
  EXPECT_EQ(runtime().local_size(), runtime().size());
  EXPECT_EQ(runtime().world()->name(), "world");
  EXPECT_EQ(std::string(runtime().world()->backend_name()), "mpi");
}

TEST(Runtime, DefaultDeviceFollowsTheLocalRank) {
  const size_t devices = torch::cuda::device_count();
  const at::Device device = runtime().default_device();
  if (devices == 0) {
    EXPECT_TRUE(device.is_cpu());
  } else {
    EXPECT_EQ(device, at::Device(at::kCUDA, runtime().local_rank() % static_cast<int>(devices)));
  }
}

}  // namespace
}  // namespace meshtrain::comm
