#include "meshtrain/serve/request_framing.h"

#include <gtest/gtest.h>

#include <string>

namespace meshtrain::serve {
namespace {

using Verdict = RequestFraming::Verdict;

constexpr size_t kHead = 1024, kBody = 100;

// Feeds `bytes` one byte at a time; the verdict after each prefix.
std::string verdicts(const std::string& bytes, RequestFraming& framing) {
  std::string out;
  for (size_t n = 1; n <= bytes.size(); ++n) {
    const Verdict v = framing.inspect(bytes.substr(0, n));
    out += v == Verdict::kIncomplete ? '.' : v == Verdict::kWhole ? 'W' : 'R';
    if (v != Verdict::kIncomplete) break;
  }
  return out;
}

// Whole exactly at the last byte, never before.
void expect_whole_at_end(const std::string& request) {
  RequestFraming framing(kHead, kBody);
  EXPECT_EQ(verdicts(request, framing), std::string(request.size() - 1, '.') + "W") << request;
}

TEST(RequestFraming, WholeOnlyWhenHeadAndBodyHaveArrived) {
  expect_whole_at_end("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  expect_whole_at_end("POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello");
  expect_whole_at_end("POST /v1/completions HTTP/1.1\r\nContent-Length:  0 \r\n\r\n");
  // Chunks with an extension and a trailer; Transfer-Encoding wins over Content-Length.
  expect_whole_at_end("POST /x HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: Chunked\r\n\r\n"
                      "5;name=v\r\nhello\r\n3\r\nabc\r\n0\r\nX-Sum: 8\r\n\r\n");
  expect_whole_at_end("POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
}

TEST(RequestFraming, TooLargeBodiesAreHandedOnAsSoonAsKnown) {
  {  // declared past the limit: whole at the head's end, nothing of the body waited for
    RequestFraming framing(kHead, kBody);
    const std::string head = "POST /x HTTP/1.1\r\nContent-Length: 101\r\n\r\n";
    EXPECT_EQ(verdicts(head + "abc", framing), std::string(head.size() - 1, '.') + "W");
  }
  {  // a huge declared length does not overflow
    RequestFraming framing(kHead, kBody);
    EXPECT_EQ(framing.inspect("POST /x HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"), Verdict::kWhole);
  }
  {  // chunks: whole once a byte past the limit has arrived (the server then answers 413)
    RequestFraming framing(kHead, kBody);
    const std::string head = "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
    std::string body = "32\r\n" + std::string(50, 'a') + "\r\n" + "32\r\n" + std::string(50, 'b') + "\r\n";
    const std::string over = "1\r\nc";
    const std::string bytes = head + body + over;
    EXPECT_EQ(verdicts(bytes, framing), std::string(bytes.size() - 1, '.') + "W");
  }
  {  // one chunk declaring more than the limit: whole when its bytes pass the limit
    RequestFraming framing(kHead, kBody);
    const std::string bytes = "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffff\r\n" + std::string(101, 'a');
    EXPECT_EQ(verdicts(bytes, framing), std::string(bytes.size() - 1, '.') + "W");
  }
}

TEST(RequestFraming, MalformedChunksAreHandedOnAndLongHeadsRefused) {
  RequestFraming bad_size(kHead, kBody);
  EXPECT_EQ(bad_size.inspect("POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"), Verdict::kWhole);
  RequestFraming endless_line(kHead, kBody);
  EXPECT_EQ(endless_line.inspect("POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(2000, '1')),
            Verdict::kWhole);
  RequestFraming long_head(kHead, kBody);
  EXPECT_EQ(long_head.inspect("GET / HTTP/1.1\r\nX: " + std::string(kHead, 'x')), Verdict::kRefuse);
  RequestFraming long_complete_head(kHead, kBody);
  EXPECT_EQ(long_complete_head.inspect("GET / HTTP/1.1\r\nX: " + std::string(kHead, 'x') + "\r\n\r\n"), Verdict::kRefuse);
}

TEST(RequestFraming, ExpectContinueOnlyWhenABodyIsToCome) {
  RequestFraming asks(kHead, kBody);
  EXPECT_EQ(asks.inspect("POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"), Verdict::kIncomplete);
  EXPECT_TRUE(asks.expects_continue());
  RequestFraming too_large(kHead, kBody);
  EXPECT_EQ(too_large.inspect("POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 400\r\n\r\n"), Verdict::kWhole);
  EXPECT_FALSE(too_large.expects_continue());
}

}  // namespace
}  // namespace meshtrain::serve
