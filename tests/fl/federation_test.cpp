// The federation end to end in one process: a real gRPC server on loopback
// and clients on threads. Federated averaging is checked against centralised
// training, and the server against stragglers, restarts and malformed calls.
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

void sgd_step(model::GptImpl& m, const std::vector<std::pair<at::Tensor, at::Tensor>>& batches, double lr) {
  m.zero_grad();
  for (const auto& [x, y] : batches) (m.loss(x, y) / static_cast<double>(batches.size())).backward();
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.sub_(p.grad() * lr);
}

void expect_same(const std::vector<at::Tensor>& a, model::GptImpl& reference, double tol) {
  const std::vector<at::Tensor> b = parameters_of(reference);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), tol) << "parameter " << i;
}

TEST(FlFederation, OneClientEqualsCentralisedTraining) {
  const std::string dir = ::testing::TempDir() + "/fl_one";
  util::remove_tree(dir);
  const auto files = client_files(dir, 1);
  const FlConfig config = tiny_config(dir + "/out");
  const std::vector<at::Tensor> federated = federate(config, files);

  model::Gpt reference(config.model, config.seed);
  train::TokenFile file(files[0]);
  train::Sampler sampler(file, config.model.context, client_sampler_seed("c0"));
  for (int64_t s = 0; s < config.rounds * config.local_steps; ++s)
    sgd_step(*reference, {sampler.rows(s * config.batch, config.batch)}, config.lr);
  expect_same(federated, *reference, 2e-5);
  // And the federation did train: the weights moved.
  model::Gpt start(config.model, config.seed);
  EXPECT_GT((federated[0] - parameters_of(*start)[0]).abs().max().item<double>(), 1e-3);
}

// fl.client.optimizer = "adamw" is the project's one AdamW (Note [CPU AdamW]) with the clients' defaults, fresh
// each round: one client equals centralised training with torch's AdamW(0.9, 0.999, no decay) restarted per round.
TEST(FlFederation, OneAdamWClientEqualsTorchAdamWRestartedEachRound) {
  const std::string dir = ::testing::TempDir() + "/fl_adamw";
  util::remove_tree(dir);
  const auto files = client_files(dir, 1);
  FlConfig config = tiny_config(dir + "/out");
  config.optimizer = "adamw";
  config.lr = 0.01;
  const std::vector<at::Tensor> federated = federate(config, files);

  model::Gpt reference(config.model, config.seed);
  train::TokenFile file(files[0]);
  train::Sampler sampler(file, config.model.context, client_sampler_seed("c0"));
  for (int64_t r = 0; r < config.rounds; ++r) {
    torch::optim::AdamW adamw(reference->parameters(),
                              torch::optim::AdamWOptions(config.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(0));
    for (int64_t k = 0; k < config.local_steps; ++k) {
      const auto [x, y] = sampler.rows((r * config.local_steps + k) * config.batch, config.batch);
      adamw.zero_grad();
      reference->loss(x, y).backward();
      adamw.step();
    }
  }
  expect_same(federated, *reference, 1e-4);  // AdamW moves each weight by ~lr a step, whatever the gradient's size
}

TEST(FlFederation, OneLocalStepPerClientEqualsLargeBatchTraining) {
  const std::string dir = ::testing::TempDir() + "/fl_three";
  util::remove_tree(dir);
  const auto files = client_files(dir, 3);
  FlConfig config = tiny_config(dir + "/out");
  config.local_steps = 1;
  config.min_available = config.min_fit = 3;
  const std::vector<at::Tensor> federated = federate(config, files);

  model::Gpt reference(config.model, config.seed);
  std::vector<std::unique_ptr<train::TokenFile>> data;
  std::vector<std::unique_ptr<train::Sampler>> samplers;
  for (size_t i = 0; i < files.size(); ++i) {
    data.push_back(std::make_unique<train::TokenFile>(files[i]));
    samplers.push_back(std::make_unique<train::Sampler>(*data.back(), config.model.context,
                                                        client_sampler_seed("c" + std::to_string(i))));
  }
  for (int64_t r = 0; r < config.rounds; ++r) {
    std::vector<std::pair<at::Tensor, at::Tensor>> batch;  // the three clients' rows: one batch of 3·B
    for (auto& s : samplers) batch.push_back(s->rows(r * config.batch, config.batch));
    sgd_step(*reference, batch, config.lr);
  }
  expect_same(federated, *reference, 2e-5);
}

TEST(FlFederation, SecureAggregationIsFedAvgWeightedByExamples) {
  const std::string dir = ::testing::TempDir() + "/fl_secure";
  util::remove_tree(dir);
  util::make_directories(dir);
  const std::string text = util::read_text_file(excerpt_path());
  const std::vector<std::string> files{dir + "/c0.bin", dir + "/c1.bin"};  // a third and two thirds
  train::write_token_file(files[0], train::ByteTokenizer::encode(text.substr(0, text.size() / 3)), 256);
  train::write_token_file(files[1], train::ByteTokenizer::encode(text.substr(text.size() / 3)), 256);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 1;
  config.local_steps = 1;
  config.min_available = config.min_fit = 2;
  config.secagg = true;
  config.threshold = 2;
  config.clip = 1.0;
  const std::vector<at::Tensor> federated = federate(config, files);

  // Each client's one SGD step from the same start, averaged by its sequences.
  model::Gpt start(config.model, config.seed);
  const std::vector<at::Tensor> w0 = parameters_of(*start);
  std::vector<at::Tensor> expected, unweighted;
  for (const auto& w : w0) {
    expected.push_back(at::zeros_like(w));
    unweighted.push_back(at::zeros_like(w));
  }
  double total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    model::Gpt m(config.model, config.seed);
    train::TokenFile file(files[i]);
    train::Sampler sampler(file, config.model.context, client_sampler_seed("c" + std::to_string(i)));
    sgd_step(*m, {sampler.rows(0, config.batch)}, config.lr);
    const auto w = parameters_of(*m);
    for (size_t p = 0; p < w.size(); ++p) {
      expected[p] += w[p] * static_cast<double>(sampler.windows());
      unweighted[p] += w[p] / static_cast<double>(files.size());
    }
    total += static_cast<double>(sampler.windows());
  }
  // 16-bit quantisation over [-1, 1]: each entry within a step (3e-5) of the weighted mean.
  for (size_t p = 0; p < expected.size(); ++p)
    EXPECT_LT((federated[p] - expected[p] / total).abs().max().item<double>(), 6e-5) << "parameter " << p;
  // And the test tells weighted from unweighted: those differ by far more.
  double apart = 0;
  for (size_t p = 0; p < expected.size(); ++p)
    apart = std::max(apart, (federated[p] - unweighted[p]).abs().max().item<double>());
  EXPECT_GT(apart, 1e-3);
  EXPECT_EQ(metrics(config.out)[1]["status"], "ok");
}

