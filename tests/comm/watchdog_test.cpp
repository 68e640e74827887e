// The watchdog in one process, with the abort handler replaced by a recorder.
#include "meshtrain/comm/watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>

namespace meshtrain::comm {
namespace {

class WatchdogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = Watchdog::instance().set_abort_handler([this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(line);
    });
  }
  void TearDown() override { Watchdog::instance().set_abort_handler(previous_); }

  std::vector<std::string> lines_after(std::chrono::milliseconds wait) {
    std::this_thread::sleep_for(wait);
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }

  static WatchedOp watched(int64_t sequence) {
    Op op;
    op.kind = OpKind::kAllReduce;
    op.input = op.output = at::ones({4});
    op.sequence = sequence;
    return WatchedOp{3, "test", op};
  }

  Watchdog::AbortHandler previous_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST_F(WatchdogTest, AnOpPastItsTimeoutProducesOneClearLine) {
  WatchdogContext context("step 12");
  Watchdog::instance().start(watched(7), std::chrono::milliseconds(100));
  const auto lines = lines_after(std::chrono::milliseconds(600));
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("meshtrain: rank 3: watchdog: all_reduce(float32[4], sum) on communicator 'test' "
                          "(sequence #7) did not complete after 0."),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("(timeout 0.1 s) during step 12; a peer rank died"), std::string::npos) << lines[0];
  EXPECT_EQ(Watchdog::instance().watched(), 0u);
}

TEST_F(WatchdogTest, FinishedOpsAndPolledOpsDoNotFire) {
  const uint64_t token = Watchdog::instance().start(watched(1), std::chrono::milliseconds(200));
  Watchdog::instance().finish(token);
  std::atomic<bool> done{false};
  Watchdog::instance().start(watched(2), std::chrono::milliseconds(300), [&] { return done.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  done = true;
  EXPECT_TRUE(lines_after(std::chrono::milliseconds(500)).empty());
  EXPECT_EQ(Watchdog::instance().watched(), 0u);
}

TEST_F(WatchdogTest, EarlierDeadlineAddedLaterStillFiresOnTime) {
  const uint64_t slow = Watchdog::instance().start(watched(1), std::chrono::seconds(60));
  Watchdog::instance().start(watched(2), std::chrono::milliseconds(100));
  const auto lines = lines_after(std::chrono::milliseconds(600));
  Watchdog::instance().finish(slow);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("(sequence #2)"), std::string::npos) << lines[0];
}

}  // namespace
}  // namespace meshtrain::comm
