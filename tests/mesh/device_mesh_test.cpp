// DeviceMesh on real ranks: every 2-D and 3-D factorisation of the world size
// gives communicators whose groups match the layout arithmetic.
#include "meshtrain/mesh/device_mesh.h"
#include "tests/harness/mpi_env.h"

#include <gtest/gtest.h>

namespace meshtrain::mesh {
namespace {

using testing::world;

std::vector<std::vector<MeshAxis>> factorisations(int n) {
  std::vector<std::vector<MeshAxis>> result;
  for (int a = 1; a <= n; ++a) {
    if (n % a) continue;
    result.push_back({{"dp", a}, {"tp", n / a}});
    for (int b = 1; b <= n / a; ++b) {
      if ((n / a) % b) continue;
      result.push_back({{"pp", a}, {"fsdp", b}, {"tp", n / a / b}});
    }
  }
  return result;
}

int64_t sum_of(const std::vector<int>& ranks) {
  int64_t s = 0;
  for (int r : ranks) s += r;
  return s;
}

TEST(DeviceMesh, EveryFactorisationGroupsRanksAsTheLayoutSays) {
  const int n = world()->size();
  const int rank = world()->rank();
  for (const auto& axes : factorisations(n)) {
    DeviceMesh device_mesh(world(), MeshLayout(axes, n));
    const MeshLayout& layout = device_mesh.layout();
    SCOPED_TRACE(device_mesh.describe());
    std::vector<std::vector<std::string>> groups;
    for (const MeshAxis& a : axes) groups.push_back({a.name});
    groups.push_back({axes.front().name, axes.back().name});
    for (const auto& group : groups) {
      const auto& comm = device_mesh.comm(group);
      const std::vector<int> expected = layout.group_ranks(rank, group);
      ASSERT_EQ(comm->size(), static_cast<int>(expected.size()));
      EXPECT_EQ(comm->rank(), layout.rank_in_group(rank, group));
      at::Tensor gathered = at::empty({comm->size()}, at::kInt);
      comm->all_gather(gathered, at::full({1}, rank, at::kInt)).wait();
      for (int i = 0; i < comm->size(); ++i) EXPECT_EQ(gathered[i].item<int>(), expected[i]);
      at::Tensor total = at::full({1}, rank, at::kLong);
      comm->all_reduce(total).wait();
      EXPECT_EQ(total.item<int64_t>(), sum_of(expected));
    }
  }
}

TEST(DeviceMesh, SizeOneAxesShareCommunicators) {
  const int n = world()->size();
  DeviceMesh device_mesh(world(), MeshLayout::from_degrees({{"dp", n}}, n));
  EXPECT_EQ(device_mesh.comm("dp")->size(), n);
  EXPECT_EQ(device_mesh.comm({"pp", "dp", "tp"}), device_mesh.comm("dp"));
  EXPECT_EQ(device_mesh.comm("tp")->size(), 1);
  EXPECT_EQ(device_mesh.comm("tp")->name(), "mesh:self");
  at::Tensor x = at::ones({2});
  device_mesh.comm("tp")->all_reduce(x).wait();
  EXPECT_EQ(x[0].item<float>(), 1.0f);
}

TEST(DeviceMesh, RejectsALayoutOfAnotherWorldSize) {
  const int n = world()->size();
  try {
    DeviceMesh device_mesh(world(), MeshLayout({{"dp", n + 1}}, n + 1));
    FAIL() << "accepted a mesh of " << n + 1 << " ranks on " << n;
  } catch (const MeshError& e) {
    EXPECT_NE(std::string(e.what()).find("dp(" + std::to_string(n + 1) + ") = " + std::to_string(n + 1) +
                                         " != world size " + std::to_string(n)),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::mesh
