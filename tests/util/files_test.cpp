// Paths: the program a relaunch starts after its file was replaced.
#include "meshtrain/util/files.h"

#include <gtest/gtest.h>

namespace meshtrain::util {
namespace {

TEST(Files, ARelaunchStartsTheProgramNowAtTheReplacedPath) {
  EXPECT_EQ(executable_now_at("/opt/meshtrain/bin/meshtrain"), "/opt/meshtrain/bin/meshtrain");
  EXPECT_EQ(executable_now_at("/opt/meshtrain/bin/meshtrain (deleted)"), "/opt/meshtrain/bin/meshtrain");
  EXPECT_EQ(executable_now_at(" (deleted)"), " (deleted)");
  const std::string dir = make_temp_directory("meshtrain-files-");
  const std::string named = dir + "/odd (deleted)";  // a file really named so stays as it is
  write_text_file(named, "");
  EXPECT_EQ(executable_now_at(named), named);
  remove_tree(dir);
}

}  // namespace
}  // namespace meshtrain::util
