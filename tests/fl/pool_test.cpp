// Pooled clients (Note [A pool of clients]): threads sharing one trainer
// compute what clients with their own trainers compute.
#include "meshtrain/fl/client.h"
#include "meshtrain/fl/client_pool.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"
#include "tests/harness/test_env.h"

#include <gtest/gtest.h>

#include <thread>

namespace meshtrain::fl {
namespace {

std::vector<at::Tensor> federation(const std::string& dir, bool pooled, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model.layers=1", "model.width=32", "model.heads=2", "model.context=16", "fl.rounds=2",
                                "fl.client.local_steps=2", "fl.client.batch=2", "fl.client.optimizer=adamw",
                                "fl.min_available=4", "fl.server.insecure=true", "fl.server.listen=127.0.0.1:0",
                                "fl.server.out=" + dir + "/out"};
  o.insert(o.end(), extra.begin(), extra.end());
  const FlConfig config = FlConfig::load("", o);
  const std::string text = util::read_text_file(testing::environment_path("MESHTRAIN_TEST_DATA_DIR") +
                                                "/shakespeare_excerpt.txt");
  Server server(config);
  std::vector<ClientOptions> clients;
  for (int i = 0; i < 4; ++i) {
    ClientOptions o;
    o.id = "c" + std::to_string(i);
    o.server = "127.0.0.1:" + std::to_string(server.port());
    o.data = dir + "/" + o.id + ".bin";
    o.tls.insecure = true;
    o.quiet = true;
    train::write_token_file(o.data, train::ByteTokenizer::encode(text.substr(i * 3000, 3000)), 256);
    clients.push_back(o);
  }
  std::vector<std::thread> threads;
  int pool_status = -1;
  if (pooled) {
    threads.emplace_back([&] { pool_status = run_client_pool(clients, 1); });
  } else {
    for (const auto& o : clients) threads.emplace_back([&o] { run_client(o); });
  }
  EXPECT_EQ(server.run(), 0);
  for (auto& t : threads) t.join();
  if (pooled) EXPECT_EQ(pool_status, 0);
  return server.weights();
}

TEST(FlPool, ClientsSharingOneTrainerEqualClientsWithTheirOwn) {
  const std::string dir = ::testing::TempDir() + "/fl_pool";
  util::remove_tree(dir);
  util::make_directories(dir + "/own");
  util::make_directories(dir + "/pooled");
  const std::vector<at::Tensor> own = federation(dir + "/own", false), pooled = federation(dir + "/pooled", true);
  ASSERT_EQ(own.size(), pooled.size());
  for (size_t p = 0; p < own.size(); ++p) EXPECT_TRUE(at::equal(own[p], pooled[p])) << "parameter " << p;
}

// Note [Streaming the mean]: a round that sums its results as they come (a
// fixed norm bound) equals one that keeps them (an "auto" bound too large to
// bind), and one client whose update the fixed bound clips still counts.
TEST(FlStream, AStreamedRoundEqualsAKeptOne) {
  const std::string dir = ::testing::TempDir() + "/fl_stream";
  util::remove_tree(dir);
  for (const char* d : {"/kept", "/streamed", "/clipped", "/kept_clipped"}) util::make_directories(dir + d);
  // SGD: AdamW's first steps would magnify the sums' rounding (arrival order against id order).
  const auto kept = federation(dir + "/kept", false, {"fl.clip_norm=auto", "fl.clip_factor=1e9", "fl.client.optimizer=sgd"});
  const auto streamed = federation(dir + "/streamed", false, {"fl.clip_norm=1e9", "fl.client.optimizer=sgd"});
  for (size_t p = 0; p < kept.size(); ++p)
    EXPECT_LT((kept[p] - streamed[p]).abs().max().item<double>(), 1e-6) << "parameter " << p;
  // A bound that binds, against a kept round under the same bound: trimmed_mean with nothing trimmed is the
  // mean unweighted, and the clients hold equal data.
  const auto clipped = federation(dir + "/clipped", false, {"fl.clip_norm=0.05", "fl.client.optimizer=sgd"});
  const auto kept_clipped = federation(dir + "/kept_clipped", false, {"fl.clip_norm=0.05", "fl.aggregation=trimmed_mean",
                                                                     "fl.trim_fraction=0", "fl.client.optimizer=sgd"});
  for (size_t p = 0; p < kept.size(); ++p)
    EXPECT_LT((clipped[p] - kept_clipped[p]).abs().max().item<double>(), 1e-6) << "parameter " << p;
}

}  // namespace
}  // namespace meshtrain::fl
