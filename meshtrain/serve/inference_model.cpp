#include "meshtrain/serve/inference_model.h"

#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/parallel/tensor_parallel_ops.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"

#include <filesystem>

namespace meshtrain::serve {

InferenceModel::InferenceModel(const std::string& checkpoint, parallel::CommPtr tp_group) : group_(std::move(tp_group)) {
  const std::string folder = checkpoint::CheckpointStore::resolve(checkpoint);
  checkpoint::CheckpointReader reader(folder);
  name_ = std::filesystem::path(folder).filename().string();
  step_ = reader.metadata().step;
  tokenizer_ = text::tokenizer_from_json(reader.metadata().tokenizer);
  gpt_ = model::Gpt(train::model_config_from_json(reader.metadata().model_config), 0);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : gpt_->named_parameters()) item.value().copy_(reader.read("model/" + item.key()).view_as(item.value()));
  }
  split();
}

InferenceModel::InferenceModel(model::Gpt gpt, parallel::CommPtr tp_group, std::string name)
    : gpt_(std::move(gpt)), group_(std::move(tp_group)), tokenizer_(text::bytes_tokenizer()), name_(std::move(name)) {
  split();
}

void InferenceModel::split() {
  gpt_->eval();
  if (group_ && group_->size() > 1) {
    parallel::check_tensor_parallel(gpt_->config(), group_->size(), /*sequence_parallel=*/false);
    tp_ = std::make_unique<parallel::TensorParallel>(
        gpt_, group_, parallel::gpt_tensor_parallel_plan(gpt_->config(), false), parallel::TensorParallelOptions{});
  }
}

InferenceModel::~InferenceModel() = default;

model::SampleOptions InferenceModel::with_split(model::SampleOptions options) const {
  if (tp_) {
    parallel::CommPtr group = group_;
    options.full_vocabulary = [group](const at::Tensor& logits) {
      return parallel::all_gather_along(logits.contiguous(), *group, logits.dim() - 1);
    };
  }
  return options;
}

std::vector<int64_t> InferenceModel::encode(const std::string& text) const {
  return tokenizer_->encode(text);
}

std::string InferenceModel::decode(const std::vector<int64_t>& tokens) const {
  return tokenizer_->decode(tokens);
}

}  // namespace meshtrain::serve
