// The trainer's checkpoints: saving the training state as this layout holds
// it, and resuming into any layout. See Note [Resume].
#include "meshtrain/train/trainer.h"

#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/job_environment.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/parallel/parallel_state.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace meshtrain::train {

// Note [Resume]
// The candidates are the complete checkpoints of checkpoint.dir, newest
// first (the one `latest` names first). Each is verified (manifest, sizes,
// metadata checksum) and loaded: every rank reads what overlaps the tensors
// it holds in this run's layout, checking block checksums. A failure on any
// rank is agreed by all; the checkpoint is then passed over with a warning
// naming the file and what is wrong, a "checkpoint_skipped" line goes to
// metrics.jsonl, and the next older one is tried (nothing is deleted). A
// checkpoint of another model is an error, not a reason to go back. Random
// streams are restored when the layout and world size are the saving run's;
// otherwise they are re-derived from the seed and the step (dropout masks
// then differ from an uninterrupted run; nothing else does). The optimizer's
// step count is the checkpoint's step; the learning rate follows from it.

namespace {

bool is_random_stream(const std::string& name) { return name.rfind("rng/", 0) == 0; }

// The layout a checkpoint records: the degrees, and how tensor parallel was
// applied (the annotated one keeps no per-rank stream: a change of either
// reseeds the random streams, the model and optimizer states load alike).
std::string layout_of(const TrainConfig& config) {
  return config.parallel.dims.str() + (config.parallel.annotated() ? " tp_impl=annotations" : "");
}

// The model config a checkpoint records; with LoRA, the adapters' config and
// the base they adapt under "lora" (the checkpoint holds the adapters alone).
std::string model_config_of(const TrainConfig& config) {
  if (!config.lora.enabled()) return model::to_json(config.model);
  const std::string base =
      config.init_from.empty() ? "" : util::canonical_path(checkpoint::CheckpointStore::resolve(config.init_from));
  return model::with_lora(model::to_json(config.model), {config.lora, base});
}

// The adapters' shape: what a checkpoint of them must match to load (not
// dropout, nor the dtype the base was kept in).
std::string adapters_of(model::LoraConfig lora) {
  lora.dropout = 0;
  lora.base_dtype = at::kFloat;
  return lora.to_json();
}

// What a checkpoint's model config says of LoRA: "" (none) or its adapters' shape.
std::string lora_of(const std::string& model_config) {
  const std::optional<model::LoraSection> lora = model::lora_of(model_config);
  return lora ? adapters_of(lora->config) : "";
}

}  // namespace

bool Trainer::state_is_finite() {
  bool finite = true;
  for (const placement::StateTensor& t : parallel::training_state(parts())) {
    const at::Tensor& tensor = t.local;
    if (is_random_stream(t.name) || !tensor.defined() || !at::isFloatingType(tensor.scalar_type())) continue;
    // max and min propagate NaN and show an infinity, without a tensor of flags as large as the state.
    if (tensor.numel() > 0 && !(std::isfinite(tensor.max().item<double>()) && std::isfinite(tensor.min().item<double>()))) {
      finite = false;
      break;
    }
  }
  return comm::agree_values(*world_, {finite ? 1.0 : 0.0}, comm::ReduceOp::kMin)[0] > 0;
}

void Trainer::save_checkpoint() {
  memory::PhaseScope phase(memory::Phase::kCheckpoint);
  if (!state_is_finite()) {  // whatever made it so: a checkpoint never holds it (Note [Non-finite steps])
    finish_checkpoints();
    throw comm::AgreedError("step " + std::to_string(step_) + ": the parameters or optimizer states hold non-finite "
                            "values; not saved, so the checkpoints in " + writer_->store().dir() +
                            " keep the last finite state");
  }
  checkpoint::Metadata meta;
  meta.step = step_;
  meta.cursor = cursor_;
  meta.model = model_fingerprint();
  meta.model_config = model_config_of(config_);
  meta.layout = layout_of(config_);
  meta.world = world_->size();
  meta.tokenizer = text::tokenizer_to_json(*tokenizer_);
  writer_->save(std::move(meta), parallel::training_state(parts()), mesh().layout());
  saved_step_ = step_;  // once it is written: a failure is raised before anything relies on it
}

void Trainer::finish_checkpoints() { writer_->wait(); }

