// meshtrain train / prepare.
#include "meshtrain/apps/commands.h"

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

int run_prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                const std::string& tokenizer) {
  const train::PrepareResult result = train::prepare(inputs, out_dir, val_fraction, tokenizer);
  std::printf("meshtrain prepare: %zu file(s) -> %s (%lld tokens), %s (%lld tokens)\n", result.sources.size(),
              result.train_path.c_str(), static_cast<long long>(result.train_tokens), result.val_path.c_str(),
              static_cast<long long>(result.val_tokens));
  return 0;
}

}  // namespace meshtrain::apps
