// meshtrain train / prepare / generate.
#include "meshtrain/apps/commands.h"

#include "meshtrain/model/generate.h"

#include <chrono>
#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"

#include <cstdio>

namespace meshtrain::apps {

int run_train(comm::Runtime& runtime, const std::string& config_path, const std::vector<std::string>& overrides) {
  train::TrainConfig config = train::TrainConfig::load(config_path, overrides);
  config.validate(runtime.size());
  train::Trainer trainer(std::move(config), runtime.world());
  trainer.run();
  return 0;
}

int run_prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction) {
  const train::PrepareResult result = train::prepare(inputs, out_dir, val_fraction);
  std::printf("meshtrain prepare: %zu file(s) -> %s (%lld tokens), %s (%lld tokens)\n", result.sources.size(),
              result.train_path.c_str(), static_cast<long long>(result.train_tokens), result.val_path.c_str(),
              static_cast<long long>(result.val_tokens));
  return 0;
}

int run_generate(const GenerateOptions& options) {
  checkpoint::CheckpointReader reader(checkpoint::CheckpointStore::resolve(options.checkpoint));
  model::Gpt model(train::model_config_from_json(reader.metadata().model_config), 0);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) item.value().copy_(reader.read("model/" + item.key()).view_as(item.value()));
  }
  model::SampleOptions sample;
  sample.tokens = options.tokens;
  sample.temperature = options.temperature;
  sample.top_k = options.top_k;
  sample.seed = options.seed;
  sample.kv_cache = !options.no_kv_cache;
  const auto prompt = train::ByteTokenizer::encode(options.prompt);
  const at::Tensor prompt_tokens = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), at::kLong);
  const auto start = std::chrono::steady_clock::now();
  const std::string text = train::ByteTokenizer::decode(model::generate(model, prompt_tokens, sample));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s%s\n", options.prompt.c_str(), text.c_str());
  if (options.timing) {
    std::fprintf(stderr, "meshtrain: %lld tokens in %.3f s (%.1f tokens/s, %s)\n", (long long)options.tokens, seconds,
                 options.tokens / seconds, sample.kv_cache ? "kv cache" : "full recompute");
  }
  return 0;
}

}  // namespace meshtrain::apps
