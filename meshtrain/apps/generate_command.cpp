// meshtrain generate: text from a checkpoint, streamed as it is sampled, on
// one rank or split over a tensor-parallel group.
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/offload_flags.h"
#include "meshtrain/util/memory.h"

#include "meshtrain/model/text_stream.h"
#include "meshtrain/serve/inference_model.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>

namespace meshtrain::apps {

int run_generate(comm::Runtime& runtime, const GenerateOptions& options) {
  if (options.tp != runtime.size()) {
    throw std::invalid_argument("generate: --parallel.tp=" + std::to_string(options.tp) + " but " +
                                std::to_string(runtime.size()) + " rank(s) run; launch tp ranks (meshtrain run -n " +
                                std::to_string(options.tp) + " generate --parallel.tp=" + std::to_string(options.tp) +
                                " ...)");
  }
  memory::install();
  serve::InferenceModel inference(options.checkpoint, runtime.world(), inference_offload(options.offload));
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
  const std::vector<int64_t> prompt = inference.encode(options.prompt);
  if (static_cast<int64_t>(prompt.size()) > inference.config().context && sample.kv_cache) {
    // The sliding window keeps the last `context` tokens; say so once.
    if (speaker) std::fprintf(stderr, "meshtrain: the prompt is longer than the context; its last %lld tokens are used\n",
                              static_cast<long long>(inference.config().context));
  }
  model::TextStream text([&](const std::vector<int64_t>& t) { return inference.decode(t); }, options.stop,
                         inference.tokenizer().end_of_text());
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
  model::generate(inference.gpt(), at::tensor(prompt, at::kLong), inference.with_split(sample));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (speaker) std::printf("%s\n", text.finish().c_str());
  const int64_t made = static_cast<int64_t>(text.tokens().size());
  if (speaker && options.timing) {
    std::fprintf(stderr, "meshtrain: %lld tokens in %.3f s (%.1f tokens/s, %s, tp %d), peak counted memory %s\n",
                 static_cast<long long>(made), seconds, made / seconds, sample.kv_cache ? "kv cache" : "full recompute",
                 options.tp, memory::format_mib(memory::peak_bytes()).c_str());
  }
  return 0;
}

}  // namespace meshtrain::apps
