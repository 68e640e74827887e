// meshtrain train / prepare.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/prepare.h"
#include "meshtrain/train/run_lock.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"

#include <atomic>
#include <memory>
#include <csignal>
#include <algorithm>
#include <cstdio>

namespace meshtrain::apps {

namespace {

// The stop request of Note [Preemption]: the number of the first signal.
std::atomic<int> g_stop{0};

void request_stop(int signal) {
  int none = 0;
  g_stop.compare_exchange_strong(none, signal);
}

// SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 ask the ranks to stop at the next step
// boundary with a checkpoint; a second SIGINT or SIGTERM ends the process at
// once (the handler is reset after its first signal).
void install_stop_handlers() {
  for (int signal : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) {
    struct sigaction action {};
    action.sa_handler = request_stop;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | (signal == SIGTERM || signal == SIGINT ? SA_RESETHAND : 0);
    sigaction(signal, &action, nullptr);
  }
  // A file size limit (ulimit -f) makes a write fail with EFBIG, which a save
  // reports and cleans up after (Note [Failed saves]), instead of killing the rank.
  std::signal(SIGXFSZ, SIG_IGN);
  // A stop `meshtrain run` received before this rank could hear it, e.g. while
  // it was starting mpirun, is written down there (Note [Naming the stop
  // signal]): taken now, as if it had been passed on.
  if (!train::launcher_stop_signal().empty()) request_stop(SIGUSR2);
}

}  // namespace

int run_train(comm::Runtime& runtime, const std::string& config_path, const std::vector<std::string>& overrides,
              const train::Relaunch& relaunch) {
  install_stop_handlers();  // first: a stop that comes while the config loads is kept for the first step
  // What a timeout or a crash before the first step names (Note [Fatal signals]).
  auto start_up = std::make_unique<comm::WatchdogContext>("start-up (config, data, model)");
  train::TrainConfig config = train::TrainConfig::load(config_path, overrides);
  config.validate(runtime.size());
  const auto locks = train::lock_run_folders(*runtime.world(), config);  // Note [Run lock]
  train::Trainer trainer(std::move(config), runtime.world(), relaunch);
  start_up.reset();
  trainer.run(&g_stop);
  return 0;
}

int run_prepare(comm::Runtime& runtime, const train::PrepareOptions& options) {
  comm::Communicator& world = *runtime.world();
  const train::PrepareResult r = train::prepare(options, &world);
  if (world.rank() != 0) return 0;
  if (r.reused) {
    std::printf("meshtrain prepare: %s already holds this preparation (%lld + %lld tokens); nothing to do\n",
                options.out_dir.c_str(), static_cast<long long>(r.train_tokens), static_cast<long long>(r.val_tokens));
    return 0;
  }
  const double tokens = static_cast<double>(r.train_tokens + r.val_tokens);
  std::printf("meshtrain prepare: %zu file(s), %lld unit(s)%s on %d rank(s) -> %s (%lld tokens, %lld documents), "
              "%s (%lld tokens, %lld documents); %d byte(s) per token\n",
              r.sources.size(), static_cast<long long>(r.units),
              r.resumed_units ? (", " + std::to_string(r.resumed_units) + " finished before").c_str() : "",
              world.size(), r.train_path.c_str(), static_cast<long long>(r.train_tokens),
              static_cast<long long>(r.train_documents), r.val_path.c_str(), static_cast<long long>(r.val_tokens),
              static_cast<long long>(r.val_documents), r.token_bytes);
  if (r.train_counted != r.train_tokens) {
    std::printf("meshtrain prepare: %lld of the training tokens count toward the loss (a mask beside each file)\n",
                static_cast<long long>(r.train_counted));
  }
  std::printf("meshtrain prepare: %.2f s (tokenizing %.2f s: %.0f tokens/s, %.0f per rank); peak memory %.0f MiB per rank\n",
              r.seconds, r.tokenize_seconds, tokens / std::max(r.tokenize_seconds, 1e-9),
              tokens / std::max(r.tokenize_seconds, 1e-9) / world.size(), r.peak_rss_mb);
  return 0;
}

CommandPtr add_train(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train a GPT: meshtrain train [CONFIG.toml] [--section.key=value ...]. Without a config the built-in "
               "defaults train `small` on /usr/share/common-licenses.");
  sub->add_option("config", *config, "TOML config file (sections as listed below)")->check(CLI::ExistingFile);
  allow_config_overrides(*sub);
  // SIGTERM is a preemption (a checkpoint, then exit 0), and a run resumes from its latest checkpoint.
  declare_launch_needs("train", {LaunchNeeds::OnStop::kSave, /*restartable=*/true});
  // What `meshtrain run --max-restarts` tells a relaunched job (Note [Restarts]); not listed in --help.
  auto relaunch = std::make_shared<train::Relaunch>();
  sub->add_option(std::string("--") + kRelaunchAttempt, relaunch->attempt)->group("");
  sub->add_option(std::string("--") + kRelaunchCause, relaunch->cause)->group("");
  sub->add_option(std::string("--") + kRelaunchRanksBefore, relaunch->ranks_before)->group("");
  sub->footer("Overrides: --section.key=value, e.g. --training.steps=20 --model.preset=tiny\n"
              "Keys and defaults:" + train::TrainConfig::describe_keys());
  return command(sub, [config, sub, relaunch](comm::Runtime& runtime) {
    return run_train(runtime, *config, config_overrides(*sub), *relaunch);
  });
}

