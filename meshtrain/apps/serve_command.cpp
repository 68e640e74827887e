// meshtrain serve: a checkpoint behind an OpenAI-compatible HTTP API, on one
// rank or split over a tensor-parallel group (rank 0 speaks HTTP).
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/offload_flags.h"
#include "meshtrain/util/memory.h"

#include "meshtrain/serve/http_frontend.h"
#include "meshtrain/serve/tls_front.h"
#include "meshtrain/text/chat_template.h"
#include "meshtrain/serve/scheduler.h"

#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <thread>

namespace meshtrain::apps {

namespace {

// SIGTERM and SIGINT; SIGUSR2 (what `meshtrain run` turns them into, Note
// [Stopping a server under mpirun]); SIGUSR1 (wakes the waiting thread).
sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int signal : {SIGTERM, SIGINT, SIGUSR2, SIGUSR1}) sigaddset(&set, signal);
  return set;
}

// Waits for a stop signal (blocked in every thread by block_stop_signals)
// and drains the scheduler; the destructor ends the wait without draining.
class StopSignals {
 public:
  explicit StopSignals(serve::Scheduler& scheduler)
      : thread_([this, &scheduler] {
          const sigset_t set = stop_signals();
          int signal = 0;
          sigwait(&set, &signal);
          if (signal == SIGUSR1) return;
          std::fprintf(stderr, "meshtrain serve: %s: finishing the requests in flight, then exiting\n",
                       signal == SIGINT ? "SIGINT" : "SIGTERM");
          scheduler.drain();
        }) {}
  ~StopSignals() {
    // Blocked everywhere, SIGUSR1 stays pending harmlessly if the thread has already returned.
    pthread_kill(thread_.native_handle(), SIGUSR1);
    thread_.join();
  }

 private:
  std::thread thread_;
};

}  // namespace

void block_stop_signals() {
  const sigset_t set = stop_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

namespace {

// Note [Request memory]
// Each handler thread allocates from its own glibc arena, and glibc raises
// its mmap threshold to the size of the largest block freed (up to 32 MiB):
// after one large body, every later one of that size comes from an arena,
// and an arena keeps what it frees. With 84 handler threads taking requests
// in turn, the server's memory grew by the size of a large request per
// thread that had served one (28 MiB per 100 MB chunked body, never given
// back). A fixed threshold keeps blocks of 1 MiB and more (request bytes,
// bodies, answers) in their own mappings, returned when freed; tensors are
// not affected (the counting allocator keeps its own blocks).
void keep_request_memory_returnable() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
}

}  // namespace

int run_serve(comm::Runtime& runtime, ServeOptions options) {
  options.parallel.check_inference(runtime.size(), "serve");  // Note [Inference layout]
  if (options.ssl_certfile.empty() != options.ssl_keyfile.empty()) {
    throw UsageError("serve: HTTPS takes both --ssl-certfile and --ssl-keyfile (PEM files); " +
                     std::string(options.ssl_certfile.empty() ? "--ssl-certfile" : "--ssl-keyfile") + " is missing");
  }
  if (!options.ssl_certfile.empty() && runtime.rank() == 0) serve::TlsFront::check_files(options.ssl_certfile, options.ssl_keyfile);
  memory::install();
  keep_request_memory_returnable();
  serve::InferenceModel inference(options.checkpoint, runtime.world(), inference_offload(options.offload), options.lora);
  const std::string offload_line = apply_memory_limit(options.offload, inference);
  if (runtime.rank() == 0 && !offload_line.empty()) std::fputs(offload_line.c_str(), stderr);
  serve::Scheduler scheduler(inference, runtime.world(), serve::SchedulerOptions{options.max_batch, options.queue});
  if (runtime.rank() != 0) {
    scheduler.run();  // rank 0's turns, until it stops
    return 0;
  }
  serve::FrontendCallbacks callbacks;
  callbacks.check = [&](const serve::CompletionJob& job) { scheduler.check(job); };
  callbacks.submit = [&](std::vector<std::shared_ptr<serve::CompletionJob>> jobs) {
    return scheduler.submit(std::move(jobs));
  };
  callbacks.draining = [&] { return scheduler.draining(); };
  const int threads = options.threads > 0 ? options.threads : static_cast<int>(options.max_batch + options.queue + 4);
  const std::unique_ptr<text::ChatTemplate> chat = text::ChatTemplate::of(inference.tokenizer());
  serve::ServedModel served{options.model_name, &inference.tokenizer(), chat.get(), inference.config().context};
  serve::HttpFrontend frontend(callbacks, served, threads, options.log, options.api_key);
  const bool https = !options.ssl_certfile.empty();
  if (https) frontend.use_tls(options.ssl_certfile, options.ssl_keyfile);
  const int port = frontend.bind(options.host, options.port);
  std::thread http([&] { frontend.listen(); });
  if (!inference.adapter().empty()) std::printf("meshtrain serve: %s\n", inference.adapter().c_str());
  std::printf("meshtrain serve: %s (step %lld) on %s://%s:%d, tp %lld, batches of up to %lld, queue %lld, %s%s\n",
              options.model_name.c_str(), static_cast<long long>(inference.step()), https ? "https" : "http",
              options.host.c_str(), port,
              static_cast<long long>(options.parallel.dims.tp), static_cast<long long>(options.max_batch), static_cast<long long>(options.queue),
              chat ? "chat template" : "no chat template (completions only)",
              options.api_key.empty() ? "" : ", API key required");
  std::fflush(stdout);
  try {
    StopSignals signals(scheduler);
    scheduler.run();
  } catch (...) {
    frontend.stop();
    http.join();
    throw;
  }
  frontend.stop();
  http.join();
  std::fprintf(stderr, "meshtrain serve: stopped\n");
  return 0;
}

