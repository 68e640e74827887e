// What the federation's end-to-end tests share: client token files cut from
// the excerpt, a tiny config, a run of the server's rounds with a client
// thread per file, and the server's metrics.
#pragma once

#include "meshtrain/fl/client.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"
#include "tests/harness/test_env.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::fl {

inline std::string excerpt_path() { return testing::environment_path("MESHTRAIN_TEST_DATA_DIR") + "/shakespeare_excerpt.txt"; }

// Three client token files of equal size, cut from the excerpt.
inline std::vector<std::string> client_files(const std::string& dir, int n) {
  util::make_directories(dir);
  const std::string text = util::read_text_file(excerpt_path());
  const size_t each = text.size() / static_cast<size_t>(n);
  std::vector<std::string> paths;
  for (int i = 0; i < n; ++i) {
    paths.push_back(dir + "/c" + std::to_string(i) + ".bin");
    train::write_token_file(paths.back(), train::ByteTokenizer::encode(text.substr(i * each, each)), 256);
  }
  return paths;
}

inline FlConfig tiny_config(const std::string& out) {
  FlConfig c = FlConfig::load("", {"model.layers=1", "model.width=32", "model.heads=2", "model.context=16",
                                   "fl.rounds=2", "fl.client.local_steps=3", "fl.client.batch=4", "fl.client.lr=0.3",
                                   "fl.server.insecure=true", "fl.server.listen=127.0.0.1:0", "fl.deadline_s=60",
                                   "fl.server.out=" + out});
  return c;
}

// Runs the server's rounds with one client thread per data file; returns the final weights.
inline std::vector<at::Tensor> federate(const FlConfig& config, const std::vector<std::string>& files,
                                        const std::vector<double>& straggle = {},
                                        const std::vector<int>& leave_after = {}) {
  Server server(config);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < files.size(); ++i) {
    threads.emplace_back([&, i] {
      ClientOptions o;
      o.id = "c" + std::to_string(i);
      o.server = "127.0.0.1:" + std::to_string(server.port());
      o.data = files[i];
      o.tls.insecure = true;
      o.quiet = true;
      o.straggle_s = i < straggle.size() ? straggle[i] : 0;
      o.leave_after = i < leave_after.size() ? leave_after[i] : 0;
      run_client(o);
    });
  }
  server.run();
  for (auto& t : threads) t.join();
  return server.weights();
}

inline std::vector<nlohmann::json> metrics(const std::string& out) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace meshtrain::fl
