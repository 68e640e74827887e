// The hosts `meshtrain run` is given, and the probe that finds which of them
// still start processes after a failure, with a stand-in for mpirun.
#include "meshtrain/apps/launch_hosts.h"
#include "meshtrain/util/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

namespace meshtrain::apps {
namespace {

// A folder for the test's files under the working directory (the build tree,
// where a stand-in program may be run even if /tmp is mounted noexec).
std::string temp_dir() {
  std::string name = std::filesystem::current_path().string() + "/launch-hosts-XXXXXX";
  if (!mkdtemp(name.data())) throw std::runtime_error("mkdtemp failed in " + std::filesystem::current_path().string());
  return name;
}

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

TEST(LaunchHosts, ListsAndHostfilesAddUpEachHostsSlots) {
  const auto hosts = parse_hosts("", "a:2,b,a:1");
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[0].name, "a");
  EXPECT_EQ(hosts[0].slots, 3);
  EXPECT_EQ(hosts[1].slots, 1);  // no count: one slot, as for mpirun --host
  EXPECT_EQ(host_list(hosts), "a:3,b:1");
  for (const char* bad : {"a:0", "a:x", "a,,b", ":2"}) EXPECT_THROW(parse_hosts("", bad), std::invalid_argument) << bad;

  const std::string dir = temp_dir();
  const auto from_file = parse_hosts(write_file(dir + "/hosts", "# the cluster\nn1 slots=2\nn2   # cores\n\nn1 slots=1\n"), "");
  ASSERT_EQ(from_file.size(), 2u);
  EXPECT_EQ(from_file[0].slots, 3);
  EXPECT_EQ(from_file[1].slots, 0);  // mpirun counts its cores
  EXPECT_EQ(host_list(from_file), "n1:3,n2");
  EXPECT_THROW(parse_hosts(write_file(dir + "/empty", "# nothing\n"), ""), std::invalid_argument);
  EXPECT_THROW(parse_hosts(write_file(dir + "/bad", "n1 slots=two\n"), ""), std::invalid_argument);
  EXPECT_THROW(parse_hosts(dir + "/missing", ""), std::invalid_argument);
  util::remove_tree(dir);
}

TEST(LaunchHosts, ThisHostByNameShortNameOrInterfaceAddress) {
  char own[HOST_NAME_MAX + 1] = {};
  ASSERT_EQ(gethostname(own, sizeof own - 1), 0);
  const std::string name = own, first = name.substr(0, name.find('.'));
  EXPECT_TRUE(is_this_host("localhost"));
  EXPECT_TRUE(is_this_host(name));
  EXPECT_TRUE(is_this_host(first));
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_TRUE(is_this_host(upper));
  if (name == first) {
    EXPECT_TRUE(is_this_host(name + ".cluster.example"));  // the short name's full form
  }
  EXPECT_FALSE(is_this_host(first + "x"));
  EXPECT_FALSE(is_this_host("x" + first));
  EXPECT_TRUE(is_this_host("127.0.0.1"));   // the loopback interface's
  EXPECT_FALSE(is_this_host("192.0.2.1"));  // TEST-NET-1: on no interface
  EXPECT_FALSE(is_this_host("2001:db8::1"));
}

TEST(LaunchHosts, ProbeMessageIsMpirunsFramedLineElseTheLastOne) {
  const std::string dashes(40, '-');
  EXPECT_EQ(probe_message(""), "");
  EXPECT_EQ(probe_message("\n  \n"), "");
  EXPECT_EQ(probe_message("starting\nssh: connect to host n2 port 22: No route to host\n\n"),
            "ssh: connect to host n2 port 22: No route to host");
  EXPECT_EQ(probe_message("noise\n" + dashes + "\n\nA process or daemon was unable to complete a TCP connection\n"
                          "to another process:\n  Local host: n1\n" + dashes + "\ntrailer\n"),
            "A process or daemon was unable to complete a TCP connection");
  const std::string said = probe_message(std::string(500, 'x') + "\n");
  EXPECT_EQ(said.size(), 203u);
  EXPECT_EQ(said.substr(200), "...");
}

// A stand-in for `mpirun -np 1 --host NAME:1 true`: answers for "up", fails
// with mpirun's framed message for "refused", and hangs for "hung".
TEST(LaunchHosts, ProbeSaysWhyEachLostHostDidNotAnswer) {
  const std::string dir = temp_dir();
  const std::string mpirun = write_file(dir + "/mpirun", "#!/bin/sh\n"
                                        "case \"$4\" in\n"
                                        "  up:1) exit 0 ;;\n"
                                        "  refused:1) printf -- '--------------------------\\nNo route to host %s\\n"
                                        "--------------------------\\n' \"$4\" >&2; exit 3 ;;\n"
                                        "  hung:1) echo 'waiting for the daemon'; exec sleep 60 ;;\n"
                                        "esac\nexit 9\n");
  chmod(mpirun.c_str(), 0755);
  // The probes that end are waited for as long as a loaded machine needs (the
  // wait stops once every probe has ended); the hung one gets 2 s.
  const std::vector<HostSlots> hosts{{"localhost", 1}, {"up", 1}, {"refused", 1}};
  const auto answers = probe_hosts(hosts, mpirun, /*root=*/false, /*seconds=*/60);
  ASSERT_EQ(answers.size(), hosts.size());
  EXPECT_TRUE(answers[0].answered);  // the launcher's own host: not probed
  EXPECT_TRUE(answers[1].answered);
  EXPECT_FALSE(answers[2].answered);
  EXPECT_EQ(answers[2].why, "exited with status 3: No route to host refused:1");
  const auto hung = probe_hosts({{"hung", 1}}, mpirun, false, 2);
  EXPECT_FALSE(hung[0].answered);
  EXPECT_EQ(hung[0].why, "no answer within 2 s (last said: waiting for the daemon)");

  const auto missing = probe_hosts({{"up", 1}}, dir + "/no-such-mpirun", false, 5);
  EXPECT_FALSE(missing[0].answered);
  EXPECT_EQ(missing[0].why.rfind("exited with status 127 (the probe's command could not be run)", 0), 0u) << missing[0].why;
  util::remove_tree(dir);
}

}  // namespace
}  // namespace meshtrain::apps
