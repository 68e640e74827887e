// The federation end to end in one process, continued: a client's id and
// its rejoining, open calls that hold no server thread, a client whose
// connection dies, the kept states, a folder of another run, and the noise of
// DP-FedAvg and of distributed DP.
#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/client.h"
#include "meshtrain/fl/dp.h"
#include "meshtrain/fl/federation.grpc.pb.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/fl/server_rounds.h"
#include "meshtrain/fl/update.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"
#include "tests/fl/federation_harness.h"
#include "tests/fl/raw_client.h"
#include "tests/harness/test_env.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

namespace meshtrain::fl {
namespace {

TEST(FlFederation, ALiveIdCannotBeTakenButItsOwnerCanRejoin) {
  const std::string dir = ::testing::TempDir() + "/fl_duplicate";
  util::remove_tree(dir);
  Server server(tiny_config(dir + "/out"));
  RawClient owner(server.port()), impostor(server.port());
  ASSERT_TRUE(owner.join("c0", 100).ok());
  const grpc::Status taken = impostor.join("c0", 100);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(taken.error_message().find("live session"), std::string::npos) << taken.error_message();
  wire::Task task;
  EXPECT_TRUE(owner.poll("c0", &task).ok());  // the live session was not cancelled
  const std::string old = owner.session;
  ASSERT_TRUE(owner.join("c0", 100, old).ok());  // quoting its session: a rejoin
  EXPECT_NE(owner.session, old);
  const grpc::Status none = impostor.join("c1", 0);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(none.error_message().find("0 training sequences"), std::string::npos) << none.error_message();
}

int threads_of_this_process() {
  return static_cast<int>(std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                                        std::filesystem::directory_iterator{}));
}

// Note [Calls without threads]: a client's open Presence call and its waiting
// long poll are a few bytes on the server, not threads: 64 clients with both
// open add fewer than 16 threads to the process (the client side holds none:
// the polls are asynchronous calls on one completion queue).
TEST(FlFederation, OpenCallsHoldNoServerThread) {
  const std::string dir = ::testing::TempDir() + "/fl_presence_threads";
  util::remove_tree(dir);
  Server server(tiny_config(dir + "/out"));
  RawClient client(server.port());
  const int before = threads_of_this_process();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<wire::Ack>>> presences;
  std::vector<std::unique_ptr<grpc::ClientAsyncReader<wire::Chunk>>> polls;
  grpc::CompletionQueue queue;
  for (int i = 0; i < 64; ++i) {
    const std::string id = "p" + std::to_string(i);
    ASSERT_TRUE(client.join(id, 10).ok());
    wire::PollRequest request;
    request.set_client_id(id);
    request.set_session(client.session);
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    presences.push_back(client.stub->Presence(contexts.back().get(), request));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    polls.push_back(client.stub->PrepareAsyncPollChunks(contexts.back().get(), request, &queue));
    polls.back()->StartCall(nullptr);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // within the 1 s long poll
  const int during = threads_of_this_process();
  std::printf("%d threads before, %d with 64 Presence calls and 64 polls open\n", before, during);
  for (auto& context : contexts) context->TryCancel();
  for (auto& presence : presences) presence->Finish();
  std::vector<grpc::Status> statuses(polls.size());
  for (size_t i = 0; i < polls.size(); ++i) polls[i]->Finish(&statuses[i], nullptr);
  queue.Shutdown();
  void* tag;
  bool ok;
  while (queue.Next(&tag, &ok)) {
  }
  EXPECT_LT(during - before, 16) << before << " threads before, " << during << " with 64 clients' calls open";
}

TEST(FlFederation, AClientWhoseConnectionDiesIsNotWaitedFor) {
  const std::string dir = ::testing::TempDir() + "/fl_presence";
  util::remove_tree(dir);
  const auto files = client_files(dir, 1);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 1;
  config.min_available = 2;
  config.min_fit = 1;
  config.deadline_s = 60;
  Server server(config);
  RawClient ghost(server.port());
  ASSERT_TRUE(ghost.join("ghost", 100).ok());
  grpc::ClientContext presence;
  wire::PollRequest request;
  request.set_client_id("ghost");
  request.set_session(ghost.session);
  std::thread held([&] {
    auto reader = ghost.stub->Presence(&presence, request);
    for (wire::Ack ack; reader->Read(&ack);) {
    }
    reader->Finish();
  });
  std::thread rounds([&] { server.run(); });
  std::thread honest([&] {
    ClientOptions o;
    o.id = "c0";
    o.server = "127.0.0.1:" + std::to_string(server.port());
    o.data = files[0];
    o.tls.insecure = true;
    o.quiet = true;
    run_client(o);
  });
  for (wire::Task task; task.kind() != wire::Task::FIT;) ASSERT_TRUE(ghost.poll("ghost", &task).ok());
  presence.TryCancel();  // as if the process died with its task
  held.join();
  rounds.join();
  honest.join();
  const auto rows = metrics(config.out);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1]["status"], "ok");
  EXPECT_EQ(rows[1]["participants"], nlohmann::json::array({"c0"}));
  EXPECT_EQ(rows[1]["dropped"], nlohmann::json::array({"ghost"}));
  EXPECT_LT(rows[1]["seconds"].get<double>(), 20.0) << "the round waited for the deadline";
}