namespace {

// "model.layers = 1 here, 2 there, ...": the model keys this run sets otherwise
// than the checkpoint's model; this run's fingerprint where none can be named.
std::string model_differences(const model::GptConfig& configured, const std::string& saved_json) {
  std::string out;
  try {
    const nlohmann::json here = nlohmann::json::parse(model::to_json(configured));
    const nlohmann::json there = nlohmann::json::parse(model::to_json(model::config_from_json(saved_json)));
    for (const auto& [key, value] : here.items()) {
      if (there.contains(key) && there[key] == value) continue;
      out += (out.empty() ? "model." : ", model.") + key + " = " + value.dump() + " here, " +
             (there.contains(key) ? there[key].dump() : "unset") + " there";
    }
  } catch (const std::exception&) {
    out.clear();
  }
  return out.empty() ? model::fingerprint(configured) + " here" : out;
}

}  // namespace

void Trainer::load_checkpoint(const std::string& folder) {
  std::unique_ptr<checkpoint::CheckpointReader> reader;
  comm::on_all_or_all_fail(*world_, [&] { reader = std::make_unique<checkpoint::CheckpointReader>(folder); });
  const checkpoint::Metadata& meta = reader->metadata();
  if (meta.model != model_fingerprint()) {
    throw ConfigError("checkpoint " + folder + " holds a different model (" + model_differences(config_.model, meta.model_config) +
                      "); use another run.out or checkpoint.dir, or set checkpoint.resume = false to start afresh");
  }
  const std::string lora = config_.lora.enabled() ? adapters_of(config_.lora) : "";
  if (lora_of(meta.model_config) != lora) {
    const std::string held = lora_of(meta.model_config);
    throw ConfigError("checkpoint " + folder + " holds " + (held.empty() ? "a whole model" : "LoRA adapters " + held) +
                      ", and this run trains " + (lora.empty() ? "the whole model" : "LoRA adapters " + lora) +
                      "; use another checkpoint.dir or set checkpoint.resume = false");
  }
  const bool same_layout = meta.layout == layout_of(config_) && meta.world == world_->size();
  comm::on_all_or_all_fail(*world_, [&] {
    reader->load(parallel::training_state(parts()), mesh().layout(), world_->rank(),
                 [&](const std::string& name) { return same_layout || !is_random_stream(name); });
  });
  parallel::after_load(parts(), meta.step, same_layout);
  if (!same_layout) parts().random.reseed(config_.seed, meta.step);
  step_ = meta.step;
  cursor_ = meta.cursor;
}

void Trainer::resume() {
  // The candidates as rank 0 sees them, so that every rank tries the same ones.
  std::string listing;
  comm::on_root_or_all_fail(*world_, 0, [&] {
    const checkpoint::CheckpointStore& store = writer_->store();
    std::vector<std::string> folders = store.complete();
    std::string latest;
    try {
      latest = store.latest();
    } catch (const CheckpointError& e) {
      std::fprintf(stderr, "meshtrain: warning: %s; trying the step folders instead\n", e.what());
    }
    if (!latest.empty()) listing += latest + "\n";
    for (const std::string& f : folders) {
      if (f != latest) listing += f + "\n";
    }
  });
  const auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    for (size_t start = 0, end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
      out.push_back(text.substr(start, end - start));
    }
    return out;
  };
  std::vector<std::string> candidates = lines(comm::all_gather_strings(*world_, world_->rank() == 0 ? listing : "").front());
  if (config_.checkpoint_local) {
    // Note [Local checkpoints]: only the steps every host holds complete.
    std::string mine;
    for (const std::string& f : writer_->store().complete()) mine += f + "\n";
    std::vector<std::vector<std::string>> held;  // each rank's complete steps
    for (const std::string& text : comm::all_gather_strings(*world_, mine)) held.push_back(lines(text));
    std::vector<std::string> common;
    for (const std::string& folder : candidates) {
      const bool everywhere = std::all_of(held.begin(), held.end(), [&](const std::vector<std::string>& folders) {
        return std::find(folders.begin(), folders.end(), folder) != folders.end();
      });
      if (everywhere) common.push_back(folder);
    }
    if (common.empty() && !candidates.empty()) {
      std::vector<int> lacking;
      for (size_t r = 0; r < held.size(); ++r) {
        if (held[r].empty()) lacking.push_back(static_cast<int>(r));
      }
      throw comm::AgreedError(
          "checkpoint.local: no step in " + writer_->store().dir() + " is complete on every host (rank 0's host holds " +
          util::base_name(candidates.front()) + "; " +
          (lacking.empty() ? std::string("the others hold other steps") : comm::job_placement().describe(lacking) + " hold none") +
          "): a local checkpoint resumes on the hosts that wrote it. Run there, gather one with `meshtrain checkpoint "
          "gather`, or set checkpoint.resume = false to start afresh");
    }
    candidates = common;
  }
  for (const std::string& folder : candidates) {
    try {
      load_checkpoint(folder);
    } catch (const comm::AgreedError& e) {
      skipped_.push_back({folder, e.what()});
      if (world_->rank() == 0) {
        std::fprintf(stderr, "meshtrain: warning: checkpoint %s is unusable: %s; trying an older one\n", folder.c_str(),
                     e.what());
      }
      continue;
    }
    resumed_ = true;
    saved_step_ = step_;
    resumed_from_ = folder;
    return;
  }
  if (!candidates.empty()) {
    throw comm::AgreedError("no usable checkpoint in " + writer_->store().dir() + " (" +
                          std::to_string(candidates.size()) + " tried; the newest: " + skipped_.front().reason +
                          "); move them away or set checkpoint.resume = false to start afresh");
  }
}

