// meshtrain: train transformer models split across many processes.
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/fl_cli.h"
#include "meshtrain/apps/inference_cli.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/plan/layout.h"
#include "meshtrain/train/config.h"

#include <CLI/CLI.hpp>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <thread>

namespace {

// The message without libtorch's "Exception raised from ..." trailer.
const char* error_text(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

// One rank per core: libtorch's intra-op pool would otherwise oversubscribe the
// cores when several ranks share a node. OMP_NUM_THREADS, when set, wins.
void set_threads_per_rank(const meshtrain::comm::Runtime& runtime) {
  if (std::getenv("OMP_NUM_THREADS")) return;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(std::max(1, cores / std::max(1, runtime.local_size())));
}

int64_t parse_bytes(const std::string& text) { return static_cast<int64_t>(meshtrain::plan::parse_bytes(text)); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "meshtrain: train transformer models that do not fit on one device by splitting them across\n"
      "processes (data, fully sharded, tensor, pipeline and expert parallel on one device mesh), and\n"
      "serve them (an OpenAI-compatible HTTP API; Hugging Face GPT-2 and Llama models in and out), and\n"
      "train them federated (`meshtrain fl`: a server and clients over gRPC/TLS, compressed updates,\n"
      "secure aggregation).\n"
      "Launch ranks with `meshtrain run -n 2 selfcheck`, plain mpirun/srun, or run one rank without a launcher.\n"
      "Environment: MESHTRAIN_COMM_TIMEOUT=seconds (watchdog, default 300), MESHTRAIN_DESYNC_CHECK=1\n"
      "(compare every collective's op, dtype and shape across ranks before running it)."};
  app.require_subcommand(1);

  std::string selfcheck_bench_max = "16M";
  CLI::App* selfcheck = app.add_subcommand(
      "selfcheck", "Check every collective and dtype on all ranks against hand-computed values, then print a "
                   "bandwidth table");
  selfcheck->add_option("--bench-max-size", selfcheck_bench_max,
                        "Largest message of the bandwidth table (e.g. 16M; 0 skips the table)")
      ->capture_default_str();

  meshtrain::apps::CommBenchOptions bench_options;
  std::string min_size = "4K", max_size = "256M";
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that print ratios against a peer measured in the same run");
  bench->require_subcommand(1);
  CLI::App* bench_comm = bench->add_subcommand(
      "comm", "Bus bandwidth of all_reduce, reduce_scatter, all_gather and all_to_all, and the ratio to raw MPI on "
              "the same buffers");
  bench_comm->add_option("--min-size", min_size, "Smallest message, bytes with optional K/M/G")->capture_default_str();
  bench_comm->add_option("--max-size", max_size, "Largest message (sizes grow by 4x)")->capture_default_str();
  bench_comm->add_option("--trials", bench_options.trials, "Timed trials per side; medians are reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  bench_comm->add_option("--trial-seconds", bench_options.trial_seconds, "Target length of one trial")
      ->check(CLI::Range(0.001, 60.0))
      ->capture_default_str();
  bench_comm->add_option("--ops", bench_options.ops, "Ops to measure")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}))
      ->capture_default_str();
  bench_comm->add_option("--json", bench_options.json_path, "Also write each row as a JSON line to this file");
  // Benchmarks that train: untimed then timed steps (medians reported), config overrides as for train.
  auto timed_bench = [&](const std::string& name, const std::string& help, int& warmup, int& steps) {
    CLI::App* sub = bench->add_subcommand(name, help);
    sub->add_option("--warmup-steps", warmup, "Untimed steps first")->capture_default_str();
    sub->add_option("--steps", steps, "Timed steps (the median is reported)")->check(CLI::PositiveNumber)->capture_default_str();
    sub->allow_extras();
    return sub;
  };
  int bench_warmup = 2, bench_steps = 12;
  CLI::App* bench_train = timed_bench(
      "train", "Time training steps (config overrides as for train) and print tokens/s, MFU against the measured "
               "matmul peak, and the share of all-reduce time hidden behind backward, as one JSON line. "
               "bench/train_vs_pytorch.py runs it beside the PyTorch reference.",
      bench_warmup, bench_steps);
  std::string bench_profile;
  int bench_profile_steps = 3;
  bench_train
      ->add_option("--profile", bench_profile,
                   "After the timed steps, profile more steps with libtorch's profiler (rank 0): write DIR/trace.json "
                   "(Chrome trace), DIR/ops.json (each operator's self time per step) and print the largest")
      ->type_name("DIR");
  bench_train->add_option("--profile-steps", bench_profile_steps, "Steps to profile")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  int graph_warmup = 5, graph_steps = 20;
  CLI::App* bench_graph = timed_bench(
      "graph", "On one GPU: a training step whose forward and backward are captured once as a CUDA graph and "
               "replayed, against the same step run kernel by kernel; tokens/s of each, and the losses of both from "
               "the same start (the untimed steps), as one JSON line. Config overrides as for train (micro_batch "
               "sequences per step; model.dropout must be 0).",
      graph_warmup, graph_steps);
  int tp_warmup = 1, tp_steps = 5;
  CLI::App* bench_tp = timed_bench(
      "tp", "Tensor parallel with and without sequence parallel for tp = 1, 2, 4, ... up to the rank count, in one "
            "run, and from sharding annotations (tp_impl = annotations): bytes each rank sends per layer (counted by "
            "the communicator) against the formula, tokens/s against tp = 1, and annotations against the plan. "
            "Default model: small with 8 heads; config overrides as for train.",
      tp_warmup, tp_steps);
  int pp_warmup = 1, pp_steps = 3;
  int moe_warmup = 2, moe_steps = 8;
  CLI::App* bench_moe = timed_bench(
      "moe", "Mixture of experts in one run: one MoE layer (top-1 and top-2, experts split over the ranks) with the "
             "bytes each rank sends per step against the formula and its forward split into router + dispatch + "
             "combine, all-to-all and expert compute; then training tokens/s of MoE models against the dense model "
             "with the same active parameters and global batch. Default: small, 8 experts in every block, dropless; "
             "config overrides as for train.",
      moe_warmup, moe_steps);
  std::string pp_out = "bench/pipeline";
  CLI::App* bench_pp = timed_bench(
      "pp", "Pipeline schedules (gpipe, 1f1b, interleaved with 2 virtual stages) for pp = 2 and 4 (up to the rank "
            "count) and 4, 8, 16 micro-batches, in one run: the measured bubble (idle / step time per rank, from "
            "the executor's spans) against the theory, point-to-point time, tokens/s, and the peak activation "
            "memory of every stage for gpipe, 1f1b and 1f1b with full activation checkpointing. Writes a trace and "
            "a timeline picture of 1f1b with 8 micro-batches per pp to --out. Default model: tiny with 8 blocks; "
            "config overrides as for train.",
      pp_warmup, pp_steps);
  bench_pp->add_option("--out", pp_out, "Where traces and pictures go")->capture_default_str();
  int checkpoint_warmup = 2, checkpoint_steps = 5;
  CLI::App* bench_checkpoint = timed_bench(
      "checkpoint", "What saving a checkpoint costs the training loop, in one run: median times of a step alone, of a "
                    "save written in the background (checkpoint.async, the default) + a step + waiting for the write, "
                    "and of a save written in the loop + a step, taken in turn; the snapshot and write times; the "
                    "write against a raw write of the same bytes on the same disk. Config overrides as for train.",
      checkpoint_warmup, checkpoint_steps);

  meshtrain::apps::OffloadBenchOptions offload_bench;
  CLI::App* bench_offload = bench->add_subcommand(
      "offload", "Tiered memory, one JSON line per row: the host and NVMe tiers' bandwidth (the NVMe read against fio "
                 "on the same file), the fused CPU AdamW against torch::optim::AdamW, ZeRO-Inference decode tokens/s "
                 "per batch against the bound (streamed bytes / tier bandwidth), and training step time and memory "
                 "with the optimizer and parameters offloaded (bench/cpu_adam_vs_torch.py adds PyTorch's own AdamW)");
  bench_offload->add_option("--parts", offload_bench.parts, "Which parts")
      ->check(CLI::IsMember({"tiers", "adam", "inference", "training"}))
      ->capture_default_str();
  bench_offload->add_option("--nvme-dir", offload_bench.nvme_dir, "Folder on the disk to measure")->capture_default_str();
  bench_offload->add_option("--file-mb", offload_bench.file_mb, "Size of the NVMe test file")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench_offload->add_option("--trials", offload_bench.trials, "Timed trials (medians)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench_offload->add_option("--batches", offload_bench.batches, "Inference batch sizes")->capture_default_str();
  bench_offload->add_option("--json", offload_bench.json_path, "Also append the rows to this file");

  std::string timeline_trace, timeline_out, timeline_title = "pipeline timeline";
  CLI::App* timeline = app.add_subcommand(
      "timeline", "Draw a pipeline trace (trace.json written by train with --run.trace_step=N) as an SVG picture: one "
                  "row per rank, forwards blue, backwards green, waits to receive red, with each rank's bubble");
  timeline->add_option("trace", timeline_trace, "Chrome-trace JSON file")->required()->check(CLI::ExistingFile);
  timeline->add_option("-o,--out", timeline_out, "SVG file to write (default: the trace's name with .svg)");
  timeline->add_option("--title", timeline_title, "Title above the picture")->capture_default_str();

  std::string train_config;
  meshtrain::apps::PlanOptions plan_options;
  bool plan_calibrate = false;
  CLI::App* plan = app.add_subcommand(
      "plan", "Will it fit, and which layout is fastest? Predicts per-rank memory (parameters, gradients, optimizer "
              "states, activations, logits, buffers) and step time of every layout of --world ranks (dp, ZeRO 1-3, "
              "tp + sp, pp schedules, ep for MoE models, micro-batch, recompute, offload), drops those over "
              "--device-memory and ranks the rest; --layout explains one. Runs in one process; `meshtrain run -n 2 "
              "plan --calibrate` measures this machine instead.");
  plan->add_option("--model", plan_options.model,
                   "A preset (tiny, small, llama-tiny, gpt2-124m/350m/774m/1.5b, llama2-7b/13b/70b, llama3-8b/70b, "
                   "gpt3-175b, gpt-1t, mixtral-8x7b) or a meshtrain config file (.toml)")
      ->capture_default_str();
  plan->add_option("--world", plan_options.world, "Ranks (devices)")->capture_default_str()->check(CLI::PositiveNumber);
  plan->add_option("--device-memory", plan_options.device_memory, "Memory per device, e.g. 80GiB (default: the machine's)");
  plan->add_option("--gpus-per-node", plan_options.gpus_per_node, "Devices per node (tensor parallel stays inside one)");
  plan->add_option("--seq", plan_options.seq, "Sequence length (default: the model's)");
  plan->add_option("--global-batch", plan_options.global_batch, "Sequences per optimizer step (default: ~1M tokens)");
  plan->add_option("--layout", plan_options.layout,
                   "Evaluate one layout, e.g. \"tp=2 sp pp=2 1f1b zero=1 fsdp=2 mb=1 recompute=selective\" (keys: dp fsdp "
                   "ep tp sp pp schedule v zero mb recompute offload); \"config\": the --model config file's own");
  plan->add_option("--precision", plan_options.precision, "bf16-mixed (2+2+12 bytes per parameter) or fp32 (4+4+8)");
  plan->add_option("--attention", plan_options.attention, "flash (no s^2 term), math (softmax saved) or batched (the fused CPU attention: q, k, v copies and softmax)");
  plan->add_option("--moe-load", plan_options.moe_load,
                   "Mixture of experts: assignments the busiest rank computes per layer over tokens x top_k "
                   "(training reports it as rank_load; default: a balanced router)")
      ->check(CLI::NonNegativeNumber);
  plan->add_option("--top", plan_options.top, "Rows of the ranked table")->capture_default_str();
  plan->add_flag("--json", plan_options.json, "Print JSON instead of tables");
  plan->add_option("--machine", plan_options.machine_file, "Machine profile (JSON from --calibrate --save)")
      ->check(CLI::ExistingFile);
  plan->add_option("--peak-tflops", plan_options.peak_tflops, "Peak dense TFLOP/s per device (default: H100 bf16, 989)");
  plan->add_option("--mfu", plan_options.mfu, "Share of the peak a step achieves (default 0.45)");
  plan->add_option("--intra-gbps", plan_options.intra_gbps, "Collective bus bandwidth inside a node, GB/s (default 360)");
  plan->add_option("--inter-gbps", plan_options.inter_gbps, "... across nodes, per device, GB/s (default 45)");
  plan->add_option("--latency-us", plan_options.latency_us, "Latency per collective step, microseconds (default 10)");
  plan->add_flag("--calibrate", plan_calibrate, "Measure this machine (run under `meshtrain run -n N` for bandwidth)");
  plan->add_option("--save", plan_options.save, "With --calibrate: write the profile to this file");
  plan->footer("Examples:\n  meshtrain plan --model llama2-7b --world 8 --device-memory 80GiB\n"
               "  meshtrain plan --model gpt3-175b --world 1024 --layout \"pp=8 1f1b tp=8 sp dp=16 zero=1 mb=1 recompute=selective\"\n"
               "  meshtrain run -n 2 plan --calibrate --save machine.json");

  CLI::App* train = app.add_subcommand(
      "train", "Train a GPT: meshtrain train [CONFIG.toml] [--section.key=value ...]. Without a config the "
               "built-in defaults train `small` on /usr/share/common-licenses.");
  train->add_option("config", train_config, "TOML config file (sections as listed below)")->check(CLI::ExistingFile);
  train->allow_extras();
  train->footer("Overrides: --section.key=value, e.g. --training.steps=20 --model.preset=tiny\n"
                "Keys and defaults:" + meshtrain::train::TrainConfig::describe_keys());

  std::vector<std::string> prepare_inputs;
  std::string prepare_out = "data";
  double prepare_val_fraction = 0.1;
  CLI::App* prepare = app.add_subcommand("prepare", "Turn text files or directories into token files (train.bin, val.bin)");
  prepare->add_option("inputs", prepare_inputs, "Text files or directories")->required();
  prepare->add_option("--out", prepare_out, "Output directory")->capture_default_str();
  std::string prepare_tokenizer = "bytes";
  prepare->add_option("--tokenizer", prepare_tokenizer,
                      "bytes, a SentencePiece .model, a tokenizer.json, or a folder with vocab.json + merges.txt")
      ->capture_default_str();
  prepare->add_option("--val-fraction", prepare_val_fraction, "Share of tokens held out for validation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();

  meshtrain::apps::InferenceCli inference(app, *bench);

  std::string inspect_path;
  bool inspect_json = false;
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Look into distributed checkpoints");
  checkpoint->require_subcommand(1);
  CLI::App* inspect = checkpoint->add_subcommand(
      "inspect", "What a checkpoint holds: its step, the layout and rank count it was saved with, its files, and every "
                 "tensor with its global shape, dtype, chunks and size. Any layout can resume from it.");
  inspect->add_option("checkpoint", inspect_path, "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  inspect->add_flag("--json", inspect_json, "Print JSON instead of a table");

  int launch_ranks = 0;
  std::vector<std::string> launch_args;
  CLI::App* run = app.add_subcommand(
      "run", "Launch N local ranks of meshtrain through mpirun, e.g. `meshtrain run -n 2 selfcheck` (handles root, "
             "more ranks than cores, and OMP_NUM_THREADS = cores / N). Plain mpirun/srun work too.");
  run->add_option("-n,--ranks", launch_ranks, "Number of ranks")->required()->check(CLI::PositiveNumber);
  run->prefix_command();  // everything after the options is the command every rank runs
  run->footer("Example: meshtrain run -n 4 bench comm --max-size 64M");

  meshtrain::apps::FlCli federated(app);

  CLI11_PARSE(app, argc, argv);

  if (federated.parsed()) {  // no MPI
    try {
      return federated.run(argv[0]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
      return 1;
    }
  }

  if (run->parsed()) {
    try {
      launch_args = run->remaining();
      meshtrain::apps::run_launcher(launch_ranks, launch_args);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
      return 1;
    }
  }

  if (inference.parsed() && !inference.wants_mpi()) {
    try {
      return inference.run_without_mpi();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
      return 1;
    }
  }
  if (prepare->parsed() || timeline->parsed() || inspect->parsed() ||
      (plan->parsed() && !plan_calibrate)) {  // no MPI
    try {
      if (inspect->parsed()) return meshtrain::apps::run_checkpoint_inspect(inspect_path, inspect_json);
      if (plan->parsed()) return meshtrain::apps::run_plan(plan_options);
      if (prepare->parsed()) {
        return meshtrain::apps::run_prepare(prepare_inputs, prepare_out, prepare_val_fraction, prepare_tokenizer);
      }
      return meshtrain::apps::run_timeline(timeline_trace, timeline_out, timeline_title);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
      return 1;
    }
  }

  std::vector<std::string> overrides;
  for (CLI::App* with_overrides : {train, bench_train, bench_graph, bench_tp, bench_moe, bench_pp, bench_checkpoint}) {
    if (!with_overrides->parsed()) continue;
    for (const std::string& extra : with_overrides->remaining()) {
      if (extra.rfind("--", 0) != 0 || extra.find('=') == std::string::npos) {
        std::fprintf(stderr, "meshtrain: error: unexpected argument '%s'; overrides look like --training.steps=20\n",
                     extra.c_str());
        return 2;
      }
      overrides.push_back(extra.substr(2));
    }
  }

  if (inference.serving()) meshtrain::apps::block_stop_signals();  // before MPI starts threads
  std::optional<meshtrain::comm::Runtime> runtime;
  try {
    runtime.emplace(&argc, &argv);
    set_threads_per_rank(*runtime);
    if (train->parsed()) return meshtrain::apps::run_train(*runtime, train_config, overrides);
    if (inference.parsed()) return inference.run_with_mpi(*runtime);
    if (bench_train->parsed()) {
      return meshtrain::apps::run_bench_train(*runtime, overrides, bench_warmup, bench_steps, bench_profile,
                                              bench_profile_steps);
    }
    if (bench_graph->parsed()) return meshtrain::apps::run_bench_graph(*runtime, overrides, graph_warmup, graph_steps);
    if (bench_tp->parsed()) return meshtrain::apps::run_bench_tp(*runtime, overrides, tp_warmup, tp_steps);
    if (bench_moe->parsed()) return meshtrain::apps::run_bench_moe(*runtime, overrides, moe_warmup, moe_steps);
    if (bench_pp->parsed()) return meshtrain::apps::run_bench_pp(*runtime, overrides, pp_warmup, pp_steps, pp_out);
    if (bench_checkpoint->parsed()) {
      return meshtrain::apps::run_bench_checkpoint(*runtime, overrides, checkpoint_warmup, checkpoint_steps);
    }
    if (bench_offload->parsed()) return meshtrain::apps::run_bench_offload(*runtime, offload_bench);
    if (plan->parsed()) return meshtrain::apps::run_plan_calibrate(*runtime, plan_options);
    if (selfcheck->parsed()) return meshtrain::apps::run_selfcheck(*runtime, parse_bytes(selfcheck_bench_max));
    if (bench_comm->parsed()) {
      bench_options.min_bytes = parse_bytes(min_size);
      bench_options.max_bytes = parse_bytes(max_size);
      if (bench_options.min_bytes < 4 || bench_options.min_bytes > bench_options.max_bytes) {
        throw std::invalid_argument("--min-size must be at least 4 bytes and at most --max-size");
      }
      return meshtrain::apps::run_comm_bench(*runtime, bench_options);
    }
  } catch (const std::exception& e) {
    // Errors every rank raised alike (a config, data or checkpoint problem):
    // said once, by rank 0, and every rank exits normally with status 1.
    const bool agreed = dynamic_cast<const meshtrain::comm::AgreedError*>(&e) ||
                        dynamic_cast<const meshtrain::train::ConfigError*>(&e);
    if (agreed || !runtime || runtime->size() == 1) {
      if (!runtime || runtime->rank() == 0) std::fprintf(stderr, "meshtrain: error: %s\n", error_text(e));
      return 1;
    }
    // This rank alone: the others may be waiting for it in a collective.
    runtime->abort(1, std::string("error: ") + error_text(e));
  }
  return 0;
}