TEST(FlFederation, StragglersAreDroppedAndTheRoundCompletes) {
  const std::string dir = ::testing::TempDir() + "/fl_straggle";
  util::remove_tree(dir);
  const auto files = client_files(dir, 3);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 1;
  config.min_available = 3;
  config.min_fit = 2;
  config.deadline_s = 3;
  federate(config, files, {0, 0, 6.0});
  const auto rows = metrics(config.out);
  ASSERT_EQ(rows.size(), 2u);  // round 0 (the start) and round 1
  EXPECT_EQ(rows[1]["status"], "ok");
  EXPECT_EQ(rows[1]["dropped"], nlohmann::json::array({"c2"}));
  EXPECT_EQ(rows[1]["participants"].size(), 2u);
  // Uplink counted per client: the two on time sent, the straggler's late result was refused.
  EXPECT_GT(rows[1]["bytes_per_client"]["c0"]["up"].get<int64_t>(), 0);
  EXPECT_FALSE(rows[1]["bytes_per_client"].contains("c2") && rows[1]["bytes_per_client"]["c2"]["up"].get<int64_t>() > 0);
}

// Note [Sampling clients]: two of four sampled clients are slow; the round
// closes at its target of two results instead of taking theirs (which come
// well before the deadline), and says whom it sampled with which seed.
TEST(FlFederation, AnOverSelectedRoundClosesAtItsTarget) {
  const std::string dir = ::testing::TempDir() + "/fl_over_select";
  util::remove_tree(dir);
  const auto files = client_files(dir, 4);
  FlConfig config = tiny_config(dir + "/out");
  config.rounds = 1;
  config.min_available = 4;
  config.min_fit = 2;
  config.clients_per_round = 2;
  config.over_select = 1;
  federate(config, files, {0, 0, 4.0, 4.0});
  const auto rows = metrics(config.out);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1]["status"], "ok");
  EXPECT_EQ(rows[1]["target"], 2);
  EXPECT_EQ(rows[1]["sampled"].size(), 4u);
  EXPECT_EQ(rows[1]["participants"], nlohmann::json::array({"c0", "c1"}));
  EXPECT_EQ(rows[1]["dropped"], nlohmann::json::array({"c2", "c3"}));
  EXPECT_TRUE(rows[1]["sample_seed"].is_number_unsigned());
}

