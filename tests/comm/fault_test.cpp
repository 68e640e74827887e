// A dead, hung or desynchronised rank ends the whole job with a clear message
// and a non-zero exit, within the timeout. Runs fault_helper under mpirun.
#include "tests/harness/test_env.h"

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

struct JobResult {
  int exit_status = -1;  // the shell's status of mpirun (128+signal if killed)
  std::string output;    // stdout and stderr of all ranks
  double seconds = 0;
};

// Open MPI refuses root and more ranks than cores unless told; these are the
// same settings CTest gives the multi-rank tests.
void allow_root_and_oversubscription() {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 0);
}

JobResult run_job(const std::string& scenario, const std::string& env) {
  allow_root_and_oversubscription();
  // `timeout` is only a backstop so a broken build cannot hang the suite.
  const std::string command = env + " timeout -k 5 170 " MESHTRAIN_MPIEXEC " -np 2 " +
                              meshtrain::testing::environment_path("MESHTRAIN_FAULT_HELPER") + " " + scenario + " 2>&1";
  JobResult result;
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer;
  while (fgets(buffer.data(), buffer.size(), pipe)) result.output += buffer.data();
  const int status = pclose(pipe);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

TEST(Fault, SkippedCollectiveEndsTheJobWithTheWatchdogLine) {
  const double timeout = 3;
  const JobResult job = run_job("skip-collective", "MESHTRAIN_COMM_TIMEOUT=3");
  EXPECT_NE(job.exit_status, 0) << job.output;
  EXPECT_NE(job.exit_status, 124) << "the backstop timeout fired: the job hung\n" << job.output;
  EXPECT_NE(job.output.find("meshtrain: rank 0: watchdog: all_reduce(float32[4], sum) on communicator 'world' "
                            "(sequence #1) did not complete after 3."),
            std::string::npos)
      << job.output;
  EXPECT_LT(job.seconds, timeout + 30) << job.output;
}

TEST(Fault, DeadRankEndsTheJob) {
  const JobResult job = run_job("die", "MESHTRAIN_COMM_TIMEOUT=3");
  EXPECT_NE(job.exit_status, 0) << job.output;
  EXPECT_NE(job.exit_status, 124) << "the backstop timeout fired: the job hung\n" << job.output;
  EXPECT_LT(job.seconds, 3 + 30) << job.output;
}

// Note [Fatal signals]: the dying rank names itself, the signal and its step,
// then its stack; the job still ends as a death by that signal.
TEST(Fault, SegfaultNamesRankSignalAndStep) {
  const JobResult job = run_job("segfault", "MESHTRAIN_COMM_TIMEOUT=10");
  EXPECT_NE(job.exit_status, 0) << job.output;
  EXPECT_NE(job.exit_status, 124) << "the backstop timeout fired: the job hung\n" << job.output;
  EXPECT_NE(job.output.find(": Segmentation fault (signal 11) at address 0x0 during step 3\n"), std::string::npos)
      << job.output;
  EXPECT_NE(job.output.find("meshtrain: rank 1 on "), std::string::npos) << job.output;
  EXPECT_NE(job.output.find("meshtrain_fault_helper("), std::string::npos) << "no stack frame\n" << job.output;
  EXPECT_EQ(job.output.find("*** Process received signal ***"), std::string::npos)  // Open MPI's own, repeating it
      << job.output;
}

TEST(Fault, DesyncCheckReportsBothSignatures) {
  const JobResult job = run_job("desync-shape", "MESHTRAIN_COMM_TIMEOUT=30 MESHTRAIN_DESYNC_CHECK=1");
  EXPECT_NE(job.exit_status, 0) << job.output;
  EXPECT_NE(job.output.find("communicator 'world': desync at collective #1: ranks issued different collectives: "
                            "rank 0: all_reduce(float32[4, 8], sum) #1; rank 1: all_reduce(float32[4, 9], sum) #1"),
            std::string::npos)
      << job.output;
}

TEST(Fault, WithoutTheDesyncCheckAMismatchStillEndsTheJob) {
  // MPI itself may or may not notice different counts; either way the job must
  // end non-zero (an MPI error, or the watchdog) and never hang.
  const JobResult job = run_job("desync-shape", "MESHTRAIN_COMM_TIMEOUT=3 MESHTRAIN_DESYNC_CHECK=0");
  EXPECT_NE(job.exit_status, 124) << "the backstop timeout fired: the job hung\n" << job.output;
  EXPECT_LT(job.seconds, 3 + 30) << job.output;
}

}  // namespace