// The last fl.keep_states good states stay in out/states/; a state.safetensors
// that cannot be read is passed over for the newest of them.
TEST(FlFederation, KeptStatesOutliveACorruptState) {
  const std::string dir = ::testing::TempDir() + "/fl_kept";
  util::remove_tree(dir);
  const auto files = client_files(dir, 1);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 4;
  config.keep_states = 2;
  const std::vector<at::Tensor> after4 = federate(config, files);
  std::vector<std::string> kept;
  for (const auto& e : std::filesystem::directory_iterator(config.out + "/states")) kept.push_back(e.path().filename());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"round-3.safetensors", "round-4.safetensors"}));
  util::write_text_file(config.out + "/state.safetensors", "not a state");  // a torn disk, say
  config.rounds = 5;
  Server server(config);  // resumes from states/round-4: only round 5 is left
  const std::vector<at::Tensor> resumed = server.weights();
  for (size_t i = 0; i < resumed.size(); ++i) EXPECT_TRUE(at::equal(resumed[i], after4[i])) << i;
}

// Note [Resuming a federation]: a folder whose state was computed under another
// aggregation rule is refused, naming the key and the way to start afresh; a
// longer fl.rounds alone resumes.
TEST(FlFederation, AFolderOfAnotherRunIsRefusedNamingTheDifference) {
  const std::string dir = ::testing::TempDir() + "/fl_other_run";
  util::remove_tree(dir);
  const auto files = client_files(dir, 1);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 1;
  federate(config, files);
  FlConfig median = config;
  median.aggregation.name = "median";
  median.rounds = 2;
  try {
    Server refused(median);
    ADD_FAILURE() << "a state computed with the mean was resumed under the median";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("fl.aggregation = median here, mean there"), std::string::npos) << what;
    EXPECT_NE(what.find("--fl.server.resume=false"), std::string::npos) << what;
  }
  median.resume = false;
  EXPECT_NO_THROW(Server fresh(median));
  config.rounds = 2;
  EXPECT_NO_THROW(Server longer(config));
}

// One DP round of 2 clients whose updates are near zero (lr 1e-9), clip
// S = 1, z = 2 (plus `extra` settings): the change of every model coordinate,
// which is the noise alone.
at::Tensor dp_round_change(const std::string& name, const std::vector<std::string>& extra, FlConfig* used) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  util::remove_tree(dir);
  const auto files = client_files(dir, 2);
  std::vector<std::string> settings{"model.layers=1", "model.width=32", "model.heads=2", "model.context=16",
                                    "fl.rounds=1", "fl.client.local_steps=1", "fl.client.batch=2",
                                    "fl.client.lr=1e-9", "fl.server.insecure=true", "fl.min_available=2",
                                    "fl.min_fit=2", "fl.clip_norm=1", "fl.dp.noise_multiplier=2",
                                    "fl.server.out=" + dir + "/out"};
  settings.insert(settings.end(), extra.begin(), extra.end());
  *used = FlConfig::load("", settings);
  const std::vector<at::Tensor> after = federate(*used, files);
  model::Gpt start(used->model, used->seed);
  const auto before = parameters_of(*start);
  std::vector<at::Tensor> deltas;
  for (size_t i = 0; i < after.size(); ++i) deltas.push_back((after[i] - before[i]).reshape({-1}).to(at::kDouble));
  return at::cat(deltas);
}