TEST(FlSampling, AChoiceIsMadeAgainFromItsSeed) {
  std::vector<std::string> ids;
  for (int i = 0; i < 1000; ++i) ids.push_back("client" + std::to_string(i));
  const auto chosen = sample_clients(ids, 100, 42);
  ASSERT_EQ(chosen.size(), 100u);
  EXPECT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
  EXPECT_EQ(std::set<std::string>(chosen.begin(), chosen.end()).size(), 100u);
  std::reverse(ids.begin(), ids.end());  // the order the ids come in does not matter
  EXPECT_EQ(sample_clients(ids, 100, 42), chosen);
  EXPECT_NE(sample_clients(ids, 100, 43), chosen);
  EXPECT_EQ(sample_clients(ids, 2000, 42).size(), 1000u);
}

TEST(FlFederation, AClientThatLeavesIsNoLongerCounted) {
  const std::string dir = ::testing::TempDir() + "/fl_leave";
  util::remove_tree(dir);
  const auto files = client_files(dir, 2);
  FlConfig config = tiny_config(dir + "/out");
  config.min_available = 2;  // round 1 has both; c1 leaves after it
  config.wait_clients_s = 2;
  federate(config, files, {}, {0, 1});
  const auto rows = metrics(config.out);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[1]["status"], "ok");
  EXPECT_EQ(rows[1]["participants"].size(), 2u);
  // Round 2 either starts after the Leave (one client connected, fewer than
  // min_available: discarded after wait_clients_s) or samples c1 just before
  // it and does not wait for it. Without the Leave, c1 would count as
  // connected for 30 s and round 2 would wait for it until the deadline (60 s).
  const auto& participants = rows[2]["participants"];
  EXPECT_EQ(std::find(participants.begin(), participants.end(), "c1"), participants.end()) << rows[2];
  EXPECT_LT(rows[2]["seconds"].get<double>(), 10.0) << rows[2];
}

TEST(FlFederation, ARestartedServerResumesWhereItStopped) {
  const std::string dir = ::testing::TempDir() + "/fl_resume";
  util::remove_tree(dir);
  const auto files = client_files(dir, 2);
  FlConfig whole = tiny_config(dir + "/whole");
  whole.rounds = 4;
  whole.strategy.name = "fedadam";
  whole.strategy.server_lr = 0.01;
  whole.min_available = whole.min_fit = 2;  // both clients in every round: the runs are comparable
  const std::vector<at::Tensor> uninterrupted = federate(whole, files);

  FlConfig part = whole;
  part.out = dir + "/parts";
  part.rounds = 2;
  federate(part, files);
  part.rounds = 4;  // a new server on the same directory: rounds 3 and 4
  const std::vector<at::Tensor> resumed = federate(part, files);
  for (size_t i = 0; i < resumed.size(); ++i)
    EXPECT_LT((resumed[i] - uninterrupted[i]).abs().max().item<double>(), 1e-5) << i;
  const auto rows = metrics(part.out);
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows.back()["round"], 4);
  EXPECT_EQ(rows.back()["cumulative_uplink_bytes"], metrics(whole.out).back()["cumulative_uplink_bytes"]);
}

// Sends `result` as an upload's chunks (Note [Messages in chunks]).
// A unary call of `method` with `bytes` as its message, whatever they are.
grpc::Status raw_call(const std::shared_ptr<grpc::Channel>& channel, const std::string& method, const std::string& bytes) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext context;
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  std::mutex mutex;
  std::condition_variable done;
  bool finished = false;
  generic.UnaryCall(&context, "/meshtrain.fl.wire.Federation/" + method, grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mutex);
                      status = s;
                      finished = true;
                      done.notify_all();
                    });
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return finished; });
  return status;
}

