// Rank <-> coordinate arithmetic without processes, 1-D to 5-D.
#include "meshtrain/mesh/mesh_layout.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>

namespace meshtrain::mesh {
namespace {

TEST(MeshLayout, OneDimension) {
  MeshLayout layout({{"dp", 4}}, 4);
  EXPECT_EQ(layout.coordinate(3), std::vector<int>({3}));
  EXPECT_EQ(layout.group_ranks(2, {"dp"}), std::vector<int>({0, 1, 2, 3}));
  EXPECT_EQ(layout.rank_in_group(2, {"dp"}), 2);
  EXPECT_EQ(layout.group_index(2, {"dp"}), 0);
}

TEST(MeshLayout, TwoDimensionsTensorParallelInnermost) {
  MeshLayout layout({{"dp", 2}, {"tp", 4}}, 8);
  EXPECT_EQ(layout.coordinate(5), std::vector<int>({1, 1}));
  EXPECT_EQ(layout.rank_of({1, 3}), 7);
  EXPECT_EQ(layout.group_ranks(5, {"tp"}), std::vector<int>({4, 5, 6, 7}));
  EXPECT_EQ(layout.group_ranks(5, {"dp"}), std::vector<int>({1, 5}));
  EXPECT_EQ(layout.rank_in_group(5, {"dp"}), 1);
  EXPECT_EQ(layout.group_index(5, {"dp"}), 1);
  EXPECT_EQ(layout.all_groups({"tp"}), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.all_groups({"dp"}), (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(MeshLayout, ThreeDimensionsAndGroupsOfSeveralAxes) {
  MeshLayout layout({{"pp", 2}, {"dp", 2}, {"tp", 2}}, 8);
  EXPECT_EQ(layout.coordinate(6), std::vector<int>({1, 1, 0}));
  EXPECT_EQ(layout.group_ranks(6, {"dp"}), std::vector<int>({4, 6}));
  EXPECT_EQ(layout.group_ranks(6, {"pp", "tp"}), std::vector<int>({2, 3, 6, 7}));
  // Order of the names does not matter: groups follow mesh order.
  EXPECT_EQ(layout.group_ranks(6, {"tp", "pp"}), std::vector<int>({2, 3, 6, 7}));
  EXPECT_EQ(layout.rank_in_group(7, {"pp", "tp"}), 3);
  EXPECT_EQ(layout.group_index(7, {"pp", "tp"}), 1);
  EXPECT_EQ(layout.describe(), "pp(2) * dp(2) * tp(2)");
}

// torchtitan's test uses world_size = 48 as a plain argument; so do we, in 4-D and 5-D.
TEST(MeshLayout, FourAndFiveDimensionsPartitionTheWorld) {
  for (const auto& axes : std::vector<std::vector<MeshAxis>>{
           {{"pp", 2}, {"dp", 3}, {"ep", 2}, {"tp", 4}},
           {{"pp", 2}, {"dp", 2}, {"fsdp", 3}, {"ep", 2}, {"tp", 2}}}) {
    MeshLayout layout(axes, 48);
    for (int r = 0; r < 48; ++r) EXPECT_EQ(layout.rank_of(layout.coordinate(r)), r);
    const int n = layout.ndim();
    for (unsigned mask = 1; mask < (1u << n); ++mask) {
      std::vector<std::string> chosen;
      int group_size = 1;
      for (int i = 0; i < n; ++i) {
        if (mask & (1u << i)) {
          chosen.push_back(axes[i].name);
          group_size *= axes[i].size;
        }
      }
      std::set<int> seen;
      const auto groups = layout.all_groups(chosen);
      EXPECT_EQ(static_cast<int>(groups.size()), 48 / group_size);
      for (size_t g = 0; g < groups.size(); ++g) {
        ASSERT_EQ(static_cast<int>(groups[g].size()), group_size);
        for (size_t i = 0; i < groups[g].size(); ++i) {
          const int r = groups[g][i];
          EXPECT_TRUE(seen.insert(r).second) << "rank " << r << " in two groups";
          EXPECT_EQ(layout.group_index(r, chosen), static_cast<int>(g));
          EXPECT_EQ(layout.rank_in_group(r, chosen), static_cast<int>(i));
          // Members share every coordinate outside the chosen axes.
          for (int a = 0; a < n; ++a) {
            if (!(mask & (1u << a))) {
              EXPECT_EQ(layout.coordinate(r)[a], layout.coordinate(groups[g][0])[a]);
            }
          }
        }
      }
      EXPECT_EQ(seen.size(), 48u);
    }
  }
}

TEST(MeshLayout, FromDegreesUsesCanonicalOrder) {
  MeshLayout layout = MeshLayout::from_degrees({{"tp", 2}, {"pp", 2}}, 4);
  ASSERT_EQ(layout.ndim(), 6);
  EXPECT_EQ(layout.describe(), "pp(2) * dp(1) * fsdp(1) * ep(1) * cp(1) * tp(2)");
  EXPECT_EQ(layout.group_ranks(0, {"tp"}), std::vector<int>({0, 1}));
  EXPECT_NE(testing::error_of<MeshError>([] { MeshLayout::from_degrees({{"xp", 2}}, 2); }).find("unknown mesh axis 'xp'; known axes are pp, dp, fsdp, ep, cp, tp"),
            std::string::npos);
}

TEST(MeshLayout, InvalidShapesAreRejectedWithTheFormula) {
  EXPECT_EQ(testing::error_of<MeshError>([] { MeshLayout({{"pp", 2}, {"dp", 2}, {"tp", 4}}, 8); }),
            "pp(2) * dp(2) * tp(4) = 16 != world size 8; choose degrees whose product is the number of ranks");
  EXPECT_NE(testing::error_of<MeshError>([] { MeshLayout({{"dp", 2}, {"dp", 2}}, 4); }).find("'dp' appears twice"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([] { MeshLayout({{"dp", 0}}, 0); }).find("world size must be >= 1"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([] { MeshLayout({{"dp", 0}, {"tp", 2}}, 2); }).find("has size 0"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([] { MeshLayout({}, 1); }).find("at least one axis"), std::string::npos);
  MeshLayout layout({{"dp", 2}, {"tp", 2}}, 4);
  EXPECT_NE(testing::error_of<MeshError>([&] { layout.axis_index("pp"); }).find("has no axis 'pp' (axes: dp, tp)"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([&] { layout.coordinate(4); }).find("rank 4 is outside"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([&] { layout.rank_of({0, 2}); }).find("outside axis 'tp'"), std::string::npos);
  EXPECT_NE(testing::error_of<MeshError>([&] { layout.group_ranks(0, {"dp", "dp"}); }).find("named twice"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::mesh
