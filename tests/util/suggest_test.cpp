// "Did you mean": slips are found, strangers are not.
#include "meshtrain/util/suggest.h"

#include <gtest/gtest.h>

namespace meshtrain::util {
namespace {

TEST(Suggest, EditDistanceCountsASwapAsOneEdit) {
  EXPECT_EQ(edit_distance("train", "train"), 0);
  EXPECT_EQ(edit_distance("trian", "train"), 1);  // two neighbours swapped
  EXPECT_EQ(edit_distance("stepz", "steps"), 1);
  EXPECT_EQ(edit_distance("", "abc"), 3);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3);
}

TEST(Suggest, NearestIsASlipOrAUniquePrefix) {
  const std::vector<std::string> commands = {"train", "prepare", "generate", "serve", "plan", "run"};
  EXPECT_EQ(nearest("trian", commands), "train");
  EXPECT_EQ(nearest("genrate", commands), "generate");
  EXPECT_EQ(nearest("serv", commands), "serve");
  EXPECT_EQ(nearest("gen", commands), "generate");   // a prefix of one command
  EXPECT_EQ(nearest("p", commands), "");             // a prefix of two
  EXPECT_EQ(nearest("checkpoint", commands), "");    // nothing near
  EXPECT_EQ(did_you_mean("trian", commands), " (did you mean train?)");
  EXPECT_EQ(did_you_mean("zzz", commands), "");
}

}  // namespace
}  // namespace meshtrain::util
