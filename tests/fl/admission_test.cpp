// Who may join without mutual TLS (Note [Admission without mutual TLS]): a
// join token, joins per minute and live ids per source address, each refused
// with what to do; then an honest client with the token still trains.
#include "meshtrain/fl/admission.h"
#include "meshtrain/fl/client.h"
#include "meshtrain/fl/coordinator.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"
#include "tests/fl/raw_client.h"
#include "tests/harness/test_env.h"

#include <gtest/gtest.h>

#include <thread>

namespace meshtrain::fl {
namespace {

FlConfig config_with(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> o = {"model.layers=1", "model.width=32", "model.heads=2", "model.context=16",
                                "fl.rounds=1", "fl.client.local_steps=1", "fl.client.batch=2",
                                "fl.server.insecure=true", "fl.server.listen=127.0.0.1:0", "fl.deadline_s=60",
                                "fl.server.out=" + dir + "/out"};
  o.insert(o.end(), extra.begin(), extra.end());
  return FlConfig::load("", o);
}

void expect_refused(const grpc::Status& s, grpc::StatusCode code, const std::string& want) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(want), std::string::npos) << s.error_message();
}

TEST(FlAdmission, AJoinTokenIsAskedForThenAnHonestClientTrains) {
  const std::string dir = ::testing::TempDir() + "/fl_token";
  util::remove_tree(dir);
  util::make_directories(dir);
  util::write_text_file(dir + "/token", "  s3cret-0f-the-federation\n");
  Server server(config_with(dir, {"fl.server.join_token_file=" + dir + "/token"}));
  RawClient hostile(server.port());
  expect_refused(hostile.join("h0", 100), grpc::StatusCode::PERMISSION_DENIED,
                 "this federation needs a join token: pass the one its operator gave you with --join-token-file");
  expect_refused(hostile.join("h0", 100, "", "s3cret-0f-the-federatioN"), grpc::StatusCode::PERMISSION_DENIED,
                 "the join token is wrong");
  expect_refused(hostile.join("h0", 100, "", "s3cret"), grpc::StatusCode::PERMISSION_DENIED, "the join token is wrong");

  const std::string text = util::read_text_file(testing::environment_path("MESHTRAIN_TEST_DATA_DIR") +
                                                "/shakespeare_excerpt.txt");
  train::write_token_file(dir + "/c0.bin", train::ByteTokenizer::encode(text.substr(0, 2000)), 256);
  std::thread client([&] {
    ClientOptions o;
    o.id = "c0";
    o.server = "127.0.0.1:" + std::to_string(server.port());
    o.data = dir + "/c0.bin";
    o.tls.insecure = true;
    o.quiet = true;
    o.join_token = read_join_token(dir + "/token");
    EXPECT_EQ(run_client(o), 0);
  });
  EXPECT_EQ(server.run(), 0);  // no failed round
  client.join();
}

TEST(FlAdmission, LiveIdsAndJoinsPerAddressAreBounded) {
  const std::string dir = ::testing::TempDir() + "/fl_per_address";
  util::remove_tree(dir);
  {
    Server server(config_with(dir, {"fl.server.ids_per_address=2"}));
    RawClient a(server.port()), b(server.port()), c(server.port());
    ASSERT_TRUE(a.join("a", 100).ok());
    ASSERT_TRUE(b.join("b", 100).ok());
    expect_refused(c.join("c", 100), grpc::StatusCode::RESOURCE_EXHAUSTED,
                   "2 live clients have joined from 127.0.0.1, fl.server.ids_per_address = 2: join again once one leaves");
    ASSERT_TRUE(a.join("a", 100, a.session).ok());  // a rejoin of a live id is not one more
    ASSERT_TRUE(b.leave("b").ok());
    EXPECT_TRUE(c.join("c", 100).ok());
  }
  Server server(config_with(dir, {"fl.server.joins_per_minute=3"}));
  RawClient r(server.port());
  for (const char* id : {"x", "y", "z"}) ASSERT_TRUE(r.join(id, 100).ok()) << id;
  expect_refused(r.join("w", 100), grpc::StatusCode::RESOURCE_EXHAUSTED,
                 "too many joins from 127.0.0.1: at most fl.server.joins_per_minute = 3 a minute from one address");
}

// Ids that churned through are forgotten, the live and the awaited kept.
TEST(FlAdmission, ChurnedIdsAreForgotten) {
  Coordinator coordinator(false, {}, 16);
  auto join = [&](const std::string& id) {
    wire::JoinRequest r;
    r.set_client_id(id);
    r.set_examples(7);
    std::string session;
    Coordinator::Refusal refusal;
    EXPECT_EQ(coordinator.join(r, "", "10.0.0.1", &session, &refusal), "");
    return session;
  };
  join("stays");
  for (int i = 0; i < 5000; ++i) {
    wire::LeaveRequest l;
    l.set_client_id("churn" + std::to_string(i));
    l.set_session(join(l.client_id()));
    ASSERT_EQ(coordinator.leave(l), "");
  }
  EXPECT_EQ(coordinator.declared_examples("stays"), 7u);
  EXPECT_EQ(coordinator.declared_examples("churn0"), 0u);     // forgotten when the table passed 4,096
  EXPECT_EQ(coordinator.declared_examples("churn4999"), 7u);  // still known
}

TEST(FlAdmission, PeerAddresses) {
  EXPECT_EQ(peer_ip("ipv4:10.0.0.5:41234"), "10.0.0.5");
  EXPECT_EQ(peer_ip("ipv6:[::1]:5000"), "::1");
  EXPECT_EQ(peer_ip("ipv6:[2001:db8::7]:443"), "2001:db8::7");
  EXPECT_EQ(peer_ip("unix:/tmp/socket"), "unix:/tmp/socket");
}

}  // namespace
}  // namespace meshtrain::fl