void Trainer::log_resume_events() {
  for (const Skipped& s : skipped_) {
    progress_->event(nlohmann::json{{"event", "checkpoint_skipped"},
                                    {"checkpoint", s.folder},
                                    {"reason", s.reason},
                                    {"resumed_from", resumed_from_},
                                    {"step", step_}}
                         .dump());
  }
}

}  // namespace meshtrain::train

namespace meshtrain::train {

// Note [Fine-tuning start]
// checkpoint.init_from names a checkpoint (typically `import hf`'s output)
// whose model config replaces the preset as the config is read, [model] keys
// applying on top, and whose parameters, only, are loaded at the start when
// checkpoint.dir holds nothing to resume: the optimizer starts fresh at step 0
// and the data at the start of its stream. A run that has saved resumes from
// checkpoint.dir as any run does. The model must be the checkpoint's but for
// the context (a learned position table then refuses to load by shape).
// With LoRA (lora.rank > 0) the checkpoint's parameters are the frozen base,
// loaded before anything resumes: checkpoint.dir then holds the adapters
// and their optimizer state alone, and names the base in its model config.
model::GptConfig init_model(const std::string& checkpoint_dir) {
  try {
    const checkpoint::Metadata meta =
        checkpoint::CheckpointStore::read_metadata(checkpoint::CheckpointStore::resolve(checkpoint_dir));
    return model::config_from_json(meta.model_config);
  } catch (const std::exception& e) {
    throw ConfigError("checkpoint.init_from = \"" + checkpoint_dir + "\": " + e.what());
  }
}

std::unique_ptr<text::Tokenizer> load_training_tokenizer(const std::string& spec) {
  const std::string prefix = kCheckpointTokenizer;
  if (spec.rfind(prefix, 0) != 0) return text::load_tokenizer(spec);
  const std::string dir = spec.substr(prefix.size());
  std::string json;
  try {
    json = checkpoint::CheckpointStore::read_metadata(checkpoint::CheckpointStore::resolve(dir)).tokenizer;
  } catch (const std::exception& e) {
    throw text::TokenizerError("the tokenizer of checkpoint " + dir + ": " + e.what());
  }
  return text::tokenizer_from_json(json);
}

void Trainer::init_from_checkpoint() {
  const std::string folder = checkpoint::CheckpointStore::resolve(config_.init_from);
  std::unique_ptr<checkpoint::CheckpointReader> reader;
  comm::on_all_or_all_fail(*world_, [&] { reader = std::make_unique<checkpoint::CheckpointReader>(folder); });
  model::GptConfig saved = model::config_from_json(reader->metadata().model_config);
  saved.context = config_.model.context;
  if (model::fingerprint(saved) != model_fingerprint()) {
    throw ConfigError("checkpoint.init_from = \"" + config_.init_from + "\" holds " + reader->metadata().model +
                      ", not the configured " + model_fingerprint() + "; leave [model] as the checkpoint has it");
  }
  if (!lora_of(reader->metadata().model_config).empty()) {
    throw ConfigError("checkpoint.init_from = \"" + config_.init_from + "\" holds LoRA adapters, not a model; start "
                      "from the model they adapt, or from a merged export (`meshtrain export hf`, then `import hf`)");
  }
  // LoRA: the frozen base only (the adapters start afresh, Note [LoRA]).
  const placement::TrainingState state =
      config_.lora.enabled() ? parallel::frozen_state(parts()) : parallel::training_state(parts());
  comm::on_all_or_all_fail(*world_, [&] {
    reader->load(state, mesh().layout(), world_->rank(), [](const std::string& name) { return name.rfind("model/", 0) == 0; });
  });
  parallel::after_load(parts(), 0, false);
  initialized_from_ = folder;
}

}  // namespace meshtrain::train
