// The fatal-signal report (Note [Fatal signals]): one line naming the process,
// the signal and its step, then the stack; the process still dies by the signal.
#include "meshtrain/util/fatal_signal.h"

#include <dlfcn.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <string>
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

#if defined(__x86_64__)
using Call = void (*)();

// Calls through a null pointer: the report's return address lies in here.
__attribute__((noinline)) void call_through(volatile Call function) {
  function();
  asm volatile("");  // a call, not a tail jump: the return address stays on the stack
}

// "\+0x<offset>" for each of the first 64 bytes of call_through, the way
// glibc prints an address of this program that has no dynamic symbol.
std::string call_through_offsets() {
  Dl_info program{};
  EXPECT_NE(dladdr(reinterpret_cast<void*>(&call_through), &program), 0);
  const auto start = reinterpret_cast<uintptr_t>(&call_through) - reinterpret_cast<uintptr_t>(program.dli_fbase);
  std::string alternatives;
  for (uintptr_t at = start; at < start + 64; ++at) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "%s\\+0x%lx", alternatives.empty() ? "" : "|", static_cast<unsigned long>(at));
    alternatives += hex;
  }
  return "(" + alternatives + ")";
}

TEST(FatalSignalDeathTest, AJumpToNullNamesTheCallsPlace) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_fatal_signal_report("rank 2 on testhost");
        set_fatal_signal_context("start-up");
        call_through(nullptr);
      },
      ::testing::KilledBySignal(SIGSEGV),
      "rank 2 on testhost: Segmentation fault \\(signal 11\\) at address 0x0 during start-up\n"
      "meshtrain: a jump to a null function pointer; the return address on the stack \\(a call's place\\):\n"
      "[^\n]*\\(" + call_through_offsets() + "\\)\\[0x[0-9a-f]+\\]\n");
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
