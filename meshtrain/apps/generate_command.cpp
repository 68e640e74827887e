// meshtrain generate: text from a checkpoint, streamed as it is sampled, on
// one rank, split over a tensor-parallel group, or with the KV cache split
// over a context-parallel group.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/offload_flags.h"
#include "meshtrain/util/memory.h"

#include "meshtrain/model/text_stream.h"
#include "meshtrain/parallel/context_parallel_generate.h"
#include "meshtrain/serve/inference_model.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::apps {

namespace {

// "1,2,3" -> {1, 2, 3}, each a token of the vocabulary.
std::vector<int64_t> parse_ids(const std::string& text, int64_t vocab) {
  std::vector<int64_t> ids;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || id < 0 || id >= vocab) {
      throw std::invalid_argument("generate: --prompt-ids: \"" + item + "\" is not a token id in [0, " +
                                  std::to_string(vocab) + ")");
    }
    ids.push_back(id);
    at = comma + 1;
  }
  return ids;
}

// The tokens after `prompt`, through sample.on_token: the cache split over the
// job's ranks with --parallel.cp (Note [Context-parallel generation]).
void sample_after(serve::InferenceModel& inference, const std::vector<int64_t>& prompt,
                  const model::SampleOptions& sample, const GenerateOptions& options, comm::Runtime& runtime) {
  if (options.parallel.dims.cp > 1) {
    parallel::generate_context_parallel(inference.gpt(), at::tensor(prompt, at::kLong), inference.with_split(sample),
                                        runtime.world());
  } else {
    model::generate(inference.gpt(), at::tensor(prompt, at::kLong), inference.with_split(sample));
  }
}

// What --parallel.tp and --parallel.cp ask of the job (Note [Inference layout]), refused with
// the flag to change (a usage error: every rank parses the same line, rank 0 says it once).
void check_layout(const comm::Runtime& runtime, GenerateOptions& options) {
  try {
    options.parallel.check_inference(runtime.size(), "generate");
  } catch (const config::ConfigError& e) {
    throw UsageError(std::string("generate: ") + e.what());
  }
  const serve::InferenceOffload offload = inference_offload(options.offload);
  if (options.parallel.dims.cp > 1 &&
      (options.no_kv_cache || offload.weights != offload::Tier::kDevice || offload.kv != offload::Tier::kDevice)) {
    throw UsageError("generate: --parallel.cp splits the KV cache on the device; it does not combine with "
                     "--no-kv-cache, --offload.weights or --offload.kv");
  }
}

