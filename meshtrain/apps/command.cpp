#include "meshtrain/apps/command.h"

#include <map>

#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/job_environment.h"
#include "meshtrain/plan/layout.h"
#include "meshtrain/util/config_keys.h"
#include "meshtrain/util/suggest.h"
#include "meshtrain/util/cores.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>

namespace meshtrain::apps {

namespace {

// The message without libtorch's "Exception raised from ..." trailer.
const char* error_text(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

int report(const std::exception& e) {
  std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
  return dynamic_cast<const UsageError*>(&e) ? 2 : 1;
}

// One rank per core: libtorch's intra-op pool would otherwise oversubscribe the
// cores when several ranks share a node. OMP_NUM_THREADS, when set, wins.
void set_threads_per_rank(const comm::Runtime& runtime) {
  if (std::getenv("OMP_NUM_THREADS")) return;
  at::set_num_threads(util::threads_per_rank(runtime.local_size()));
}

class FunctionCommand : public Command {
 public:
  FunctionCommand(const CLI::App* sub, std::function<int(comm::Runtime&)> on_ranks, std::function<int()> plain)
      : sub_(sub), on_ranks_(std::move(on_ranks)), plain_(std::move(plain)) {}
  bool chosen() const override { return sub_->parsed(); }
  bool on_ranks() const override { return static_cast<bool>(on_ranks_); }
  int run(comm::Runtime* runtime) override { return runtime ? on_ranks_(*runtime) : plain_(); }

 private:
  const CLI::App* sub_;
  std::function<int(comm::Runtime&)> on_ranks_;
  std::function<int()> plain_;
};

int run_on_ranks(Command& command, int& argc, char**& argv) {
  command.before_ranks();
  std::optional<comm::Runtime> runtime;
  try {
    runtime.emplace(&argc, &argv);
    comm::check_job_environment();  // Note [Job environment]
    set_threads_per_rank(*runtime);
    return command.run(&*runtime);
  } catch (const std::exception& e) {
    const bool agreed = dynamic_cast<const comm::AgreedError*>(&e) || dynamic_cast<const config::ConfigError*>(&e) ||
                        dynamic_cast<const UsageError*>(&e);  // every rank parsed the same command line
    if (agreed || !runtime || runtime->size() == 1) {
      if (!runtime || runtime->rank() == 0) return report(e);
      return dynamic_cast<const UsageError*>(&e) ? 2 : 1;
    }
    // This rank alone: the others may be waiting for it in a collective.
    runtime->abort(1, std::string("error: ") + error_text(e));
  }
}

}  // namespace

CommandPtr command(const CLI::App* sub, std::function<int(comm::Runtime&)> run) {
  return std::make_unique<FunctionCommand>(sub, std::move(run), nullptr);
}

CommandPtr plain_command(const CLI::App* sub, std::function<int()> run) {
  return std::make_unique<FunctionCommand>(sub, nullptr, std::move(run));
}

void allow_config_overrides(CLI::App& sub) { sub.allow_extras(); }

std::vector<std::string> config_overrides(const CLI::App& sub) {
  std::vector<std::string> overrides;
  for (const std::string& extra : sub.remaining()) {
    if (extra.rfind("--", 0) != 0 || extra.find('=') == std::string::npos) {
      throw UsageError("unexpected argument '" + extra + "'; overrides look like --training.steps=20");
    }
    overrides.push_back(extra.substr(2));
  }
  return overrides;
}

CLI::App* add_timed_bench(CLI::App& bench, const std::string& name, const std::string& help, TimedSteps& steps) {
  CLI::App* sub = bench.add_subcommand(name, help);
  sub->add_option("--warmup-steps", steps.warmup, "Untimed steps first")->capture_default_str();
  sub->add_option("--steps", steps.steps, "Timed steps (the median is reported)")->check(CLI::PositiveNumber)->capture_default_str();
  allow_config_overrides(*sub);
  return sub;
}

CommandPtr timed_bench_command(CLI::App& bench, const std::string& name, const std::string& help, TimedSteps defaults,
                               TimedBenchRun run) {
  auto steps = std::make_shared<TimedSteps>(defaults);
  CLI::App* sub = add_timed_bench(bench, name, help, *steps);
  return command(sub, [steps, sub, run = std::move(run)](comm::Runtime& runtime) {
    return run(runtime, config_overrides(*sub), steps->warmup, steps->steps);
  });
}

int64_t parse_size(const std::string& text) { return static_cast<int64_t>(plan::parse_bytes(text)); }

std::vector<std::string> normalized_arguments(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool dotted_key = a.size() > 3 && a.rfind("--", 0) == 0 && a.find('=') == std::string::npos &&
                            a.find('.') != std::string::npos && a.find_first_of(" /") == std::string::npos;
    if (dotted_key && i + 1 < args.size() && args[i + 1].rfind("-", 0) != 0) {
      out.push_back(a + "=" + args[++i]);
    } else {
      out.push_back(a);
    }
  }
  return out;
}

namespace {

// An option the command `at` does not have, with the nearest it has
// (`serve --chekpoint` would otherwise read "--checkpoint is required"). A
// command that takes config overrides (extras) checks its keys itself.
int refuse_unknown_option(const CLI::App& at, const std::string& path, const std::vector<std::string>& args, size_t from) {
  if (at.get_allow_extras() || at.get_prefix_command()) return 0;  // run: what follows is another command
  for (size_t i = from; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") return 0;
    if (a.rfind("--", 0) != 0 || a.size() < 3) continue;
    const std::string name = a.substr(0, a.find('='));
    if (at.get_option_no_throw(name) != nullptr || name == "--help") continue;
    std::vector<std::string> names;
    for (const CLI::Option* o : at.get_options()) {
      for (const std::string& l : o->get_lnames()) names.push_back("--" + l);
    }
    std::fprintf(stderr, "meshtrain: error: %s has no option %s%s; `%s --help` lists them\n", path.c_str(),
                 name.c_str(), util::did_you_mean(name, names).c_str(), path.c_str());
    return 2;
  }
  return 0;
}

}  // namespace

int refuse_unknown_command(const CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* at = &app;
  std::string path = "meshtrain";
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    const std::vector<const CLI::App*> subs = at->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) return refuse_unknown_option(*at, path, args, i);  // the rest is this command's own
    if (a.rfind("-", 0) == 0) {
      if (a != "--help" && a != "-h") return 0;  // an option of a group: leave it to the parser
      continue;
    }
    const CLI::App* next = nullptr;
    std::vector<std::string> names;
    for (const CLI::App* sub : subs) {
      names.push_back(sub->get_name());
      if (sub->check_name(a)) next = sub;
    }
    if (!next) {
      std::fprintf(stderr, "meshtrain: error: unknown command '%s'%s; `%s --help` lists them\n", a.c_str(),
                   util::did_you_mean(a, names).c_str(), path.c_str());
      return 2;
    }
    at = next;
    path += " " + a;
  }
  return 0;
}

namespace {

std::map<std::string, LaunchNeeds>& declared_needs() {
  static std::map<std::string, LaunchNeeds> needs;
  return needs;
}

}  // namespace

void declare_launch_needs(const std::string& command, LaunchNeeds needs) { declared_needs()[command] = needs; }

LaunchNeeds launch_needs_of(const std::string& command) {
  const auto found = declared_needs().find(command);
  return found == declared_needs().end() ? LaunchNeeds{} : found->second;
}

int run_chosen(const Commands& commands, int& argc, char**& argv) {
  for (const CommandPtr& c : commands) {
    if (!c->chosen()) continue;
    if (c->on_ranks()) return run_on_ranks(*c, argc, argv);
    try {
      return c->run(nullptr);
    } catch (const std::exception& e) {
      return report(e);
    }
  }
  std::fprintf(stderr, "meshtrain: error: no command given (meshtrain --help lists them)\n");
  return 2;
}

}  // namespace meshtrain::apps
