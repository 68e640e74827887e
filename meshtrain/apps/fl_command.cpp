// meshtrain fl server | client | simulate | split | plot.
#include "meshtrain/apps/fl_cli.h"

#include "meshtrain/fl/admission.h"
#include "meshtrain/fl/client_pool.h"
#include "meshtrain/fl/config.h"
#include "meshtrain/fl/dp.h"
#include "meshtrain/fl/metrics.h"
#include "meshtrain/fl/server.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/cores.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <spawn.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace meshtrain::apps {
namespace {

pid_t spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("cannot start " + args[0]);
  return pid;
}

// The client directories of a split, the largest first (clients.json), else by name.
std::vector<std::string> client_dirs(const std::string& root) {
  std::vector<std::string> dirs;
  if (util::is_regular_file(root + "/clients.json")) {
    auto listing = nlohmann::json::parse(util::read_text_file(root + "/clients.json"));
    std::vector<std::pair<int64_t, std::string>> sized;
    for (const auto& c : listing) sized.emplace_back(c.at("train_bytes").get<int64_t>(), c.at("dir").get<std::string>());
    std::stable_sort(sized.begin(), sized.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [bytes, dir] : sized) dirs.push_back(dir);
    return dirs;
  }
  for (const auto& entry : std::filesystem::directory_iterator(root))
    if (entry.is_directory() && util::is_regular_file(entry.path().string() + "/train.bin"))
      dirs.push_back(entry.path().filename().string());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

}  // namespace

