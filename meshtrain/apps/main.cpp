// meshtrain: train transformer models split across many processes. Each
// subcommand lives in its own file under apps/ (Note [Commands]).
#include "meshtrain/apps/commands.h"
#include "meshtrain/util/fatal_signal.h"

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace {

const char* const kAbout =
    "meshtrain: train transformer models that do not fit on one device by splitting them across\n"
    "processes (data, fully sharded, tensor, pipeline, expert and context parallel on one device\n"
    "mesh), serve them (OpenAI-compatible completions and chat completions over HTTP), bring\n"
    "Hugging Face models in and out (GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE, Gemma 2,\n"
    "Phi-3, OLMo 2), and train them federated (`meshtrain fl`: a server and clients over\n"
    "gRPC/TLS, compressed updates, secure aggregation).\n"
    "Launch ranks with `meshtrain run -n 2 selfcheck`, plain mpirun/srun, or run one rank without a launcher.\n"
    "Environment: MESHTRAIN_COMM_TIMEOUT=seconds (watchdog, default 300), MESHTRAIN_DESYNC_CHECK=1\n"
    "(compare every collective's op, dtype and shape across ranks before running it).";

}  // namespace

int main(int argc, char** argv) {
  namespace apps = meshtrain::apps;
  meshtrain::util::install_fatal_signal_report();  // Note [Fatal signals]
  CLI::App app{kAbout};
  app.require_subcommand(1);
  apps::Commands commands;
  commands.push_back(apps::add_selfcheck(app));
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that print ratios against a peer measured in the same run");
  bench->require_subcommand(1);
  for (auto* add : {apps::add_bench_comm, apps::add_bench_train, apps::add_bench_graph, apps::add_bench_tp,
                    apps::add_bench_moe, apps::add_bench_pp, apps::add_bench_cp, apps::add_bench_checkpoint, apps::add_bench_offload,
                    apps::add_bench_generate}) {
    commands.push_back(add(*bench));
  }
  for (auto* add : {apps::add_timeline, apps::add_plan, apps::add_verify, apps::add_train, apps::add_prepare, apps::add_generate,
                    apps::add_serve, apps::add_import, apps::add_export, apps::add_export_peft, apps::add_tokenizer, apps::add_logits,
                    apps::add_checkpoint, apps::add_run, apps::add_submit}) {
    commands.push_back(add(app));
  }
  commands.push_back(apps::add_fl(app, argv[0]));
  std::vector<std::string> args = apps::normalized_arguments(argc, argv);
  if (const int status = apps::refuse_unknown_command(app, args)) return status;
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  pointers.push_back(nullptr);
  int count = static_cast<int>(args.size());
  char** words = pointers.data();
  CLI11_PARSE(app, count, words);
  return apps::run_chosen(commands, count, words);
}
