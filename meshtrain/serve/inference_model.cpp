#include "meshtrain/serve/inference_model.h"

#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/offload/host_memory.h"
#include "meshtrain/parallel/tensor_parallel_ops.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/model/lora.h"
#include "meshtrain/util/files.h"

#include "meshtrain/train/data.h"
#include "meshtrain/util/memory.h"

#include <cstdio>
#include <filesystem>
#include <optional>

namespace meshtrain::serve {

void InferenceOffload::validate() const {
  if (kv == offload::Tier::kNvme) throw std::invalid_argument("offload.kv = \"nvme\": use \"device\" or \"cpu\"");
  if (prefetch < 0) throw std::invalid_argument("offload.prefetch = " + std::to_string(prefetch) + ": must be >= 0");
}

namespace {

// A checkpoint's parameters into `gpt`; a checkpoint of LoRA adapters (its
// model config names the base) loads the base, then merges the adapters.
void load_parameters(model::Gpt& gpt, checkpoint::CheckpointReader& reader, const std::string& folder) {
  torch::NoGradGuard no_grad;
  auto load = [&gpt](checkpoint::CheckpointReader& from) {
    for (auto& item : gpt->named_parameters()) item.value().copy_(from.read("model/" + item.key()).view_as(item.value()));
  };
  const std::optional<model::LoraSection> lora = model::lora_of(reader.metadata().model_config);
  if (!lora) return load(reader);
  const std::string& base = lora->base;
  if (base.empty() || !util::path_exists(base)) {
    throw std::invalid_argument(folder + " holds LoRA adapters for the base model " +
                                (base.empty() ? std::string("(none recorded: trained without checkpoint.init_from)") : base) +
                                ", which is not there; export the adapters with `meshtrain export peft` and serve them "
                                "on the base with --lora");
  }
  checkpoint::CheckpointReader base_reader(checkpoint::CheckpointStore::resolve(base));
  load(base_reader);
  model::merge_lora(gpt, lora->config, read_adapters(reader));
}

}  // namespace

std::map<std::string, at::Tensor> read_adapters(checkpoint::CheckpointReader& reader) {
  std::map<std::string, at::Tensor> adapters;
  for (const auto& [name, entry] : reader.metadata().tensors) {
    if (name.rfind("model/", 0) == 0 && model::is_lora_parameter(name)) adapters[name.substr(6)] = reader.read(name);
  }
  return adapters;
}

InferenceModel::InferenceModel(const std::string& checkpoint, parallel::CommPtr tp_group, InferenceOffload offload,
                               const std::string& lora)
    : group_(std::move(tp_group)), offload_(std::move(offload)) {
  offload_.validate();
  // Offloaded weights are loaded in host memory, then streamed (Note [Host scope]).
  std::optional<memory::HostScope> host;
  if (offload_.weights != offload::Tier::kDevice) host.emplace();
  const std::string folder = checkpoint::CheckpointStore::resolve(checkpoint);
  checkpoint::CheckpointReader reader(folder);
  name_ = std::filesystem::path(folder).filename().string();
  step_ = reader.metadata().step;
  tokenizer_ = text::tokenizer_from_json(reader.metadata().tokenizer);
  gpt_ = model::Gpt(model::config_from_json(reader.metadata().model_config), 0);
  check_tokenizer();
  load_parameters(gpt_, reader, folder);
  if (!lora.empty()) {
    const model::PeftAdapter adapter = model::read_peft_adapter(lora, gpt_->config());
    model::merge_lora(gpt_, adapter.config, adapter.adapters);
    name_ += "+" + std::filesystem::path(lora).filename().string();
    std::string targets;
    for (const std::string& t : adapter.config.targets) targets += (targets.empty() ? "" : ",") + t;
    char alpha[32];
    std::snprintf(alpha, sizeof alpha, "%g", adapter.config.alpha);
    adapter_ = "LoRA adapter " + lora + " merged (rank " + std::to_string(adapter.config.rank) + ", alpha " + alpha +
               ", on " + targets + ")";
  }
  split();
  host.reset();
  stream_weights();
}

InferenceModel::InferenceModel(model::Gpt gpt, parallel::CommPtr tp_group, std::string name, InferenceOffload offload)
    : gpt_(std::move(gpt)),
      group_(std::move(tp_group)),
      tokenizer_(text::bytes_tokenizer()),
      name_(std::move(name)),
      offload_(std::move(offload)) {
  offload_.validate();
  check_tokenizer();
  {
    std::optional<memory::HostScope> host;
    if (offload_.weights != offload::Tier::kDevice) host.emplace();
    split();
  }
  stream_weights();
}

void InferenceModel::check_tokenizer() {
  const int64_t vocab = gpt_->config().vocab_size, tokens = tokenizer_->vocab_size();
  if (tokens > vocab) {
    throw std::invalid_argument("the model's tokenizer (" + tokenizer_->describe() + ") has more tokens than the model's " +
                                "vocabulary of " + std::to_string(vocab) + "; its ids from " + std::to_string(vocab) +
                                " on have no embedding: the checkpoint does not belong to this tokenizer");
  }
  sampleable_ = at::zeros({vocab}, at::kBool);
  bool* allowed = sampleable_.data_ptr<bool>();
  for (int64_t id = 0; id < vocab; ++id) allowed[id] = tokenizer_->can_decode(id);
}

void InferenceModel::stream_weights() {
  const offload::Tier tier = offload_.weights;
  if (tier == offload::Tier::kDevice) return;
  torch::NoGradGuard no_grad;
  for (auto& p : gpt_->parameters()) p.set_requires_grad(false);
  offload::StoreOptions options;
  options.nvme_dir = offload_.nvme_dir;
  options.max_in_flight = std::max(offload_.prefetch, 1);
  store_ = std::make_shared<offload::TieredStore>(options);
  stream_ = std::make_shared<offload::WeightStream>(gpt_, store_, tier, offload_.prefetch);
  gpt_->add_forward_hooks(stream_);
  // What is not streamed (embeddings, final norm, head) is copied to the
  // device; its host copy is freed.
  for (auto& item : gpt_->named_parameters()) {
    if (item.key().rfind("blocks.", 0) == 0) continue;
    at::Tensor& p = item.value();
    p.set_data(p.detach().clone());
  }
  for (auto& item : gpt_->named_buffers()) item.value().set_data(item.value().detach().clone());
}

model::KvCacheStorage InferenceModel::kv_storage() const {
  if (offload_.kv != offload::Tier::kHost) return {};
  return [](at::IntArrayRef sizes, const at::TensorOptions& options) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    return offload::host_tensor(numel, options.dtype().toScalarType()).view(sizes);
  };
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
  if (!options.kv_storage) options.kv_storage = kv_storage();
  if (!options.sampleable.defined()) options.sampleable = sampleable_;
  return options;
}

