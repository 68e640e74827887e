// meshtrain train / prepare.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/run_lock.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"

#include <atomic>
#include <csignal>
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
}

}  // namespace

int run_train(comm::Runtime& runtime, const std::string& config_path, const std::vector<std::string>& overrides) {
  train::TrainConfig config = train::TrainConfig::load(config_path, overrides);
  config.validate(runtime.size());
  install_stop_handlers();
  const auto locks = train::lock_run_folders(*runtime.world(), config);  // Note [Run lock]
  train::Trainer trainer(std::move(config), runtime.world());
  trainer.run(&g_stop);
  return 0;
}

int run_prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                const std::string& tokenizer) {
  const train::PrepareResult result = train::prepare(inputs, out_dir, val_fraction, tokenizer);
  std::printf("meshtrain prepare: %zu file(s) -> %s (%lld tokens), %s (%lld tokens)\n", result.sources.size(),
              result.train_path.c_str(), static_cast<long long>(result.train_tokens), result.val_path.c_str(),
              static_cast<long long>(result.val_tokens));
  return 0;
}

CommandPtr add_train(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train a GPT: meshtrain train [CONFIG.toml] [--section.key=value ...]. Without a config the built-in "
               "defaults train `small` on /usr/share/common-licenses.");
  sub->add_option("config", *config, "TOML config file (sections as listed below)")->check(CLI::ExistingFile);
  allow_config_overrides(*sub);
  sub->footer("Overrides: --section.key=value, e.g. --training.steps=20 --model.preset=tiny\n"
              "Keys and defaults:" + train::TrainConfig::describe_keys());
  return command(sub, [config, sub](comm::Runtime& runtime) { return run_train(runtime, *config, config_overrides(*sub)); });
}

CommandPtr add_prepare(CLI::App& app) {
  struct Args {
    std::vector<std::string> inputs;
    std::string out = "data", tokenizer = "bytes";
    double val_fraction = 0.1;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("prepare", "Turn text files or directories into token files (train.bin, val.bin)");
  sub->add_option("inputs", a->inputs, "Text files or directories")->required();
  sub->add_option("--out", a->out, "Output directory")->capture_default_str();
  sub->add_option("--tokenizer", a->tokenizer,
                  "bytes, a SentencePiece .model, a tokenizer.json, or a folder with vocab.json + merges.txt")
      ->capture_default_str();
  sub->add_option("--val-fraction", a->val_fraction, "Share of tokens held out for validation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  return plain_command(sub, [a] { return run_prepare(a->inputs, a->out, a->val_fraction, a->tokenizer); });
}

}  // namespace meshtrain::apps