FlCli::FlCli(CLI::App& app, const char* self) : self_(self) {
  fl_ = app.add_subcommand("fl", "Federated learning: a server and clients over gRPC (TLS) with FedAvg/FedProx/"
                                 "FedAdam/FedYogi, compressed updates and secure aggregation");
  fl_->require_subcommand(1);

  server_ = fl_->add_subcommand("server", "Run the federation's rounds for the clients that join; metrics.jsonl, "
                                          "loss.svg and a resumable state.safetensors go to [fl.server] out");
  server_->add_option("config", config_, "TOML config ([model] and [fl...]; --help-config lists the keys)");
  server_->add_option("--port-file", port_file_, "Write the port listened on to this file");
  server_->add_flag("--help-config", help_config_, "List every [fl...] key with its help and exit");
  server_->allow_extras();
  server_->footer("Overrides: --fl.rounds=3 --fl.compression.bits=2 ... Example: meshtrain fl server fl.toml");

  client_ = fl_->add_subcommand("client", "Join a federation server and train on local data when asked");
  client_->add_option("--server", client_options_.server, "host:port of the server")->required();
  client_->add_option("--data", client_options_.data, "Directory with train.bin (from fl split) or a token file")
      ->required();
  client_->add_option("--id", client_options_.id, "This client's name (under mutual TLS: its certificate's CN)")
      ->required();
  client_->add_option("--ca", client_ca_, "PEM of the CA that signed the server's certificate");
  client_->add_option("--cert", client_cert_, "Mutual TLS: this client's certificate (PEM)");
  client_->add_option("--key", client_key_, "Mutual TLS: this client's private key (PEM)");
  client_->add_flag("--insecure", client_insecure_, "Plaintext (only to a loopback address)");
  client_->add_option("--join-token-file", client_token_file_,
                      "The federation's join token, where its server asks for one (fl.server.join_token_file)");
  client_->add_option("--connect-timeout", client_options_.connect_timeout_s, "Seconds to reach the server")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str();
  client_->add_option("--straggle", client_options_.straggle_s,
                      "Testing: wait this many seconds before sending each training result");
  client_->add_option("--slow-factor", client_options_.slow_factor,
                      "Testing and benchmarks: take this many times as long per training task (a slow device)")
      ->check(CLI::Range(1.0, 1000.0));
  client_->add_option("--leave-after", client_options_.leave_after,
                      "Leave the federation after this many rounds (0: stay until the server stops)");
  client_->add_option("--drop-after", client_options_.drop_after,
                      "Testing: vanish after this phase of a round (fit, share or mask)");

  simulate_ = fl_->add_subcommand("simulate", "Start a server and N client processes on loopback (plaintext), run "
                                              "the rounds, stop everything");
  simulate_->add_option("config", config_, "TOML config (as for fl server)")->required();
  simulate_->add_option("--clients", simulate_clients_, "Clients (the largest client directories): processes, or "
                                                         "with --pool threads of one process")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  simulate_->add_option("--split-text", simulate_text_,
                        "Split this play script by speaker into <out>/clients first (and validate on its val.bin)");
  simulate_->add_option("--pool", simulate_pool_,
                        "Run the clients as threads of this process sharing this many trainers, each client's data "
                        "read only while it trains (thousands of clients; 0: a process per client, at most 250)")
      ->check(CLI::Range(0, 1024));
  simulate_->add_option("--slow-clients", simulate_slow_fraction_,
                        "This share of the clients, spread over the list, run --slow-factor times slower (stragglers)")
      ->check(CLI::Range(0.0, 1.0));
  simulate_->add_option("--slow-factor", simulate_slow_factor_, "How much slower the --slow-clients are")
      ->check(CLI::Range(1.0, 1000.0))
      ->capture_default_str();
  simulate_->add_option("--timeout", simulate_timeout_, "Seconds before everything is stopped")->capture_default_str();
  simulate_->allow_extras();
  simulate_->footer("Overrides, as for fl server (`meshtrain fl server --help-config` lists the keys): --fl.rounds=3 "
                    "--fl.aggregation=median --fl.server.out=runs/fl-median ... Example: meshtrain fl simulate "
                    "--clients 6 examples/fl/shakespeare.toml --split-text tests/data/shakespeare_excerpt.txt");

  split_ = fl_->add_subcommand("split", "Split a play script into client directories (train.bin each) and val.bin");
  split_->add_option("text", split_text_, "The text (e.g. tinyshakespeare.txt)")->required();
  split_->add_option("--out", split_out_, "Output directory")->required();
  split_->add_option("--by", split_options_.by, "speaker (one client per role), iid, or dirichlet (over speakers)")
      ->check(CLI::IsMember({"speaker", "iid", "dirichlet"}))
      ->capture_default_str();
  split_->add_option("--clients", split_options_.clients, "iid/dirichlet: number of clients")->capture_default_str();
  split_->add_option("--alpha", split_options_.alpha, "dirichlet: concentration (small: skewed)")->capture_default_str();
  split_->add_option("--seed", split_options_.seed, "Shuffle seed")->capture_default_str();
  split_->add_option("--data.val_fraction,--val-fraction", split_options_.val_fraction,
                     "Share of each client's text held out for validation (as train's data.val_fraction), as its last "
                     "speeches, pooled into val.bin")
      ->capture_default_str();
  split_->add_option("--min-bytes", split_options_.min_bytes, "Clients with less training text are left out")
      ->capture_default_str();

  plot_ = fl_->add_subcommand("plot", "Validation loss against cumulative uplink bytes of metrics.jsonl files, as SVG");
  plot_->add_option("metrics", plot_inputs_, "metrics.jsonl files (one line each, named by their label)")->required();
  plot_->add_option("-o,--out", plot_out_, "SVG file")->capture_default_str();
  plot_->add_option("--title", plot_title_, "Title")->capture_default_str();

  privacy_ = fl_->add_subcommand("privacy", "The (epsilon, delta) of DP-FedAvg after R rounds (client-level, the "
                                            "accountant of fl.dp.noise_multiplier), to choose z before a run");
  privacy_->add_option("--fraction", privacy_fraction_, "q: the fraction of the clients sampled per round (fl.fraction)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  privacy_->add_option("--noise-multiplier", privacy_noise_, "z (fl.dp.noise_multiplier)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  privacy_->add_option("--rounds", privacy_rounds_, "R")->check(CLI::Range(int64_t{1}, int64_t{1} << 40))->capture_default_str();
  privacy_->add_option("--delta", privacy_delta_, "delta (fl.dp.delta)")->check(CLI::Range(1e-300, 0.999))->capture_default_str();
}

bool FlCli::chosen() const { return fl_->parsed(); }

std::vector<std::string> FlCli::overrides(CLI::App* sub) const {
  std::vector<std::string> out;
  for (const std::string& extra : sub->remaining()) {
    if (extra.rfind("--", 0) != 0 || extra.find('=') == std::string::npos)
      throw std::invalid_argument("unexpected argument '" + extra + "'; overrides look like --fl.rounds=3");
    out.push_back(extra.substr(2));
  }
  return out;
}

int FlCli::run_server() const {
  if (help_config_) {
    std::printf("%s", fl::FlConfig::describe_keys().c_str());
    return 0;
  }
  const fl::FlConfig config = fl::FlConfig::load(config_, overrides(server_));
  fl::Server server(config);
  std::fprintf(stderr, "fl server: listening on %s (port %d), %lld rounds of %s, %s\n", config.listen.c_str(),
               server.port(), static_cast<long long>(config.rounds), config.strategy.name.c_str(),
               config.tls.insecure ? "plaintext" : (config.tls.mutual ? "mutual TLS" : "TLS"));
  char clip[96];
  if (config.secagg) std::snprintf(clip, sizeof clip, "+-%g per value in the ring (weights as clients claim them)", config.clip);
  else if (config.clip_auto) std::snprintf(clip, sizeof clip, "%g x the round's median norm", config.clip_factor);
  else if (config.clip_norm > 0) std::snprintf(clip, sizeof clip, "%g", config.clip_norm);
  else std::snprintf(clip, sizeof clip, "(none)");
  std::fprintf(stderr, "fl server: bounds: results <= %.1f MiB, updates clipped to %s, %s, rounds raising the "
               "validation loss by > %g rolled back%s\n",
               static_cast<double>(config.max_message_bytes()) / (1 << 20), clip, config.aggregation.name.c_str(),
               config.max_regression, config.dp() ? (", DP-FedAvg z = " + std::to_string(config.noise_multiplier)).c_str() : "");
  if (!port_file_.empty()) util::write_text_file(port_file_, std::to_string(server.port()) + "\n");
  const int failed = server.run();
  std::fprintf(stderr, "fl server: done (%d failed rounds); metrics in %s/metrics.jsonl, picture in %s/loss.svg\n",
               failed, config.out.c_str(), config.out.c_str());
  return 0;
}

// The simulation's clients: processes, or with --pool their options in
// `*pooled` (Note [A pool of clients]); every 1/fraction-th is slow:
// floor((i + 1) f) > floor(i f).
std::vector<pid_t> FlCli::start_clients(const std::string& self, const std::string& address,
                                        const fl::FlConfig& config, const std::vector<std::string>& dirs,
                                        const std::string& token, std::vector<fl::ClientOptions>* pooled) const {
  std::vector<pid_t> clients;
  for (int i = 0; i < simulate_clients_; ++i) {
    const bool slow = std::floor((i + 1) * simulate_slow_fraction_) > std::floor(i * simulate_slow_fraction_);
    if (simulate_pool_ > 0) {
      fl::ClientOptions o;
      o.id = dirs[i];
      o.server = address;
      o.data = config.clients_dir + "/" + dirs[i];
      o.tls.insecure = true;
      o.quiet = true;
      o.join_token = token;
      if (slow) o.slow_factor = simulate_slow_factor_;
      pooled->push_back(std::move(o));
      continue;
    }
    std::vector<std::string> args{self, "fl", "client", "--server", address, "--insecure", "--id", dirs[i], "--data",
                                  config.clients_dir + "/" + dirs[i]};
    if (!config.join_token_file.empty()) args.insert(args.end(), {"--join-token-file", config.join_token_file});
    if (slow) args.insert(args.end(), {"--slow-factor", std::to_string(simulate_slow_factor_)});
    clients.push_back(spawn(args));
  }
  return clients;
}

int FlCli::run_simulate(const char* argv0) const {
  std::error_code error;
  const std::string found = std::filesystem::read_symlink("/proc/self/exe", error).string();
  const std::string self = found.empty() ? argv0 : util::executable_now_at(found);
  std::vector<std::string> extra = overrides(simulate_);
  extra.push_back("fl.server.listen=127.0.0.1:0");
  extra.push_back("fl.server.insecure=true");
  fl::FlConfig config = fl::FlConfig::load(config_, extra);
  if (!simulate_text_.empty()) {
    const std::string dir = config.out + "/clients";
    const fl::SplitSummary s = fl::write_split(simulate_text_, dir, fl::SplitOptions{});
    std::fprintf(stderr, "fl simulate: split %s by speaker: %lld clients in %s\n", simulate_text_.c_str(),
                 static_cast<long long>(s.clients), dir.c_str());
    extra.push_back("fl.data.clients_dir=" + dir);
    if (config.val_file.empty()) extra.push_back("fl.data.val_file=" + dir + "/val.bin");
    config = fl::FlConfig::load(config_, extra);
  }
  if (config.clients_dir.empty())
    throw std::invalid_argument("fl simulate: set [fl.data] clients_dir (a directory from `meshtrain fl split`) or "
                                "pass --split-text FILE");
  const std::vector<std::string> dirs = client_dirs(config.clients_dir);
  if (simulate_pool_ == 0 && simulate_clients_ > 250)
    throw std::invalid_argument("fl simulate: --clients " + std::to_string(simulate_clients_) + " is more than 250 "
                                "client processes: add --pool 2 to run them as threads sharing 2 trainers");
  if (static_cast<int>(dirs.size()) < simulate_clients_)
    throw std::invalid_argument("fl simulate: --clients " + std::to_string(simulate_clients_) + " but " +
                                config.clients_dir + " holds " + std::to_string(dirs.size()) + " client directories");
  util::make_directories(config.out);
  const std::string port_file = config.out + "/server.port";
  std::filesystem::remove(port_file);
  std::vector<std::string> server_args{self, "fl", "server", config_, "--port-file", port_file};
  for (const auto& o : extra) server_args.push_back("--" + o);
  // One intra-op thread share per process, as the launcher does for ranks:
  // oversubscribed OpenMP pools spin against each other.
  if (!std::getenv("OMP_NUM_THREADS")) {
    const unsigned cores = util::process_cores();
    const unsigned processes = simulate_pool_ > 0 ? static_cast<unsigned>(simulate_pool_) : simulate_clients_;
    setenv("OMP_NUM_THREADS", std::to_string(std::max(1u, cores / (processes + 1u))).c_str(), 1);
  }
  // Read before anything starts: a bad token file is one message, not one per client.
  const std::string token = config.join_token_file.empty() ? "" : fl::read_join_token(config.join_token_file);
  const pid_t server = spawn(server_args);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  int status = 0;
  while (!util::is_regular_file(port_file) || util::read_text_file(port_file).empty()) {
    if (waitpid(server, &status, WNOHANG) == server)
      throw std::runtime_error("fl simulate: the server exited before listening (see its error above)");
    if (elapsed() > 60) throw std::runtime_error("fl simulate: the server did not start listening within 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string address = "127.0.0.1:" + std::to_string(std::stoi(util::read_text_file(port_file)));
  std::vector<fl::ClientOptions> pooled;
  const std::vector<pid_t> clients = start_clients(self, address, config, dirs, token, &pooled);
  int pool_status = 0;
  std::thread pool;
  if (!pooled.empty()) {
    std::fprintf(stderr, "fl simulate: %zu clients as threads of this process, sharing %d trainers\n", pooled.size(),
                 simulate_pool_);
    pool = std::thread([&] { pool_status = fl::run_client_pool(std::move(pooled), simulate_pool_); });
  }
  // The server ends the federation; the clients follow at its STOP.
  while (waitpid(server, &status, WNOHANG) != server) {
    if (elapsed() > simulate_timeout_) {
      kill(server, SIGTERM);
      waitpid(server, &status, 0);
      status = 1 << 8;
      std::fprintf(stderr, "fl simulate: stopped after --timeout %g s\n", simulate_timeout_);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (pid_t c : clients) {
    int client_status = 0;
    for (int k = 0; k < 100 && waitpid(c, &client_status, WNOHANG) != c; ++k)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (kill(c, 0) == 0) {
      kill(c, SIGTERM);
      waitpid(c, &client_status, 0);
    }
  }
  if (pool.joinable()) pool.join();  // the clients end at the server's STOP, or when they cannot reach it
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && pool_status == 0;
  std::fprintf(stderr, "fl simulate: %s in %.1f s; metrics in %s/metrics.jsonl, picture in %s/loss.svg\n",
               ok ? "finished" : "FAILED", elapsed(), config.out.c_str(), config.out.c_str());
  return ok ? 0 : 1;
}

int FlCli::dispatch(const char* self) const {
  if (server_->parsed()) return run_server();
  if (simulate_->parsed()) return run_simulate(self);
  if (client_->parsed()) {
    fl::ClientOptions options = client_options_;
    options.tls.ca = client_ca_;
    options.tls.cert = client_cert_;
    options.tls.key = client_key_;
    options.tls.mutual = !client_cert_.empty();
    options.tls.insecure = client_insecure_;
    if (!client_token_file_.empty()) options.join_token = fl::read_join_token(client_token_file_);
    options.leave_on_signal = true;  // Ctrl-C or SIGTERM: say goodbye to the server, exit 0
    if (!options.tls.insecure && options.tls.ca.empty())
      throw std::invalid_argument("fl client: give --ca (the server's CA certificate) for TLS, or --insecure to a "
                                  "loopback address");
    if (client_cert_.empty() != client_key_.empty()) throw std::invalid_argument("fl client: --cert needs --key");
    return fl::run_client(options);
  }
  if (privacy_->parsed()) {
    std::printf("epsilon = %.6g at delta = %g after %lld rounds (q = %g, z = %g)\n",
                fl::dp_epsilon(privacy_fraction_, privacy_noise_, privacy_rounds_, privacy_delta_), privacy_delta_,
                static_cast<long long>(privacy_rounds_), privacy_fraction_, privacy_noise_);
    return 0;
  }
  if (split_->parsed()) {
    const fl::SplitSummary s = fl::write_split(split_text_, split_out_, split_options_);
    std::printf("fl split: %lld clients (%lld left out under --min-bytes), %lld training bytes, %lld validation bytes "
                "in %s\n",
                static_cast<long long>(s.clients), static_cast<long long>(s.dropped),
                static_cast<long long>(s.train_bytes), static_cast<long long>(s.val_bytes), split_out_.c_str());
    return 0;
  }
  util::write_text_file(plot_out_, fl::loss_svg(fl::read_series(plot_inputs_), plot_title_));
  std::printf("fl plot: wrote %s\n", plot_out_.c_str());
  return 0;
}

CommandPtr add_fl(CLI::App& app, const char* self) { return std::make_unique<FlCli>(app, self); }

}  // namespace meshtrain::apps