std::vector<int64_t> InferenceModel::encode(const std::string& text, bool add_special_tokens) const {
  std::vector<int64_t> ids = tokenizer_->encode(text);
  return add_special_tokens ? tokenizer_->with_special_tokens(std::move(ids)) : ids;
}

std::function<std::string(const std::vector<int64_t>&)> InferenceModel::continuation(
    const std::vector<int64_t>& prompt, bool skip_special) const {
  // The prompt's last few tokens are context enough; the text they decode to
  // is cut from the front of each decoding (a character the prompt cuts in
  // two is not part of it).
  constexpr size_t kContext = 4;
  std::vector<int64_t> context(prompt.size() > kContext ? prompt.end() - kContext : prompt.begin(), prompt.end());
  std::string head;
  try {
    head = tokenizer_->decode(context);
  } catch (const text::TokenizerError&) {
    context.clear();
  }
  const text::Tokenizer* tokenizer = tokenizer_.get();
  return [tokenizer, context, head, skip_special](const std::vector<int64_t>& generated) {
    std::vector<int64_t> kept;
    if (skip_special) {
      for (const int64_t id : generated) {
        if (!tokenizer->is_special(id)) kept.push_back(id);
      }
    }
    const std::vector<int64_t>& tokens = skip_special ? kept : generated;
    if (context.empty()) return tokenizer->decode(tokens);
    std::vector<int64_t> all = context;
    all.insert(all.end(), tokens.begin(), tokens.end());
    const std::string whole = tokenizer->decode(all);
    if (whole.compare(0, head.size(), head) == 0) return whole.substr(head.size());
    return tokenizer->decode(tokens);
  };
}

std::string InferenceModel::decode(const std::vector<int64_t>& tokens) const {
  return tokenizer_->decode(tokens);
}

}  // namespace meshtrain::serve
