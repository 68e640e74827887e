// meshtrain bench generate: prefill and decode timed apart on the serving
// path (the batch engine with its KV cache), batch B, greedy, one JSON line.
#include "meshtrain/apps/bench_util.h"
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/offload_flags.h"
#include "meshtrain/util/memory.h"

#include <fstream>

#include "meshtrain/serve/batch_engine.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace meshtrain::apps {

int run_bench_generate(const GenerateBenchOptions& options) {
  memory::install();
  serve::InferenceModel inference(options.checkpoint, nullptr, inference_offload(options.offload));
  apply_memory_limit(options.offload, inference);
  const model::GptConfig& config = inference.config();
  if (options.prompt_tokens + options.new_tokens > config.context) {
    throw std::invalid_argument("--prompt-tokens + --new-tokens exceed the model's context of " +
                                std::to_string(config.context));
  }
  // Every row the same prompt (ids (7i + 3) mod vocab), so a peer can be given the same batch.
  serve::GenerationRequest request;
  for (int64_t i = 0; i < options.prompt_tokens; ++i) request.prompt.push_back((7 * i + 3) % config.vocab_size);
  request.options.tokens = options.new_tokens;
  request.options.temperature = 0;
  std::vector<double> prefill, decode;
  std::vector<int64_t> tokens;
  for (int trial = 0; trial < options.warmup + options.trials; ++trial) {
    serve::BatchEngine engine(inference, options.batch);
    std::vector<serve::GenerationRequest> batch(options.batch, request);
    for (int64_t r = 0; r < options.batch; ++r) batch[r].id = r;
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    std::vector<int64_t> row0;
    for (const serve::TokenEvent& e : engine.admit(batch)) {
      if (e.id == 0) row0.push_back(e.token);
    }
    const auto prefilled = Clock::now();
    while (engine.running() > 0) {
      for (const serve::TokenEvent& e : engine.step()) {
        if (e.id == 0) row0.push_back(e.token);
      }
    }
    const auto done = Clock::now();
    if (trial < options.warmup) continue;
    prefill.push_back(std::chrono::duration<double>(prefilled - start).count());
    decode.push_back(std::chrono::duration<double>(done - prefilled).count());
    tokens = row0;
  }
  const double p = median(prefill), d = median(decode);
  const offload::WeightStream* stream = inference.weight_stream();
  nlohmann::json line = {{"batch", options.batch},
                               {"prompt_tokens", options.prompt_tokens},
                               {"new_tokens", options.new_tokens},
                               {"prefill_s", p},
                               {"prefill_tokens_per_s", options.batch * options.prompt_tokens / p},
                               {"decode_s", d},
                               {"decode_tokens_per_s", options.batch * (options.new_tokens - 1) / d},
                               {"tokens", tokens},
                               {"weights", options.offload.weights},
                               {"kv", options.offload.kv},
                               {"peak_counted_mib", memory::peak_bytes() / 1048576.0}};
  if (stream != nullptr) {
    // Each forward moves every block once: decode makes new_tokens - 1 forwards.
    line["streamed_bytes_per_forward"] = stream->streamed_bytes();
    line["decode_forwards_per_s"] = (options.new_tokens - 1) / d;
    line["exposed_transfer_s"] = stream->exposed_seconds();
  }
  std::printf("%s\n", line.dump().c_str());
  if (!options.json_path.empty()) {
    std::ofstream out(options.json_path, std::ios::app);
    out << line.dump() << "\n";
  }
  return 0;
}

CommandPtr add_bench_generate(CLI::App& bench) {
  auto o = std::make_shared<GenerateBenchOptions>();
  CLI::App* sub = bench.add_subcommand(
      "generate",
      "Prefill and decode timed apart on the serving path (continuous-batching engine, KV cache, greedy): "
      "a batch of the same prompt, medians of --trials, one JSON line with row 0's tokens "
      "(bench/generate_vs_hf.py runs transformers' generate() on the same weights beside it)");
  sub->add_option("--checkpoint", o->checkpoint, "Checkpoint folder or directory")->required();
  sub->add_option("--batch", o->batch, "Sequences")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--prompt-tokens", o->prompt_tokens, "Prompt length")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--new-tokens", o->new_tokens, "Tokens to generate")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  sub->add_option("--warmup", o->warmup, "Untimed runs")->capture_default_str();
  sub->add_option("--trials", o->trials, "Timed runs")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--json", o->json_path, "Also append the JSON line to this file");
  add_offload_flags(*sub, o->offload);
  return plain_command(sub, [o] { return run_bench_generate(*o); });
}

}  // namespace meshtrain::apps
