// The meshtrain executable's subcommands: each file of apps/ adds one (or a
// group) to the command line and runs it (Note [Commands]); main() lists
// them in the order --help shows. Below the factories, the options and entry
// points the command files share.
#pragma once

#include "meshtrain/apps/command.h"
#include "meshtrain/comm/runtime.h"
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/train/progress.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::apps {

CommandPtr add_selfcheck(CLI::App& app);             // selfcheck.cpp
CommandPtr add_bench_comm(CLI::App& bench);          // bench_comm.cpp
CommandPtr add_bench_train(CLI::App& bench);         // bench_train.cpp
CommandPtr add_bench_graph(CLI::App& bench);         // bench_graph.cpp
CommandPtr add_bench_tp(CLI::App& bench);            // bench_tp.cpp
CommandPtr add_bench_moe(CLI::App& bench);           // bench_moe.cpp
CommandPtr add_bench_pp(CLI::App& bench);            // bench_pp.cpp
CommandPtr add_bench_cp(CLI::App& bench);            // bench_cp.cpp
CommandPtr add_bench_checkpoint(CLI::App& bench);    // bench_checkpoint.cpp
CommandPtr add_bench_offload(CLI::App& bench);       // bench_offload.cpp
CommandPtr add_bench_generate(CLI::App& bench);      // bench_generate.cpp
CommandPtr add_timeline(CLI::App& app);              // timeline_command.cpp
CommandPtr add_plan(CLI::App& app);                  // plan_command.cpp
CommandPtr add_verify(CLI::App& app);                // verify_command.cpp
CommandPtr add_train(CLI::App& app);                 // train_commands.cpp
CommandPtr add_prepare(CLI::App& app);               // train_commands.cpp
CommandPtr add_generate(CLI::App& app);              // generate_command.cpp
CommandPtr add_serve(CLI::App& app);                 // serve_command.cpp
CommandPtr add_import(CLI::App& app);                // interop_command.cpp
CommandPtr add_export(CLI::App& app);                // interop_command.cpp
CommandPtr add_export_peft(CLI::App& app);           // interop_command.cpp (after add_export)
CommandPtr add_tokenizer(CLI::App& app);             // tokenizer_command.cpp
CommandPtr add_logits(CLI::App& app);                // interop_command.cpp
CommandPtr add_checkpoint(CLI::App& app);            // checkpoint_command.cpp
CommandPtr add_run(CLI::App& app);                   // launch.cpp
CommandPtr add_submit(CLI::App& app);                // launch_slurm.cpp
CommandPtr add_fl(CLI::App& app, const char* self);  // fl_command.cpp (self: this executable)

struct CommBenchOptions {
  int64_t min_bytes = int64_t{4} << 10;
  int64_t max_bytes = int64_t{256} << 20;
  int trials = 9;              // per side, alternating; the table reports medians
  double trial_seconds = 0.2;  // target duration of one trial
  std::vector<std::string> ops{"all_reduce", "reduce_scatter", "all_gather", "all_to_all"};
  std::string json_path;       // also write the rows as JSON lines when set
};

// Prints, per op and size, time, algorithm and bus bandwidth for meshtrain's
// communicator and for the raw MPI call on the same buffers, and their ratio.
int run_comm_bench(comm::Runtime& runtime, const CommBenchOptions& options);

// Checks every collective on every dtype against values computed by hand, on
// the world and on mesh communicators, prints a table on rank 0 and then a
// short bandwidth table. Returns non-zero if any check failed on any rank.
int run_selfcheck(comm::Runtime& runtime, int64_t bench_max_bytes);

// meshtrain train CONFIG [--section.key=value ...]: validates, then trains on all ranks.
// `relaunch`: what `meshtrain run --max-restarts` said of this launch (Note [Restarts]).
int run_train(comm::Runtime& runtime, const std::string& config_path, const std::vector<std::string>& overrides,
              const train::Relaunch& relaunch = {});
// The options through which the launcher tells a relaunched `train` its attempt, the cause and the ranks before.
constexpr const char* kRelaunchAttempt = "relaunch-attempt";
constexpr const char* kRelaunchCause = "relaunch-cause";
constexpr const char* kRelaunchRanksBefore = "relaunch-ranks-before";

// meshtrain prepare TEXT... --out DIR: text -> train.bin / val.bin (no MPI needed).
int run_prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                const std::string& tokenizer);

// meshtrain tokenizer train / encode / decode (apps/tokenizer_command.cpp).
int run_tokenizer_train(const std::vector<std::string>& inputs, int64_t vocab, const std::string& type,
                        const std::string& prefix);
int run_tokenizer_encode(const std::string& tokenizer, const std::string& text, const std::vector<std::string>& files,
                         bool special, bool timing);
int run_tokenizer_decode(const std::string& tokenizer, const std::vector<int64_t>& ids);
int run_tokenizer_chat(const std::string& tokenizer, const std::string& messages_file, const std::string& tools_file,
                       bool generation_prompt, bool ids);

