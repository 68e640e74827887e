// The fatal-signal report (Note [Fatal signals]): one line naming the process,
// the signal and its step, then the stack; the process still dies by the signal.
#include "meshtrain/util/fatal_signal.h"

#include <csignal>
#include <cstdlib>

#include <gtest/gtest.h>

namespace meshtrain::util {
namespace {

TEST(FatalSignalDeathTest, NamesTheProcessSignalAndStepThenDiesByIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_fatal_signal_report("rank 5 on testhost");
        set_fatal_signal_context("step 12");
        std::raise(SIGFPE);
      },
      ::testing::KilledBySignal(SIGFPE),
      "meshtrain: rank 5 on testhost: Floating-point exception \\(signal 8\\) sent by process [0-9]+ during step 12\n");
  EXPECT_EXIT(
      {
        install_fatal_signal_report("rank 0 on testhost");
        set_fatal_signal_context("step 3");
        set_fatal_signal_context("");  // between steps
        std::abort();
      },
      ::testing::KilledBySignal(SIGABRT), "meshtrain: rank 0 on testhost: Aborted \\(signal 6\\) sent by process [0-9]+\n");
}

using Call = void (*)();

// Calls through a null pointer; the report names this function as the caller.
__attribute__((noinline)) void call_through(volatile Call function) {
  function();
  asm volatile("");  // a call, not a tail jump: the return address stays on the stack
}

#if defined(__x86_64__)
TEST(FatalSignalDeathTest, ACallThroughNullNamesItsCaller) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_fatal_signal_report("rank 2 on testhost");
        set_fatal_signal_context("start-up");
        call_through(nullptr);
      },
      ::testing::KilledBySignal(SIGSEGV),
      "rank 2 on testhost: Segmentation fault \\(signal 11\\) at address 0x0 during start-up\n"
      "meshtrain: a call through a null function pointer; the call was made just before\n"
      "[^\n]*\\([^)\n]*\\+0x[0-9a-f]+\\)\\[0x[0-9a-f]+\\]\n");
}
#endif

TEST(FatalSignal, RankFromTheLauncherAndHost) {
  const char* outer = std::getenv("OMPI_COMM_WORLD_RANK");
  const std::string kept = outer ? outer : "";
  setenv("OMPI_COMM_WORLD_RANK", "7", 1);
  EXPECT_EQ(launcher_rank_and_host().rfind("rank 7 on ", 0), 0u) << launcher_rank_and_host();
  unsetenv("OMPI_COMM_WORLD_RANK");
  if (std::getenv("PMIX_RANK") == nullptr && std::getenv("PMI_RANK") == nullptr && std::getenv("SLURM_PROCID") == nullptr) {
    EXPECT_EQ(launcher_rank_and_host().rfind("on ", 0), 0u) << launcher_rank_and_host();
  }
  if (outer) setenv("OMPI_COMM_WORLD_RANK", kept.c_str(), 1);
}

}  // namespace
}  // namespace meshtrain::util