// Greedy or sampled ids after the ids of --prompt-ids, printed as ids.
int generate_ids(serve::InferenceModel& inference, const GenerateOptions& options, model::SampleOptions sample,
                 bool speaker, comm::Runtime& runtime) {
  const std::vector<int64_t> prompt = parse_ids(options.prompt_ids, inference.config().vocab_size);
  std::vector<int64_t> made;
  sample.on_token = [&](int64_t token) {
    made.push_back(token);
    return true;
  };
  sample_after(inference, prompt, sample, options, runtime);
  std::string line;
  for (const int64_t id : made) line += (line.empty() ? "" : ",") + std::to_string(id);
  if (speaker) std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

int run_generate(comm::Runtime& runtime, GenerateOptions options) {
  check_layout(runtime, options);
  const int64_t cp = options.parallel.dims.cp;
  memory::install();
  // Under cp every rank holds the whole model.
  serve::InferenceModel inference(options.checkpoint, cp > 1 ? nullptr : runtime.world(),
                                  inference_offload(options.offload), options.lora);
  const bool speaker = runtime.rank() == 0;
  const std::string offload_line = apply_memory_limit(options.offload, inference);
  if (speaker && !offload_line.empty()) std::fputs(offload_line.c_str(), stderr);
  model::SampleOptions sample;
  sample.tokens = options.tokens;
  sample.temperature = options.temperature;
  sample.top_k = options.top_k;
  sample.top_p = options.top_p;
  sample.seed = options.seed;
  sample.kv_cache = !options.no_kv_cache;
  sample.validate();
  if (!options.prompt_ids.empty()) return generate_ids(inference, options, sample, speaker, runtime);
  const std::vector<int64_t> prompt = inference.encode(options.prompt);
  if (static_cast<int64_t>(prompt.size()) > inference.config().context && sample.kv_cache && cp == 1) {
    // The sliding window keeps the last `context` tokens; say so once.
    if (speaker) std::fprintf(stderr, "meshtrain: the prompt is longer than the context; its last %lld tokens are used\n",
                              static_cast<long long>(inference.config().context));
  }
  model::TextStream text(inference.continuation(prompt), options.stop,
                         inference.tokenizer().stop_ids());
  if (speaker) std::fputs(options.prompt.c_str(), stdout);
  sample.on_token = [&](int64_t token) {
    const std::string piece = text.push(token);
    if (speaker && !piece.empty()) {
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    }
    return !text.stopped();
  };
  const auto start = std::chrono::steady_clock::now();
  sample_after(inference, prompt, sample, options, runtime);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (speaker) std::printf("%s\n", text.finish().c_str());  // the text ends its line; --timing has its own
  std::fflush(stdout);
  const int64_t made = static_cast<int64_t>(text.tokens().size());
  if (speaker && options.timing) {
    std::fprintf(stderr, "meshtrain: %lld tokens in %.3f s (%.1f tokens/s, %s, tp %lld, cp %lld), peak counted memory %s\n",
                 static_cast<long long>(made), seconds, made / seconds, sample.kv_cache ? "kv cache" : "full recompute",
                 static_cast<long long>(options.parallel.dims.tp), static_cast<long long>(cp),
                 memory::format_mib(memory::peak_bytes()).c_str());
  }
  return 0;
}

CommandPtr add_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "Sample text from a checkpoint, streamed as it comes (temperature, top-k, top-p, seed, stop strings; "
      "split over ranks with --parallel.tp, or the KV cache with --parallel.cp)");
  sub
      ->add_option("--checkpoint", o->checkpoint,
                   "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  sub->add_option("--lora", o->lora, "A PEFT LoRA adapter folder merged into the checkpoint's weights")
      ->check(CLI::ExistingDirectory);
  sub->add_option("--prompt", o->prompt, "Text to continue")->capture_default_str();
  sub->add_option("--prompt-ids", o->prompt_ids,
                  "Token ids to continue, separated by commas (in place of --prompt); the ids generated are "
                  "printed, separated by commas");
  sub->add_option("--tokens,--max-tokens", o->tokens, "The most tokens to generate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub
      ->add_option("--temperature", o->temperature, "Softmax temperature (0: greedy, the likeliest token)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--top-k", o->top_k, "Sample among the k likeliest tokens (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub
      ->add_option("--top-p", o->top_p,
                   "Sample among the likeliest tokens whose probabilities sum to p (nucleus sampling; 1: off)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  sub->add_option("--stop", o->stop,
                            "End the text before this string (repeat for several; the stop string is not printed)");
  sub
      ->add_option("--parallel.tp", o->parallel.dims.tp,
                   "Split the model over this many ranks by tensor parallelism (all ranks of the job: "
                   "meshtrain run -n 2 generate --parallel.tp=2 ...)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub
      ->add_option("--parallel.cp", o->parallel.dims.cp,
                   "Split the KV cache over this many ranks (all ranks of the job): the prompt is prefilled by ring "
                   "attention, each new token attends to every rank's part, so a sequence whose keys and values do "
                   "not fit one rank generates (meshtrain run -n 2 generate --parallel.cp=2 ...)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_flag("--no-kv-cache", o->no_kv_cache,
                          "Recompute the whole context for every new token instead of keeping keys and values (slower; "
                          "the same tokens)");
  sub->add_flag("--timing", o->timing, "Print the tokens per second to stderr");
  add_offload_flags(*sub, o->offload);
  return command(sub, [o](comm::Runtime& runtime) { return run_generate(runtime, *o); });
}

}  // namespace meshtrain::apps