// ZeRO-Inference for generate, serve and bench generate (--offload.*,
// offload/weight_stream.h), and the device memory limit (--memory.limit_mb).
struct InferenceOffloadFlags {
  std::string weights = "none";  // "none" | "cpu" | "nvme"
  std::string nvme_dir = "/tmp";
  int prefetch = 1;
  std::string kv = "device";  // "device" | "cpu"
  int64_t memory_limit_mb = 0;
};

struct GenerateOptions {
  std::string checkpoint;  // a checkpoint folder, or a directory holding a 'latest' pointer
  std::string lora;        // a PEFT adapter folder merged into it ("": none)
  std::string prompt = "The ";
  int64_t tokens = 300;
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 1.0;
  uint64_t seed = 1;
  std::vector<std::string> stop;  // the text ends before the first of these
  // parallel.tp: ranks splitting the model; parallel.cp: the KV cache (Note [Inference layout]).
  parallel::ParallelSpec parallel;
  bool no_kv_cache = false;
  bool timing = false;
  std::string prompt_ids;  // token ids "1,2,3" in place of the prompt's text; the output is ids too
  InferenceOffloadFlags offload;
};
// meshtrain generate: prints the prompt and the text sampled after it, as it comes.
int run_generate(comm::Runtime& runtime, GenerateOptions options);

struct ServeOptions {
  std::string checkpoint;
  std::string lora;  // a PEFT adapter folder merged into it ("": none)
  std::string host = "127.0.0.1";
  int port = 8000;                     // 0: any free port (printed)
  int64_t max_batch = 16;
  int64_t queue = 64;
  parallel::ParallelSpec parallel;  // parallel.tp: ranks splitting the model (Note [Inference layout])
  int threads = 0;                     // HTTP handler threads; 0: max_batch + queue + 4
  std::string model_name = "meshtrain";
  bool log = false;
  std::string api_key;                 // "": no key asked (Note [API key])
  std::string ssl_certfile, ssl_keyfile;  // both: HTTPS (Note [TLS]); neither: HTTP
  InferenceOffloadFlags offload;
};
// meshtrain serve: the OpenAI completions API until SIGTERM/SIGINT, which
// drains the requests in flight and returns 0.
int run_serve(comm::Runtime& runtime, ServeOptions options);
// Blocks SIGTERM and SIGINT in this thread and those it starts (call before
// MPI starts its threads): serve waits for them with sigwait.
void block_stop_signals();

// meshtrain import hf DIR --out CKPT: a Hugging Face GPT-2 or Llama folder as
// a meshtrain checkpoint (step 0). export hf: the reverse. logits: the
// logits [1, T, V] of token ids, as a safetensors file (to compare with
// another implementation).
int run_import_hf(comm::Runtime& runtime, const std::string& dir, const std::string& out_dir,
                  const std::string& tokenizer);
int run_export_hf(const std::string& checkpoint, const std::string& out_dir, const std::string& dtype,
                  int64_t max_shard_bytes);
int run_logits(const std::string& checkpoint, const std::string& tokens, const std::string& out);
// export peft CKPT --out DIR: a checkpoint of LoRA adapters as a PEFT adapter folder.
int run_export_peft(const std::string& checkpoint, const std::string& out_dir, const std::string& base_name);

struct GenerateBenchOptions {
  std::string checkpoint;
  int64_t batch = 1;
  int64_t prompt_tokens = 64;
  int64_t new_tokens = 64;
  int warmup = 1;
  int trials = 5;
  InferenceOffloadFlags offload;
  std::string json_path;  // also append the JSON line here
};
// meshtrain bench generate: prefill and decode times (medians) of a batch on
// the serving path, and row 0's greedy tokens, as one JSON line.
int run_bench_generate(const GenerateBenchOptions& options);

// meshtrain checkpoint inspect DIR: step, layout, files and every tensor (no MPI).
int run_checkpoint_inspect(const std::string& path, bool json);
// meshtrain checkpoint gather DIR... --out OUT: a local checkpoint's files from
// every rank's host into OUT (Note [Gathering a checkpoint]).
int run_checkpoint_gather(comm::Runtime& runtime, const std::vector<std::string>& paths, const std::string& out_dir);

// bench tp: tensor parallel for tp = 1, 2, 4, ... up to the world size (the
// first tp ranks train, the rest wait): bytes per layer against the formula,
// tokens/s against tp = 1. Overrides as for train (default: small, 8 heads).
int run_bench_tp(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps, int timed_steps);
// meshtrain bench moe: one MoE layer's bytes and time split, and MoE training against dense (apps/bench_moe.cpp).
int run_bench_moe(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps, int timed_steps);

// meshtrain bench train [--section.key=value ...]: times training steps (after
// warm-up) and prints one JSON line: tokens/s, MFU, all-reduce time per step and
// the share of it hidden behind backward. With `profile_dir`, then profiles
// `profile_steps` more steps (op_profile.h) and writes the trace and the table there.
int run_bench_train(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                    int timed_steps, const std::string& profile_dir = "", int profile_steps = 3);

