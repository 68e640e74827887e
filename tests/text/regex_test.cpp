#include "meshtrain/text/regex.h"
#include "meshtrain/text/tokenizer.h"

#include <gtest/gtest.h>

#include <string>

namespace meshtrain::text {
namespace {

std::string repeated(const std::string& piece, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += piece;
  return out;
}

// Each repetition of the group keeps a backtracking frame: 1,000 of them
// pass PCRE2's default 32 KiB JIT stack, 50,000 fit the larger one each
// thread gets, 200,000 need the interpreter. Each must match the whole text.
TEST(Regex, BacktrackingPastTheJitStackStillMatches) {
  const Regex regex("(?:a|b)*");
  for (int times : {1000, 50000, 200000}) {
    const std::string text = repeated("ab", times);
    const auto found = regex.find_all(text);
    ASSERT_FALSE(found.empty()) << times;
    EXPECT_EQ(found[0].first, 0u) << times;
    EXPECT_EQ(found[0].second, text.size()) << times;
  }
}

TEST(Regex, AMatchPastEveryLimitIsAnError) {
  const std::string text = repeated("ab", 2500000);
  try {
    Regex("(?:a|b)*").find_all(text);
    FAIL() << "a match past the interpreter's heap limit gave matches";
  } catch (const TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be matched on a text of 5000000 bytes"), std::string::npos) << e.what();
  }
}

TEST(Regex, InvalidUtf8IsRefused) { EXPECT_THROW(Regex("a").find_all("a\xff"), TokenizerError); }

}  // namespace
}  // namespace meshtrain::text
