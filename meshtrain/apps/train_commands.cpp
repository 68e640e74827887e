// meshtrain train / prepare / generate.
#include "meshtrain/apps/commands.h"

#include "meshtrain/model/generate.h"
#include "meshtrain/train/checkpoint.h"
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
  std::string folder = options.checkpoint;
  if (!util::path_exists(util::join_path(folder, "MANIFEST.json"))) {
    folder = train::CheckpointStore(options.checkpoint, 1).latest();
    if (folder.empty()) {
      throw train::CheckpointError("no checkpoint in " + options.checkpoint +
                                   " (give a checkpoint folder, or a directory with a 'latest' pointer)");
    }
  }
  const train::CheckpointMeta meta = train::CheckpointStore::read_meta(folder);
  model::Gpt model(train::model_config_from_json(meta.model_config), 0);
  train::CheckpointStore(options.checkpoint, 1).load(folder, *model, nullptr, meta.model);
  model::SampleOptions sample;
  sample.tokens = options.tokens;
  sample.temperature = options.temperature;
  sample.top_k = options.top_k;
  sample.seed = options.seed;
  const auto prompt = train::ByteTokenizer::encode(options.prompt);
  const at::Tensor prompt_tokens = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), at::kLong);
  const std::string text = train::ByteTokenizer::decode(model::generate(model, prompt_tokens, sample));
  std::printf("%s%s\n", options.prompt.c_str(), text.c_str());
  return 0;
}

}  // namespace meshtrain::apps