TEST(FlFederation, MalformedCallsAreRejectedNotCrashes) {
  const std::string dir = ::testing::TempDir() + "/fl_malformed";
  util::remove_tree(dir);
  FlConfig config = tiny_config(dir + "/out");
  Server server(config);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials());
  auto stub = wire::Federation::NewStub(channel);
  wire::Result r;
  r.set_client_id("nobody");
  {  // Not joined.
    const grpc::Status s = submit(*stub, r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("Join"), std::string::npos) << s.error_message();
  }
  {  // A bad id.
    grpc::ClientContext context;
    wire::JoinRequest j;
    j.set_client_id("../etc/passwd");
    j.set_protocol(kProtocol);
    wire::JoinReply reply;
    EXPECT_EQ(stub->Join(&context, j, &reply).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {  // A version 1 client: refused at Join, and its whole-message calls unread, each with the reason.
    grpc::ClientContext context;
    wire::JoinRequest j;
    j.set_client_id("old");
    wire::JoinReply reply;
    const grpc::Status s = stub->Join(&context, j, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_NE(s.error_message().find("speaks federation protocol 2"), std::string::npos) << s.error_message();
    const grpc::Status old_submit = raw_call(channel, "Submit", r.SerializeAsString());
    EXPECT_EQ(old_submit.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(old_submit.error_message().find("the client speaks protocol 1"), std::string::npos)
        << old_submit.error_message();
  }
  {  // Bytes that are no protobuf message at all: as a chunk, and as a poll.
    const std::string junk = "\xff\xff\xff\xff\x0f not a message";
    const grpc::Status chunk = raw_call(channel, "SubmitChunks", junk);
    EXPECT_EQ(chunk.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(chunk.error_message().find("meshtrain.fl.wire.Chunk"), std::string::npos) << chunk.error_message();
    const grpc::Status poll = raw_call(channel, "PollChunks", junk);
    EXPECT_EQ(poll.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(poll.error_message().find("not a valid meshtrain.fl.wire.PollRequest message"), std::string::npos)
        << poll.error_message();
  }
  {  // A joined client answering a round that is not open.
    grpc::ClientContext join_context;
    wire::JoinRequest j;
    j.set_client_id("c0");
    j.set_examples(10);
    j.set_protocol(kProtocol);
    wire::JoinReply reply;
    ASSERT_TRUE(stub->Join(&join_context, j, &reply).ok());
    r.set_client_id("c0");
    r.set_session(reply.session());
    r.set_round(7);
    r.set_kind(wire::Task::FIT);
    const grpc::Status s = submit(*stub, r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("refused"), std::string::npos) << s.error_message();
  }
}

TEST(FlFederation, ConfigErrorsNameTheKey) {
  auto message = [](std::vector<std::string> overrides) {
    try {
      FlConfig::load("", overrides);
    } catch (const FlConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"fl.server.insecure=true", "fl.server.listen=0.0.0.0:5000"}).find("loopback"), std::string::npos);
  EXPECT_NE(message({"fl.rounds=0", "fl.server.insecure=true"}).find("fl.rounds"), std::string::npos);
  EXPECT_NE(message({"fl.roundz=3", "fl.server.insecure=true"}).find("fl.roundz: unknown key (did you mean fl.rounds?)"),
            std::string::npos);
  EXPECT_NE(message({}).find("cert and key"), std::string::npos);
  EXPECT_EQ(message({"fl.rounds=x", "fl.server.insecure=true"}), "override --fl.rounds=x: fl.rounds = x must be an integer");
  EXPECT_EQ(message({"fl.clip_norm=autox", "fl.server.insecure=true"}), "fl.clip_norm = \"autox\": a number >= 0, or \"auto\"");
  EXPECT_EQ(FlConfig::load("", {"fl.clip_norm=2", "fl.server.insecure=true", "fl.server.allow=a,b"}).tls.allow,
            (std::vector<std::string>{"a", "b"}));
  // [model] takes the model's keys (Note [Model keys]), the families' too.
  EXPECT_EQ(FlConfig::load("", {"model.preset=llama-tiny", "model.sliding_window=4", "fl.server.insecure=true"})
                .model.sliding_window, 4);
  EXPECT_EQ(message({"model.slidng_window=4", "fl.server.insecure=true"}),
            "model.slidng_window: not a model key (did you mean sliding_window?); meshtrain train --help lists them "
            "under [model]");
  // The keys are listed as train --help lists its own: [section], then key = default and its help.
  const std::string listed = FlConfig::describe_keys();
  for (const char* line : {"\n[fl]\n  rounds = 10 ", "\n[fl.client]\n  local_steps = 5 ", "  clip_norm = \"auto\" ",
                           "\n[fl.server]\n", "  out = \"runs/fl\" "}) {
    EXPECT_NE(listed.find(line), std::string::npos) << line;
  }
  EXPECT_NE(message({"fl.server.insecure=true", "fl.clients_per_round=1", "fl.min_fit=2", "fl.min_available=3"})
                .find("fl.clients_per_round = 1: 0 (from fl.fraction), or at least fl.min_fit = 2"),
            std::string::npos);
  EXPECT_NE(message({"fl.server.insecure=true", "fl.over_select=0.3", "fl.dp.noise_multiplier=1", "fl.clip_norm=1"})
                .find("not what it accounts for"),
            std::string::npos);
  EXPECT_NE(message({"fl.server.insecure=true", "fl.secagg.enabled=true", "fl.min_fit=1", "fl.min_available=3"})
                .find("threshold"),
            std::string::npos);
  // What to type: the settings that would hold.
  EXPECT_EQ(message({"fl.server.insecure=true", "fl.min_fit=6", "fl.min_available=4"}),
            "fl.min_fit = 6: must be >= 1 and <= fl.min_available = 4; raise fl.min_available to 6");
  EXPECT_EQ(message({"fl.server.insecure=true", "fl.secagg.enabled=true", "fl.secagg.threshold=6", "fl.min_fit=3",
                     "fl.min_available=4"}),
            "fl.secagg.threshold = 6 must not exceed fl.min_fit = 3 (a round below t cannot unmask); set fl.min_fit = 6 "
            "and fl.min_available = 6");
}

}  // namespace
}  // namespace meshtrain::fl