// meshtrain bench graph: on one GPU, a training step with forward and backward
// captured as a CUDA graph and replayed, against the same step run eagerly:
// tokens/s of each and the losses of both from the same start, as one JSON line.
int run_bench_graph(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                    int timed_steps);

// Where `meshtrain run` places its ranks: this host (empty), or other hosts.
struct Hosts {
  std::string hostfile;  // mpirun --hostfile
  std::string list;      // "a:2,b:2", mpirun --host
  bool empty() const { return hostfile.empty() && list.empty(); }
};

// Runs `mpirun -np ranks <this executable> args...` on `hosts`, passing on
// every MESHTRAIN_* variable set here (Note [Job environment]), passes its
// output on (without Open MPI's banners that repeat meshtrain's own errors,
// Note [Launcher output]) and exits with its status. Returns only by throwing.
// How `meshtrain run` supervises a training job (Note [Restarts]).
struct Supervision {
  int max_restarts = 0;          // relaunches after a rank's death
  bool restart_on_hang = false;  // and after a watchdog timeout
  int min_ranks = 0;             // > 0: relaunch on the hosts that answer, if they hold this many ranks
};

// launcher: "auto" (srun inside a Slurm allocation, else mpirun), "mpirun" or "srun" (Note [Launching under Slurm]).
[[noreturn]] int run_launcher(int ranks, const Hosts& hosts, const Supervision& supervision,
                              const std::vector<std::string>& args, const std::string& launcher = "auto");

std::string self_executable();  // this executable's path (/proc/self/exe), launch.cpp

// The mpirun command line run_launcher uses (exposed for tests).
// `variables`: the names passed on to every rank.
std::vector<std::string> launch_command(int ranks, const Hosts& hosts, const std::vector<std::string>& args,
                                        bool open_mpi, bool root, const std::vector<std::string>& variables);

// bench pp: every pipeline schedule for pp = 2, 4 and m = 4, 8, 16 (see main.cpp).
int run_bench_pp(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps, int timed_steps,
                 const std::string& out_dir);

// bench checkpoint: step time with no save, with a save before each step written
// in the background and in the loop, the snapshot and write times, and the
// write against the disk's raw speed for the same bytes (see bench_checkpoint.cpp).
// meshtrain bench offload: the tiered store's bandwidth against fio on the
// same file, the CPU AdamW against libtorch's, ZeRO-Inference tokens/s
// against the transfer bound per batch size, and training step time and
// memory with each offload (apps/bench_offload*.cpp). One JSON line per row.
struct OffloadBenchOptions {
  std::vector<std::string> parts{"tiers", "adam", "inference", "training"};
  std::string nvme_dir = "/tmp";
  int64_t file_mb = 512;  // the NVMe read test's file
  int trials = 3;
  std::vector<int64_t> batches{1, 8, 32, 64};
  std::string training_model = "small";  // the training part's preset
  std::string json_path;
};
int run_bench_offload(comm::Runtime& runtime, const OffloadBenchOptions& options);

int run_bench_checkpoint(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                         int timed_steps);

struct PlanOptions {
  std::string model = "llama2-7b";  // a preset, or a meshtrain config file (.toml)
  int64_t world = 8;
  std::string device_memory;        // "80GiB" (default: the machine profile's)
  int64_t gpus_per_node = 0;        // 0: the machine profile's
  int64_t seq = 0;                  // 0: the model's
  int64_t global_batch = 0;         // sequences per step; 0: the config's, or about 1M tokens
  std::string layout;               // evaluate this one ("tp=2 sp pp=2 ..."; "config": the config file's own)
  std::string precision;            // "bf16-mixed" | "bf16-autocast" | "fp32" (default: bf16-mixed for presets, a config's own)
  std::string attention;            // "flash" | "math" | "batched"
  std::string selective = "core";   // what recompute=selective keeps: "core" (the trainer's) | "ops" (op-level)
  std::string loss;                 // "chunked" | "whole" | "loss-parallel" (default: the model's model.chunked_loss)
  std::string pipeline_fsdp = "meshtrain";  // ZeRO-2/3 under a pipeline: "meshtrain" | "torch" (FSDP2 under torch's pipelining)
  std::string moe_load;             // mixture of experts: the busiest rank's expert load, or a metrics.jsonl ("": balanced)
  bool json = false;
  int top = 10;
  std::string machine = "this";     // this machine, a preset (h100, h200, a100) or a profile file (Note [This machine])
  double peak_tflops = 0, mfu = 0, intra_gbps = 0, inter_gbps = 0, latency_us = 0;  // 0: the profile's
  std::string save;                 // --calibrate: write the profile here
  std::string auto_path;            // --auto: write the fastest layout that fits here, as a train config
};

// meshtrain plan: evaluates one layout or searches all of them (no MPI).
int run_plan(const PlanOptions& options);
// meshtrain plan --calibrate: measures this machine's matmul peak, each operator
// class's rate (Note [Operator time]), a short training run against them and
// (with several ranks) collective bandwidth and latency.
int run_plan_calibrate(comm::Runtime& runtime, const PlanOptions& options);

}  // namespace meshtrain::apps