namespace {

// Serves until SIGTERM or SIGINT: both are blocked before MPI starts its threads.
class ServeCommand : public Command {
 public:
  explicit ServeCommand(CLI::App& app);
  bool chosen() const override { return sub_->parsed(); }
  void before_ranks() override { block_stop_signals(); }
  int run(comm::Runtime* runtime) override { return run_serve(*runtime, o_); }

 private:
  CLI::App* sub_;
  ServeOptions o_;
};

ServeCommand::ServeCommand(CLI::App& app) {
  sub_ = app.add_subcommand(
      "serve",
      "Serve a checkpoint over an OpenAI-compatible HTTP API: POST /v1/completions and /v1/chat/completions "
      "(stream: true for server-sent events), GET /v1/models, POST /tokenize and /detokenize, GET /health. "
      "Requests join the running batch between decode steps (continuous batching). SIGTERM or Ctrl-C finishes "
      "the requests in flight, then exits 0.");
  sub_
      ->add_option("--checkpoint", o_.checkpoint,
                   "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  sub_->add_option("--lora", o_.lora,
                   "A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. from `meshtrain "
                   "export peft`), merged into the checkpoint's weights before serving")
      ->check(CLI::ExistingDirectory);
  sub_->add_option("--host", o_.host, "Address to listen on")->capture_default_str();
  sub_->add_option("--port", o_.port, "Port (0: any free port, printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub_->add_option("--max-batch", o_.max_batch, "Sequences decoded together")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub_->add_option("--queue", o_.queue, "Requests waiting beyond the batch; more get 429")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub_
      ->add_option("--parallel.tp", o_.parallel.dims.tp,
                   "Split the model over this many ranks (all ranks of the job: meshtrain run -n 2 serve "
                   "--parallel.tp=2 ...)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub_->add_option("--model-name", o_.model_name, "The model's name in the API")->capture_default_str();
  sub_->add_option("--threads", o_.threads, "HTTP handler threads (0: max-batch + queue + 4)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub_->add_flag("--log", o_.log, "Print a line per request to stderr");
  sub_->add_option("--api-key", o_.api_key,
                   "Answer 401 unless a request carries 'Authorization: Bearer KEY' (GET /health stays open); "
                   "default: $MESHTRAIN_API_KEY, which other users cannot read as they can a command line")
      ->envname("MESHTRAIN_API_KEY");
  sub_->add_option("--ssl-certfile", o_.ssl_certfile,
                   "Serve HTTPS with this certificate chain (PEM; with --ssl-keyfile; TLS 1.2 or later)")
      ->check(CLI::ExistingFile);
  sub_->add_option("--ssl-keyfile", o_.ssl_keyfile, "The private key of --ssl-certfile (PEM)")->check(CLI::ExistingFile);
  add_offload_flags(*sub_, o_.offload);
  declare_launch_needs("serve", {LaunchNeeds::OnStop::kDrain, /*restartable=*/false});  // SIGTERM drains
}

}  // namespace

CommandPtr add_serve(CLI::App& app) { return std::make_unique<ServeCommand>(app); }

}  // namespace meshtrain::apps