// DP-FedAvg: with updates near zero, the round's change is the noise alone:
// N(0, (z·S/m)²) per coordinate.
TEST(FlFederation, DpFedAvgNoiseHasTheConfiguredScale) {
  FlConfig config;
  const at::Tensor all = dp_round_change("fl_dp", {}, &config);
  const double expected = 2.0 * 1.0 / 2;  // z·S/m
  EXPECT_NEAR(all.std().item<double>(), expected, 0.03 * expected) << all.numel() << " coordinates";
  EXPECT_NEAR(all.mean().item<double>(), 0.0, 0.03 * expected);
  const auto rows = metrics(config.out);
  EXPECT_NEAR(rows[1]["epsilon"].get<double>(), dp_epsilon(1.0, 2.0, 1, 1e-5), 1e-9);
}

// Distributed DP: under secure aggregation each client adds N(0, z²S²/m) to
// its clipped update; the sum carries N(0, z²S²), the mean N(0, (z·S/m)²).
TEST(FlFederation, DistributedDpUnderSecureAggregationHasTheSameNoise) {
  FlConfig config;
  const at::Tensor all =
      dp_round_change("fl_ddp", {"fl.secagg.enabled=true", "fl.secagg.threshold=2", "fl.secagg.clip=8"}, &config);
  EXPECT_NEAR(all.std().item<double>(), 1.0, 0.03);
  EXPECT_NEAR(all.mean().item<double>(), 0.0, 0.03);
  EXPECT_EQ(metrics(config.out)[1]["status"], "ok");
  // A ring clip that would cut the clients' noise is refused with the value to use.
  try {
    FlConfig::load("", {"fl.server.insecure=true", "fl.min_available=2", "fl.min_fit=2", "fl.clip_norm=1",
                        "fl.dp.noise_multiplier=2", "fl.secagg.enabled=true", "fl.secagg.threshold=2"});
    ADD_FAILURE() << "fl.secagg.clip = 0.5 accepted";
  } catch (const FlConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("would clip the clients' noise"), std::string::npos) << e.what();
  }
}

// The accountant's sum over k against the closed form it must reach at q = 1,
// where the sampled Gaussian is the Gaussian: RDP(α) = α/(2z²).
TEST(FlPrivacy, SampledGaussianReachesTheGaussianAtFullSampling) {
  for (double z : {0.5, 1.0, 4.0})
    for (int alpha : {2, 7, 64})
      EXPECT_NEAR(rdp_sampled_gaussian(1 - 1e-12, z, alpha), alpha / (2 * z * z), 1e-6 * alpha / (2 * z * z));
  // q = 0 costs nothing; sampling less, adding more noise or running fewer rounds costs less.
  EXPECT_EQ(rdp_sampled_gaussian(0, 1, 8), 0.0);
  EXPECT_LT(dp_epsilon(0.1, 1.0, 100, 1e-5), dp_epsilon(0.5, 1.0, 100, 1e-5));
  EXPECT_LT(dp_epsilon(0.1, 2.0, 100, 1e-5), dp_epsilon(0.1, 1.0, 100, 1e-5));
  EXPECT_LT(dp_epsilon(0.1, 1.0, 10, 1e-5), dp_epsilon(0.1, 1.0, 100, 1e-5));
  // At q = 1 the bound is a minimum over α of T·α/(2z²) + log((α−1)/α) − (log δ + log α)/(α−1).
  double best = 1e300;
  for (int a = 2; a <= 256; ++a)
    best = std::min(best, 20.0 * a / 2.0 + std::log((a - 1.0) / a) - (std::log(1e-5) + std::log(a)) / (a - 1.0));
  EXPECT_NEAR(dp_epsilon(1.0, 1.0, 20, 1e-5), best, 1e-9);
}

}  // namespace
}  // namespace meshtrain::fl
