// The command line of federated learning: meshtrain fl server | client |
// simulate | split | plot (no MPI).
#pragma once

#include "meshtrain/apps/command.h"
#include "meshtrain/fl/client.h"
#include "meshtrain/fl/split.h"

#include <CLI/CLI.hpp>

#include <sys/types.h>

#include <string>
#include <vector>

namespace meshtrain::apps {

// fl runs as one process (no MPI); `self` is this executable (simulate starts copies of it).
class FlCli : public Command {
 public:
  FlCli(CLI::App& app, const char* self);
  bool chosen() const override;
  bool on_ranks() const override { return false; }
  int run(comm::Runtime*) override { return dispatch(self_); }

 private:
  int dispatch(const char* self) const;
  int run_server() const;
  int run_simulate(const char* self) const;
  std::vector<pid_t> start_clients(const std::string& self, const std::string& address, const fl::FlConfig& config,
                                   const std::vector<std::string>& dirs, const std::string& token,
                                   std::vector<fl::ClientOptions>* pooled) const;
  std::vector<std::string> overrides(CLI::App* sub) const;

  const char* self_;
  CLI::App *fl_ = nullptr, *server_ = nullptr, *client_ = nullptr, *simulate_ = nullptr, *split_ = nullptr,
           *plot_ = nullptr, *privacy_ = nullptr;
  std::string config_, port_file_;
  bool help_config_ = false;
  fl::ClientOptions client_options_;
  std::string client_ca_, client_cert_, client_key_, client_token_file_;
  bool client_insecure_ = false;
  int simulate_clients_ = 4;
  std::string simulate_text_;
  double simulate_timeout_ = 3600;
  double simulate_slow_fraction_ = 0, simulate_slow_factor_ = 10;  // --slow-clients, --slow-factor
  int simulate_pool_ = 0;  // --pool: trainers shared by clients on threads (0: a process per client)
  std::string split_text_, split_out_;
  fl::SplitOptions split_options_;
  std::vector<std::string> plot_inputs_;
  std::string plot_out_ = "fl_loss.svg", plot_title_ = "Validation loss against uplink bytes";
  double privacy_fraction_ = 1, privacy_noise_ = 1, privacy_delta_ = 1e-5;
  int64_t privacy_rounds_ = 20;
};

}  // namespace meshtrain::apps