CommandPtr add_prepare(CLI::App& app) {
  struct Args {
    train::PrepareOptions o;
    std::string format = "text", loss_on = "assistant";
  };
  auto a = std::make_shared<Args>();
  a->o.out_dir = "runs/data";  // beside the runs, out of the working tree (.gitignore has runs/)
  CLI::App* sub = app.add_subcommand(
      "prepare", "Tokenize text files, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files and folders of them "
                 "into token files (train.bin, val.bin, with a document index and, for chat data, a loss mask). "
                 "Under `meshtrain run -n N` the ranks share the work; the output is the same for any N, and an "
                 "interrupted run resumes where it stopped.");
  sub->add_option("inputs", a->o.inputs, "Files or folders (a folder with JSONL or Parquet files reads only those)")
      ->required();
  sub->add_option("--out", a->o.out_dir, "Output directory")->capture_default_str();
  // Each setting under train's config key (--data.tokenizer=...) and its dashed alias (--tokenizer ...).
  sub->add_option("--data.tokenizer,--tokenizer", a->o.tokenizer,
                  "bytes, a SentencePiece .model, a tokenizer.json, or a model folder (its chat template too)")
      ->capture_default_str();
  sub->add_option("--data.val_fraction,--val-fraction", a->o.val_fraction, "Share of tokens held out for validation (cut at a document start when one is near)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  sub->add_option("--data.format,--format", a->format, "text: documents of text; chat: records of \"messages\" or \"prompt\" + "
                                         "\"completion\", rendered with the tokenizer's chat template")
      ->check(CLI::IsMember({"text", "chat"}))
      ->capture_default_str();
  sub->add_option("--data.field,--field", a->o.field, "The JSONL / Parquet field holding a text record's text")->capture_default_str();
  sub->add_option("--data.loss_on,--loss-on", a->loss_on, "chat: assistant (only replies count toward the loss) or all")
      ->check(CLI::IsMember({"assistant", "all"}))
      ->capture_default_str();
  sub->add_option("--data.split_mb,--split-mb", a->o.split_mb, "Files are cut into units of this many MiB, the work one rank takes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  return command(sub, [a](comm::Runtime& runtime) {
    a->o.format = a->format == "chat" ? train::DataFormat::kChat : train::DataFormat::kText;
    a->o.loss_on = a->loss_on == "all" ? train::LossOn::kAll : train::LossOn::kAssistant;
    return run_prepare(runtime, a->o);
  });
}

}  // namespace meshtrain::apps
