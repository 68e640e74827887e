// fl.mode = "async" (Note [Buffered asynchronous rounds]): the server's model
// after clients hand in chosen updates equals FedBuff computed by hand, stale
// results are scaled or refused, and what it cannot combine with is refused.
#include "meshtrain/fl/client.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/fl/update.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"
#include "tests/fl/raw_client.h"
#include "tests/harness/test_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <thread>

namespace meshtrain::fl {
namespace {

FlConfig async_config(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> o = {"model.layers=1", "model.width=32", "model.heads=2", "model.context=16",
                                "fl.mode=async", "fl.server.insecure=true", "fl.server.listen=127.0.0.1:0",
                                "fl.deadline_s=60", "fl.server.out=" + out};
  o.insert(o.end(), extra.begin(), extra.end());
  return FlConfig::load("", o);
}

std::vector<nlohmann::json> rows_of(const std::string& out) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// One of the four hand-driven clients of the test below.
struct Hand {
  Hand(int port, std::string id, uint64_t examples) : raw(port), id(std::move(id)), examples(examples) {
    EXPECT_TRUE(raw.join(this->id, examples).ok());
  }
  // Polls until the FIT task of `version` comes; returns it.
  wire::Task task_of(uint64_t version) {
    wire::Task task;
    while (!(task.kind() == wire::Task::FIT && task.round() == version)) {
      EXPECT_TRUE(raw.poll(id, &task).ok());
      EXPECT_NE(task.kind(), wire::Task::STOP) << id << " waiting for version " << version;
      if (task.kind() == wire::Task::STOP) break;
    }
    return task;
  }
  void stopped() {
    for (wire::Task task; task.kind() != wire::Task::STOP;) ASSERT_TRUE(raw.poll(id, &task).ok());
  }
  // Sends `delta` (one tensor per parameter) as the update trained from `version`; returns ΔW as the server decodes it.
  std::vector<at::Tensor> send(uint64_t version, const std::vector<at::Tensor>& delta, const FlConfig& c,
                               grpc::Status* status = nullptr) {
    const uint64_t seed = mix_seed(c.seed, version);
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& t : delta) shapes.push_back(t.sizes().vec());
    const std::vector<Structure> structures = round_structures(c.compression, shapes, seed);
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(7);
    std::vector<at::Tensor> payloads;
    for (const auto& t : delta) payloads.push_back(t.flatten());
    wire::Result r;
    r.set_client_id(id);
    r.set_session(raw.session);
    r.set_round(version);
    r.set_kind(wire::Task::FIT);
    r.set_examples(examples);
    r.set_train_loss(1.0);
    for (auto& e : encode_update(payloads, c.compression, seed, id, false, rng)) *r.add_update() = std::move(e);
    const grpc::Status s = submit(*raw.stub, r);
    if (status) *status = s;
    else EXPECT_TRUE(s.ok()) << id << ": " << s.error_message();
    return decode_update({r.update().begin(), r.update().end()}, c.compression, structures, seed, id, false);
  }
  RawClient raw;
  std::string id;
  uint64_t examples;
};

std::vector<at::Tensor> random_delta(const std::vector<at::Tensor>& like, double norm, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> d;
  double sq = 0;
  for (const auto& t : like) {
    d.push_back(at::randn(t.sizes(), g, t.options()));
    sq += d.back().pow(2).sum().item<double>();
  }
  for (auto& t : d) t.mul_(norm / std::sqrt(sq));
  return d;
}

// w += Σ wᵢ·sᵢ·Δᵢ / Σ wᵢ: FedBuff's step with FedAvg's example weights, server_lr 1.
void step(std::vector<at::Tensor>& w, const std::vector<std::pair<double, std::vector<at::Tensor>>>& in,
          const std::vector<double>& scale) {
  double total = 0;
  for (const auto& [examples, d] : in) total += examples;
  for (size_t p = 0; p < w.size(); ++p)
    for (size_t i = 0; i < in.size(); ++i) w[p] = w[p] + in[i].second[p] * (in[i].first * scale[i] / total);
}

// Four clients, K = 2, max staleness 1, exponent 0.5, a fixed norm bound of 1:
//   version 1: a and b (staleness 0);
//   version 2: c, trained from version 1 (staleness 1, norm 5: clipped to 1, then scaled by 2^-0.5), and a;
//   version 3: d's version-1 result is refused (staleness 2); d, trained from 3, and b.
TEST(FlAsync, EqualsFedBuffComputedByHand) {
  const std::string dir = ::testing::TempDir() + "/fl_async_hand";
  util::remove_tree(dir);
  const FlConfig c = async_config(dir + "/out", {"fl.rounds=3", "fl.async.buffer=2", "fl.async.max_staleness=1",
                                                 "fl.async.staleness_exponent=0.5", "fl.clip_norm=1"});
  Server server(c);
  Hand a(server.port(), "a", 100), b(server.port(), "b", 300), cc(server.port(), "c", 200), d(server.port(), "d", 100);
  std::thread rounds([&] { server.run(); });
  model::Gpt start(c.model, c.seed);
  std::vector<at::Tensor> w = parameters_of(*start);
  for (Hand* h : {&a, &b, &cc, &d}) h->task_of(1);

  const auto da = a.send(1, random_delta(w, 0.5, 1), c), db = b.send(1, random_delta(w, 0.7, 2), c);
  step(w, {{100, da}, {300, db}}, {1, 1});

  a.task_of(2);
  auto dc = cc.send(1, random_delta(w, 5.0, 3), c);
  for (auto& t : dc) t.mul_(1.0 / 5.0);  // clipped to the bound
  const auto da2 = a.send(2, random_delta(w, 0.4, 4), c);
  step(w, {{200, dc}, {100, da2}}, {1 / std::sqrt(2.0), 1});

  b.task_of(3);
  grpc::Status refused;
  d.send(1, random_delta(w, 0.5, 5), c, &refused);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("too stale: 'd' trained from model version 1, the server is at version 3"),
            std::string::npos) << refused.error_message();
  d.task_of(3);
  const auto dd = d.send(3, random_delta(w, 0.3, 6), c), db3 = b.send(3, random_delta(w, 0.6, 7), c);
  step(w, {{100, dd}, {300, db3}}, {1, 1});
  for (Hand* h : {&a, &b, &cc, &d}) h->stopped();  // the server waits for its clients to hear STOP
  rounds.join();

