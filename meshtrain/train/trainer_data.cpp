// The trainer's data: [data] prepared by every rank (prepare.h), opened as
// datasets, and read as each data rank's micro-batches with their loss weights.
#include "meshtrain/comm/agree.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/train/prepare.h"
#include "meshtrain/train/trainer.h"

#include <cstdio>

namespace meshtrain::train {

std::vector<std::string> Trainer::prepare_sources() {
  std::vector<TrainConfig::Source> sources = config_.sources;
  if (sources.empty()) sources.push_back({config_.text, 1.0});
  std::vector<std::string> dirs;
  for (size_t i = 0; i < sources.size(); ++i) {
    PrepareOptions o;
    o.inputs = sources[i].path;
    o.out_dir = config_.out + "/data" + (config_.sources.empty() ? "" : "/source-" + std::to_string(i));
    o.val_fraction = config_.val_fraction;
    o.tokenizer = config_.tokenizer;
    o.format = config_.data_format;
    o.field = config_.field;
    o.loss_on = config_.loss_on;
    o.split_mb = config_.split_mb;
    const PrepareResult r = prepare(o, world_.get());
    if (world_->rank() == 0) {
      std::printf("meshtrain: %s %zu file(s) into %s: %lld training tokens (%lld documents), %lld validation%s\n",
                  r.reused ? "using" : "prepared", r.sources.size(), o.out_dir.c_str(), (long long)r.train_tokens,
                  (long long)r.train_documents, (long long)r.val_tokens,
                  r.train_counted != r.train_tokens ? (", " + std::to_string(r.train_counted) +
                                                       " training tokens count toward the loss").c_str() : "");
      std::fflush(stdout);
    }
    dirs.push_back(o.out_dir);
  }
  return dirs;
}

void Trainer::open_data() {
  try {
    tokenizer_ = load_training_tokenizer(config_.tokenizer);
  } catch (const text::TokenizerError& e) {
    throw ConfigError(std::string("data.tokenizer: ") + e.what());
  }
  if (tokenizer_->vocab_size() > config_.model.vocab_size) {
    throw ConfigError("model.vocab_size = " + std::to_string(config_.model.vocab_size) + " is smaller than the " +
                      "tokenizer's vocabulary (" + tokenizer_->describe() + "); set model.vocab_size = " +
                      std::to_string(tokenizer_->vocab_size()));
  }
  // Token files as given, or the configured sources prepared by every rank.
  std::vector<std::pair<std::string, std::string>> files;  // (train, val) per source
  if (config_.train_file.empty()) {
    for (const std::string& dir : prepare_sources()) files.push_back({dir + "/train.bin", dir + "/val.bin"});
    config_.train_file = files.front().first;
    config_.val_file = files.front().second;
  } else {
    files.push_back({config_.train_file, config_.val_file});
  }
  comm::on_all_or_all_fail(*world_, [&] {
    std::vector<SamplerSource> train, val;
    int64_t tokens = 0, documents = 0;
    for (size_t i = 0; i < files.size(); ++i) {
      train_data_.push_back(std::make_unique<TokenDataset>(files[i].first));
      val_data_.push_back(std::make_unique<TokenDataset>(files[i].second));
      const double weight = config_.sources.empty() ? 1.0 : config_.sources[i].weight;
      for (auto* data : {train_data_.back().get(), val_data_.back().get()}) {
        if (data->tokens().vocab_size() > config_.model.vocab_size) {
          data_error(data->tokens().path(), "its vocabulary of " +
                          std::to_string(data->tokens().vocab_size()) + " tokens is larger than model.vocab_size = " +
                          std::to_string(config_.model.vocab_size) + "; set model.vocab_size = " +
                          std::to_string(data->tokens().vocab_size()) + " (or the tokenizer's, with data.tokenizer)");
        }
        (data == train_data_.back().get() ? train : val)
            .push_back({&data->tokens(), data->mask(), data, weight});
      }
      tokens += train_data_.back()->tokens().size();
      documents += train_data_.back()->documents();
    }
    const int64_t pad = std::max<int64_t>(tokenizer_->end_of_text(), 0);
    train_sampler_ = std::make_unique<Sampler>(train, config_.model.context, config_.seed, true, config_.packing, pad);
    val_sampler_ = std::make_unique<Sampler>(val, config_.model.context, config_.seed, false, config_.packing, pad);
    data_summary_ = config_.train_file + (files.size() > 1 ? " and " + std::to_string(files.size() - 1) + " more" : "") +
                    " (" + std::to_string(tokens) + " tokens, " + std::to_string(documents) + " documents" +
                    (train_sampler_->ignores_targets() ? ", masked or padded targets count toward no loss" : "") + ")";
  });
}

std::vector<model::Batch> Trainer::micro_batches(Sampler& sampler, int64_t start, int64_t count) const {
  // Data rank r reads micro-batches r, r + ranks, ... of the stream from `start`.
  const auto& data = parts().data;
  const int64_t micro = config_.micro_batch, ranks = data->size();
  std::vector<model::Batch> out;
  const bool weighted = sampler.ignores_targets();
  // The counted targets of the whole global batch: every rank reads them alike, no collective needed.
  const int64_t global = weighted ? sampler.counted_targets(start, count * ranks * micro) : 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t cursor = start + (i * ranks + data->rank()) * micro;
    auto [x, y] = sampler.rows(cursor, micro);
    double weight = 1.0 / static_cast<double>(count);
    if (weighted) {
      // Gradients are averaged over the data ranks: a share of `global`, times the ranks.
      const double counted = static_cast<double>((y != kIgnoredTarget).sum().item<int64_t>());
      weight = global > 0 ? counted * static_cast<double>(ranks) / static_cast<double>(global) : 0.0;
    }
    const at::Tensor positions = sampler.positions(cursor, micro);
    const model::Batch batch =
        positions.defined() ? model::Batch::packed(x, y, positions, weight) : model::Batch(x, y, weight);
    out.push_back(batch.to(device_));
  }
  return out;
}

}  // namespace meshtrain::train
