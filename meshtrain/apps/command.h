// Command: one subcommand of the meshtrain executable, declared on the
// command line and run by the file that implements it, and the one error
// boundary every command runs inside. See Note [Commands].
#pragma once

#include "meshtrain/comm/runtime.h"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::apps {

// Note [Commands]
// Each subcommand (or a family: import, export and logits) lives in its own
// file under apps/ and is made by an add_*
// function there (commands.h lists them): it declares its options on the
// CLI11 app and returns a Command that knows whether the command line chose
// it, whether it runs on the ranks of an MPI job or as one plain process, and
// how to run. main() parses, then hands the chosen one to run_chosen(), the
// one error boundary:
//   - a plain process prints its error once ("meshtrain: error: ...") and
//     exits 1 (a UsageError exits 2);
//   - on ranks, a Runtime (MPI) comes up first; an error every rank raised
//     alike (comm::AgreedError, config::ConfigError) is printed once by rank 0
//     and every rank exits 1; an error of one rank alone aborts the job,
//     since the others may be waiting for it in a collective.
class Command {
 public:
  virtual ~Command() = default;
  // Whether the command line named this command.
  virtual bool chosen() const = 0;
  // Whether it runs on the ranks of an MPI job (with a Runtime); else as one
  // process without MPI. Asked after parsing.
  virtual bool on_ranks() const { return true; }
  // Just before MPI comes up (and starts its threads).
  virtual void before_ranks() {}
  // Runs it; `runtime` is null when !on_ranks(). Returns the exit status.
  virtual int run(comm::Runtime* runtime) = 0;
};
using CommandPtr = std::unique_ptr<Command>;
using Commands = std::vector<CommandPtr>;

// What `meshtrain run` must know of a command it launches, as the command
// declares it when it is added (declare_launch_needs), not by the launcher
// knowing commands by name: what Ctrl-C and SIGTERM mean to its ranks, and
// whether a lost rank may be answered by relaunching it.
struct LaunchNeeds {
  enum class OnStop {
    kEnd,    // forwarded as it is: the ranks end
    kDrain,  // the requests in flight are finished first (serve)
    kSave,   // a preemption: a checkpoint at the next step, then exit 0 (train)
  };
  OnStop on_stop = OnStop::kEnd;
  bool restartable = false;  // it resumes where it stopped: --max-restarts may relaunch it
};
void declare_launch_needs(const std::string& command, LaunchNeeds needs);
LaunchNeeds launch_needs_of(const std::string& command);  // the declared needs, else the defaults

// A command line that does not parse as the command wants: exit status 2.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A Command chosen when `sub` was parsed, running `run` (with a Runtime when `on_ranks`).
CommandPtr command(const CLI::App* sub, std::function<int(comm::Runtime&)> run);
CommandPtr plain_command(const CLI::App* sub, std::function<int()> run);

// Lets `sub` take config overrides (--section.key=value) after its options.
void allow_config_overrides(CLI::App& sub);
// The overrides `sub` was given, as "section.key=value"; throws UsageError
// for an argument that is not one.
std::vector<std::string> config_overrides(const CLI::App& sub);

// Warm-up and timed steps of a bench that trains; the defaults are the
// values `steps` holds when it is added.
struct TimedSteps {
  int warmup = 2;
  int steps = 12;
};
// A subcommand of `bench` with --warmup-steps and --steps into `steps`, and
// config overrides as for train after them.
CLI::App* add_timed_bench(CLI::App& bench, const std::string& name, const std::string& help, TimedSteps& steps);

// A bench that trains and takes nothing else: run(runtime, overrides, warmup, steps).
using TimedBenchRun = std::function<int(comm::Runtime&, const std::vector<std::string>&, int, int)>;
CommandPtr timed_bench_command(CLI::App& bench, const std::string& name, const std::string& help, TimedSteps defaults,
                               TimedBenchRun run);

// "16M" and the like (plan::parse_bytes) as a whole number of bytes.
int64_t parse_size(const std::string& text);

// The command line as a person may type it, made what the parser reads:
// "--section.key value" becomes "--section.key=value" (a config key always
// takes a value; "--training.steps 20" was read as a config file named 20).
std::vector<std::string> normalized_arguments(int argc, char** argv);

// A word where `app` expects one of its subcommands that names none of them:
// "unknown command 'trian' (did you mean train?)" to stderr, and 2. Else 0.
int refuse_unknown_command(const CLI::App& app, const std::vector<std::string>& args);

// Runs the chosen command inside the error boundary; returns the exit status.
int run_chosen(const Commands& commands, int& argc, char**& argv);

}  // namespace meshtrain::apps