  const std::vector<at::Tensor> got = server.weights();
  ASSERT_EQ(got.size(), w.size());
  for (size_t p = 0; p < w.size(); ++p)
    EXPECT_LT((got[p] - w[p]).abs().max().item<double>(), 1e-6) << "parameter " << p;
  const auto rows = rows_of(c.out);
  ASSERT_EQ(rows.size(), 4u);  // round 0 and three versions
  EXPECT_EQ(rows[1]["participants"], nlohmann::json({"a", "b"}));
  EXPECT_EQ(rows[2]["staleness"], nlohmann::json({{"a", 0}, {"c", 1}}));
  EXPECT_EQ(rows[2]["clipped"], nlohmann::json({"c"}));
  EXPECT_EQ(rows[3]["dropped"], nlohmann::json({"d"}));
  EXPECT_EQ(rows[3]["staleness"], nlohmann::json({{"b", 0}, {"d", 0}}));
  for (size_t r = 1; r < rows.size(); ++r) EXPECT_EQ(rows[r]["mode"], "async");
}

// Built-in clients, one of them slow: every version closes with the fast
// clients' results, and the slow client's, when it comes, counts as stale.
TEST(FlAsync, ASlowClientHoldsUpNoVersion) {
  const std::string dir = ::testing::TempDir() + "/fl_async_slow";
  util::remove_tree(dir);
  const FlConfig c = async_config(dir + "/out", {"fl.rounds=4", "fl.async.buffer=2", "fl.async.max_staleness=8",
                                                 "fl.client.local_steps=1", "fl.client.batch=2"});
  const std::string text = util::read_text_file(testing::environment_path("MESHTRAIN_TEST_DATA_DIR") +
                                                "/shakespeare_excerpt.txt");
  Server server(c);
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    const std::string file = dir + "/c" + std::to_string(i) + ".bin";
    train::write_token_file(file, train::ByteTokenizer::encode(text.substr(i * 2000, 2000)), 256);
    clients.emplace_back([&, i, file] {
      ClientOptions o;
      o.id = "c" + std::to_string(i);
      o.server = "127.0.0.1:" + std::to_string(server.port());
      o.data = file;
      o.tls.insecure = true;
      o.quiet = true;
      o.straggle_s = i == 2 ? 1.5 : 0;
      run_client(o);
    });
  }
  server.run();
  for (auto& t : clients) t.join();
  const auto rows = rows_of(c.out);
  ASSERT_EQ(rows.size(), 5u);
  int slow_seen = 0;
  for (size_t r = 1; r < rows.size(); ++r) {
    EXPECT_EQ(rows[r]["status"], "ok") << rows[r].dump();
    EXPECT_EQ(rows[r]["participants"].size(), 2u) << rows[r].dump();
    if (rows[r]["staleness"].contains("c2")) {
      ++slow_seen;
      EXPECT_GE(rows[r]["staleness"]["c2"].get<int>(), 1) << rows[r].dump();
    }
  }
  EXPECT_LE(slow_seen, 1) << "the slow client's result held up a version";
}

TEST(FlAsync, WhatItCannotAccountForIsRefused) {
  auto refused = [](std::vector<std::string> extra, const std::string& want) {
    try {
      async_config("/tmp/unused", std::move(extra));
      ADD_FAILURE() << "accepted; wanted: " << want;
    } catch (const FlConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused({"fl.dp.noise_multiplier=1", "fl.clip_norm=1"}, "the accountant's analysis is of rounds that sample");
  refused({"fl.secagg.enabled=true", "fl.min_fit=2", "fl.min_available=2"}, "secure aggregation masks one round's");
  refused({"fl.clients_per_round=4"}, "set fl.async.concurrency");
  refused({"fl.async.buffer=4", "fl.async.concurrency=2"}, "an aggregation could never fill");
  refused({"fl.mode=buffered"}, "fl.mode = \"buffered\": use sync or async");
}

}  // namespace
}  // namespace meshtrain::fl
