#include "meshtrain/train/config.h"

#include "meshtrain/comm/runtime.h"
#include "meshtrain/model/gpt_config_keys.h"
#include "meshtrain/util/config_toml.h"
#include "meshtrain/util/suggest.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>
#include <toml++/toml.h>

#include <algorithm>
#include <sstream>
#include <utility>

namespace meshtrain::train {

namespace {

using config::Kind;
using config::Value;
using Field = config::Key<TrainConfig>;

template <typename Access>
Field field(std::string section, std::string key, std::string help, Access access) {
  return config::key<TrainConfig>(std::move(section), std::move(key), std::move(help), access);
}

#define MESHTRAIN_CONFIG_MEMBER(expression) [](TrainConfig& c) -> auto& { return c.expression; }

const config::Names<at::ScalarType>& compute_dtype_names() { return parallel::state_dtype_names(); }

const config::Names<DataFormat>& data_format_names() {
  static const config::Names<DataFormat> names = {{DataFormat::kText, "text"}, {DataFormat::kChat, "chat"}};
  return names;
}

const config::Names<LossOn>& loss_on_names() {
  static const config::Names<LossOn> names = {{LossOn::kAssistant, "assistant"}, {LossOn::kAll, "all"}};
  return names;
}

const config::Names<Packing>& packing_names() {
  static const config::Names<Packing> names = {
      {Packing::kConcat, "concat"}, {Packing::kPadded, "padded"}, {Packing::kPacked, "packed"}};
  return names;
}

const config::Names<OnNonfinite>& on_nonfinite_names() {
  static const config::Names<OnNonfinite> names = {{OnNonfinite::kStop, "stop"}, {OnNonfinite::kSkip, "skip"}};
  return names;
}

std::string preset_list() {
  std::string names;
  for (const std::string& n : model::GptConfig::preset_names()) names += (names.empty() ? "" : ", ") + n;
  return names;
}

// [model]: the shape. Model keys apply on top of the preset.
void add_model_keys(std::vector<Field>& f) {
  f.push_back({"model", "preset", Kind::kString, "named shape: " + preset_list(),
               [](TrainConfig& c, const Value& v) {
                 c.preset = v.s;
                 c.model = model::GptConfig::preset(v.s);
               },
               [](const TrainConfig& c) { return "\"" + c.preset + "\""; }});
  // The rest of [model]: the model's own keys (Note [Model keys]).
  for (const model::ModelKey& key : model::model_keys()) {
    f.push_back(config::lift<TrainConfig>(key.key, MESHTRAIN_CONFIG_MEMBER(model)));
  }
}

// [data] and [training].
void add_data_and_training_keys(std::vector<Field>& f) {
  f.push_back(field("data", "tokenizer", "\"bytes\", a SentencePiece .model, a tokenizer.json, a folder with "
                    "vocab.json + merges.txt (GPT-2 BPE) or a Hugging Face tokenizer, or checkpoint:DIR (the tokenizer "
                    "a checkpoint holds; checkpoint.init_from's unless this names another); model.vocab_size must "
                    "hold its vocabulary",
                    MESHTRAIN_CONFIG_MEMBER(tokenizer)));
  f.push_back(field("data", "text", "files or folders (text, JSON Lines, Parquet) prepared by every rank when no token "
                    "files are given",
                    MESHTRAIN_CONFIG_MEMBER(text)));
  f.push_back(field("data", "train_file", "training token file from `meshtrain prepare` (overrides text)",
                    MESHTRAIN_CONFIG_MEMBER(train_file)));
  f.push_back(field("data", "val_file", "validation token file", MESHTRAIN_CONFIG_MEMBER(val_file)));
  f.push_back(field("data", "val_fraction", "share of prepared text held out for validation",
                    MESHTRAIN_CONFIG_MEMBER(val_fraction)));
  f.push_back(config::enum_key<TrainConfig>("data", "format", "\"text\" (text files; JSONL/Parquet records' data.field) "
                                            "or \"chat\" (records of messages, or prompt and completion)",
                                            data_format_names(), MESHTRAIN_CONFIG_MEMBER(data_format)));
  f.push_back(field("data", "field", "the field of a JSONL / Parquet record that holds its text", MESHTRAIN_CONFIG_MEMBER(field)));
  f.push_back(config::enum_key<TrainConfig>("data", "loss_on", "chat: \"assistant\" (only replies count toward the "
                                            "loss) or \"all\"", loss_on_names(), MESHTRAIN_CONFIG_MEMBER(loss_on)));
  f.push_back(config::enum_key<TrainConfig>("data", "packing", "\"concat\" (windows across documents), \"padded\" "
                                            "(one document per row, padding counts toward no loss) or \"packed\" "
                                            "(windows across documents, attention and positions kept inside each)",
                                            packing_names(), MESHTRAIN_CONFIG_MEMBER(packing)));
  f.push_back(field("data", "split_mb", "prepare's unit of work: files are cut every this many MiB",
                    MESHTRAIN_CONFIG_MEMBER(split_mb)));
  f.push_back(field("training", "steps", "optimizer steps", MESHTRAIN_CONFIG_MEMBER(steps)));
  f.push_back(field("training", "batch", "global batch in sequences per step (= micro_batch x dp x accumulation)",
                    MESHTRAIN_CONFIG_MEMBER(batch)));
  f.push_back(field("training", "micro_batch", "sequences per forward/backward on one rank",
                    MESHTRAIN_CONFIG_MEMBER(micro_batch)));
  f.push_back(field("training", "lr", "peak learning rate (AdamW)", MESHTRAIN_CONFIG_MEMBER(lr)));
  f.push_back(field("training", "min_lr", "learning rate at the end of the cosine decay (unset: a tenth of training.lr)",
                    MESHTRAIN_CONFIG_MEMBER(min_lr)));
  f.push_back(field("training", "warmup", "steps of linear warmup", MESHTRAIN_CONFIG_MEMBER(warmup)));
  f.push_back(field("training", "weight_decay", "AdamW weight decay (matrices and embeddings only)",
                    MESHTRAIN_CONFIG_MEMBER(weight_decay)));
  f.push_back(field("training", "beta1", "AdamW beta1", MESHTRAIN_CONFIG_MEMBER(beta1)));
  f.push_back(field("training", "beta2", "AdamW beta2", MESHTRAIN_CONFIG_MEMBER(beta2)));
  f.push_back(field("training", "grad_clip", "clip gradients to this global norm (0: off)",
                    MESHTRAIN_CONFIG_MEMBER(grad_clip)));
  f.push_back(field("training", "seed", "seed of the model init and the data order", MESHTRAIN_CONFIG_MEMBER(seed)));
  f.push_back(config::enum_key<TrainConfig>("training", "dtype", "\"float32\" or \"bfloat16\" (autocast of matmuls)",
                                            compute_dtype_names(), MESHTRAIN_CONFIG_MEMBER(dtype)));
  f.push_back(field("training", "eval_every", "steps between validation losses (0: at the end only)",
                    MESHTRAIN_CONFIG_MEMBER(eval_every)));
  f.push_back(field("training", "eval_batches", "validation micro-batches per rank", MESHTRAIN_CONFIG_MEMBER(eval_batches)));
  f.push_back(field("training", "log_every", "steps between progress lines", MESHTRAIN_CONFIG_MEMBER(log_every)));
  f.push_back(field("training", "sample_tokens", "tokens generated from the model at the end (0: none)",
                    MESHTRAIN_CONFIG_MEMBER(sample_tokens)));
  f.push_back(config::enum_key<TrainConfig>("training", "on_nonfinite",
                                            "a step whose loss or gradient norm is not finite is never applied; "
                                            "\"stop\": the run ends there, \"skip\": the step is passed over",
                                            on_nonfinite_names(), MESHTRAIN_CONFIG_MEMBER(on_nonfinite)));
  f.push_back(field("training", "max_nonfinite_skips", "on_nonfinite = \"skip\": steps passed over in a row before "
                    "the run stops", MESHTRAIN_CONFIG_MEMBER(max_nonfinite_skips)));
  f.push_back(field("lora", "rank", "LoRA: the adapters' rank r; > 0 freezes the model and trains adapters on "
                    "lora.targets only (0: full fine-tuning)", MESHTRAIN_CONFIG_MEMBER(lora.rank)));
  f.push_back(field("lora", "alpha", "LoRA: the update is scaled by alpha / rank", MESHTRAIN_CONFIG_MEMBER(lora.alpha)));
  f.push_back(field("lora", "dropout", "LoRA: dropout on each adapter's input", MESHTRAIN_CONFIG_MEMBER(lora.dropout)));
  f.push_back(field("lora", "targets", "LoRA: the linears adapted, of q, k, v, o, gate, up, down (a GELU MLP's fc is "
                    "up, its proj down; it has no gate)", MESHTRAIN_CONFIG_MEMBER(lora.targets)));
  f.push_back(config::enum_key<TrainConfig>("lora", "base_dtype", "LoRA: the frozen blocks' matrices kept in \"float32\" "
                                            "or \"bfloat16\" (half their memory; needs training.dtype = \"bfloat16\")",
                                            compute_dtype_names(), MESHTRAIN_CONFIG_MEMBER(lora.base_dtype)));
}

// [memory], [checkpoint] and [run].
void add_run_keys(std::vector<Field>& f) {
  f.push_back(field("memory", "limit_mb", "per-rank limit on CPU tensor memory; beyond it a clear out-of-memory "
                    "error (0: none)", MESHTRAIN_CONFIG_MEMBER(memory_limit_mb)));
  f.push_back(field("checkpoint", "dir", "where checkpoints go (default: <run.out>/checkpoints)",
                    MESHTRAIN_CONFIG_MEMBER(checkpoint_dir)));
  f.push_back({"checkpoint", "init_from", Kind::kString,
               "fine-tuning: start from this checkpoint folder's model and weights (an `import hf` output) at step 0 "
               "with a fresh optimizer, when checkpoint.dir has nothing to resume; [model] keys apply on top",
               [](TrainConfig& c, const Value& v) {
                 c.init_from = v.s;
                 if (v.s.empty()) return;
                 c.model = init_model(v.s);
                 c.preset = "init_from";
                 if (c.tokenizer == "bytes") c.tokenizer = kCheckpointTokenizer + v.s;  // the model's own vocabulary
               },
               [](const TrainConfig& c) { return config::quoted(c.init_from); }});
  f.push_back(field("checkpoint", "every", "steps between checkpoints (0: at the end only)",
                    MESHTRAIN_CONFIG_MEMBER(checkpoint_every)));
  f.push_back(field("checkpoint", "async", "write checkpoints in the background from a host copy (the next step "
                    "runs meanwhile; memory for one copy of this rank's state)", MESHTRAIN_CONFIG_MEMBER(checkpoint_async)));
  f.push_back(field("checkpoint", "keep", "checkpoints kept (the newest; at least 1)",
                    MESHTRAIN_CONFIG_MEMBER(checkpoint_keep)));
  f.push_back(field("checkpoint", "local", "checkpoint.dir is a disk of each host's own, not shared: each host writes "
                    "its ranks' files there (every rank all it holds), resume works on the same hosts and layout, and "
                    "`meshtrain checkpoint gather` copies one into a single folder", MESHTRAIN_CONFIG_MEMBER(checkpoint_local)));
  f.push_back(field("checkpoint", "preempt_grace_s", "seconds a scheduler leaves between its stop signal and SIGKILL "
                    "(Slurm's KillWait, 30 by default): after a stop, a checkpoint that would not be written within "
                    "what is left of it is not begun, and the latest one stands", MESHTRAIN_CONFIG_MEMBER(checkpoint_preempt_grace_s)));
  f.push_back(field("checkpoint", "resume", "continue from the latest checkpoint if there is one",
                    MESHTRAIN_CONFIG_MEMBER(resume)));
  f.push_back(field("run", "device", "\"cpu\", \"cuda\" (cuda:local_rank % GPUs), \"cuda:N\" or \"auto\" (cuda when a GPU "
                    "is visible); ranks sharing a GPU communicate through host memory", MESHTRAIN_CONFIG_MEMBER(device)));
  f.push_back(field("run", "out", "run directory: metrics.jsonl, prepared data, checkpoints", MESHTRAIN_CONFIG_MEMBER(out)));
  f.push_back(field("run", "sharding_report", "with parallel.tp_impl = \"annotations\": write the first step's operators "
                    "(input and output placements) and the collectives completion inserted (bytes) to this file, as JSON lines",
                    MESHTRAIN_CONFIG_MEMBER(sharding_report)));
  f.push_back(field("run", "trace_step", "pp > 1: record this step's pipeline spans to <out>/trace.json (Perfetto) and "
                    "draw <out>/timeline.svg (0: none)", MESHTRAIN_CONFIG_MEMBER(trace_step)));
}

// The schema: every key a config may hold, in the order --help lists them.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> f;
    add_model_keys(f);
    add_data_and_training_keys(f);
    for (const config::Key<parallel::ParallelSpec>& key : parallel::ParallelSpec::keys()) {
      f.push_back(config::lift<TrainConfig>(key, MESHTRAIN_CONFIG_MEMBER(parallel)));
    }
    add_run_keys(f);
    return f;
  }();
  return table;
}

#undef MESHTRAIN_CONFIG_MEMBER

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : fields()) {
    if (f.section == section && f.name == key) return &f;
  }
  return nullptr;
}

[[noreturn]] void unknown_key(const std::string& section, const std::string& key, const std::string& where) {
  std::vector<std::string> names, dotted, sections;  // this section's keys, every section.key, every section
  for (const Field& f : fields()) {
    dotted.push_back(f.section + "." + f.name);
    if (f.section == section) names.push_back(f.name);
    if (std::find(sections.begin(), sections.end(), f.section) == sections.end()) sections.push_back(f.section);
  }
  auto joined = [](const std::vector<std::string>& words, const char* before, const char* after) {
    std::string text;
    for (const std::string& w : words) text += (text.empty() ? "" : ", ") + (before + w + after);
    return text;
  };
  if (names.empty()) {
    // A key under a mistyped section ("trainig.steps"), or a mistyped section.
    std::string hint = util::did_you_mean(section + "." + key, dotted);
    if (hint.empty()) hint = util::did_you_mean(section, sections);
    throw ConfigError(where + ": unknown section [" + section + "]" + hint + "; sections are " + joined(sections, "[", "]"));
  }
  std::string hint;
  if (const std::string near = util::nearest(key, names); !near.empty()) {
    hint = " (did you mean " + section + "." + near + "?)";
  } else {
    for (const Field& f : fields()) {  // a key of another section
      if (f.name == key) hint = " (did you mean " + f.section + "." + f.name + "?)";
    }
  }
  throw ConfigError(where + ": unknown key " + section + "." + key + hint + "; keys of [" + section + "] are " +
                    joined(names, "", ""));
}

void apply(TrainConfig& config, const Field& field, const toml::node& node, const std::string& where) {
  const Value value = config::read_value(field.full_name(), field.kind, node, where);
  try {
    field.set(config, value);
  } catch (const ConfigError&) {
    throw;  // names the key and what is allowed already
  } catch (const std::invalid_argument& e) {
    throw ConfigError(where + ": " + field.full_name() + ": " + e.what());
  }
}

// [[data.sources]]: tables of path (a string or a list) and weight.
std::vector<TrainConfig::Source> read_sources(const toml::node& node, const std::string& where) {
  const toml::array* tables = node.as_array();
  if (!tables) throw ConfigError(where + ": data.sources must be [[data.sources]] tables of path and weight");
  std::vector<TrainConfig::Source> sources;
  for (const toml::node& item : *tables) {
    const toml::table* table = item.as_table();
    if (!table) throw ConfigError(where + ": data.sources must be [[data.sources]] tables of path and weight");
    TrainConfig::Source source;
    for (const auto& [key, value] : *table) {
      const std::string name(key.str());
      if (name == "path" && value.is_string()) {
        source.path = {value.value<std::string>().value()};
      } else if (name == "path" && value.is_array()) {
        for (const auto& p : *value.as_array()) {
          if (!p.is_string()) throw ConfigError(where + ": data.sources path must be strings");
          source.path.push_back(p.value<std::string>().value());
        }
      } else if (name == "weight" && value.is_number()) {
        source.weight = value.value<double>().value();
      } else {
        throw ConfigError(where + ": data.sources " + name + " = " + config::node_text(value) +
                          ": a source has path (a string or a list of them) and weight (a number)");
      }
    }
    if (source.path.empty()) throw ConfigError(where + ": a data.sources table needs a path");
    if (!(source.weight > 0)) throw ConfigError(where + ": data.sources weight = " + std::to_string(source.weight) + ": must be > 0");
    sources.push_back(std::move(source));
  }
  return sources;
}

using config::refuse;

}  // namespace

TrainConfig TrainConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  TrainConfig config;
  bool min_lr_given = false;  // else a tenth of training.lr, whatever lr is (1e-4 for the default 1e-3)
  if (!path.empty()) {
    toml::table table;
    try {
      table = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      std::ostringstream where;
      where << path << ":" << e.source().begin.line << ":" << e.source().begin.column;
      throw ConfigError("config " + where.str() + ": " + std::string(e.description()));
    }
    // The preset (or the model of checkpoint.init_from) first, so that model keys in the same file override it.
    if (auto* model = table["model"].as_table()) {
      if (auto* preset = model->get("preset")) apply(config, *find_field("model", "preset"), *preset, "config " + path);
    }
    if (auto* checkpoint = table["checkpoint"].as_table()) {
      if (auto* from = checkpoint->get("init_from")) {
        apply(config, *find_field("checkpoint", "init_from"), *from, "config " + path);
      }
    }
    for (const auto& [section, node] : table) {
      const std::string section_name(section.str());
      const toml::table* keys = node.as_table();
      if (!keys) throw ConfigError("config " + path + ": '" + section_name + "' must be a [section] table");
      for (const auto& [key, value] : *keys) {
        const std::string key_name(key.str());
        if (section_name == "model" && key_name == "preset") continue;
        if (section_name == "checkpoint" && key_name == "init_from") continue;
        if (section_name == "data" && key_name == "sources") {
          config.sources = read_sources(value, "config " + path);
          continue;
        }
        const Field* field = find_field(section_name, key_name);
        if (!field) unknown_key(section_name, key_name, "config " + path);
        apply(config, *field, value, "config " + path);
        min_lr_given |= section_name == "training" && key_name == "min_lr";
      }
    }
  }
  // Overrides: presets first, for the same reason.
  std::vector<std::string> ordered;
  auto first = [](const std::string& o) { return o.rfind("model.preset=", 0) == 0 || o.rfind("checkpoint.init_from=", 0) == 0; };
  for (const auto& o : overrides) if (first(o)) ordered.push_back(o);
  for (const auto& o : overrides) if (!first(o)) ordered.push_back(o);
  for (const std::string& override_text : ordered) {
    const std::string where = "override --" + override_text;
    const size_t eq = override_text.find('=');
    const size_t dot = override_text.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
      throw ConfigError(where + ": write overrides as --section.key=value, e.g. --training.steps=20");
    }
    const std::string section = override_text.substr(0, dot);
    const std::string key = override_text.substr(dot + 1, eq - dot - 1);
    const std::string raw = override_text.substr(eq + 1);
    const Field* field = find_field(section, key);
    if (!field) unknown_key(section, key, where);
    const toml::table parsed = config::override_value(section + "." + key, field->kind, raw, where);
    apply(config, *field, *parsed.get("v"), where);
    min_lr_given |= section == "training" && key == "min_lr";
  }
  if (!min_lr_given) config.min_lr = config.lr / 10;
  return config;
}

namespace {

std::string n(int64_t v) { return std::to_string(v); }
std::string n(double v) { return std::to_string(v); }

// [training]: the optimizer, the schedule and the loop's own counts.
void check_training(const TrainConfig& c) {
  if (c.steps < 1) refuse("training.steps", n(c.steps), "must be >= 1");
  if (c.micro_batch < 1) refuse("training.micro_batch", n(c.micro_batch), "must be >= 1");
  if (c.batch < 1) refuse("training.batch", n(c.batch), "must be >= 1");
  if (!(c.lr > 0)) refuse("training.lr", n(c.lr), "must be > 0");
  if (c.min_lr < 0 || c.min_lr > c.lr) refuse("training.min_lr", n(c.min_lr), "must be in [0, training.lr]");
  if (c.warmup < 0) refuse("training.warmup", n(c.warmup), "must be >= 0");
  if (c.weight_decay < 0) refuse("training.weight_decay", n(c.weight_decay), "must be >= 0");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) refuse("training.beta1", n(c.beta1), "must be in [0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) refuse("training.beta2", n(c.beta2), "must be in [0, 1)");
  if (c.grad_clip < 0) refuse("training.grad_clip", n(c.grad_clip), "must be >= 0 (0: off)");
  if (c.eval_every < 0) refuse("training.eval_every", n(c.eval_every), "must be >= 0");
  if (c.eval_batches < 1) refuse("training.eval_batches", n(c.eval_batches), "must be >= 1");
  if (c.log_every < 1) refuse("training.log_every", n(c.log_every), "must be >= 1");
  if (c.sample_tokens < 0) refuse("training.sample_tokens", n(c.sample_tokens), "must be >= 0");
  if (c.max_nonfinite_skips < 1) refuse("training.max_nonfinite_skips", n(c.max_nonfinite_skips), "must be >= 1");
}

// [data], [memory], [checkpoint] and [run].
void check_data_and_run(const TrainConfig& c) {
  if (c.model.vocab_size != 256 && c.train_file.empty() && (c.tokenizer.empty() || c.tokenizer == "bytes")) {
    refuse("model.vocab_size", n(c.model.vocab_size),
           "text is prepared with the byte tokenizer, which has 256 tokens; use 256, name a larger tokenizer "
           "(data.tokenizer), or give token files (data.train_file, data.val_file) of a larger vocabulary");
  }
  if (!(c.val_fraction > 0 && c.val_fraction < 1)) refuse("data.val_fraction", n(c.val_fraction), "must be in (0, 1)");
  if (c.train_file.empty() != c.val_file.empty()) {
    refuse(c.train_file.empty() ? "data.val_file" : "data.train_file",
           config::quoted(c.train_file.empty() ? c.val_file : c.train_file),
           "give both data.train_file and data.val_file, or neither (then data.text is prepared)");
  }
  if (c.train_file.empty() && c.text.empty() && c.sources.empty()) {
    refuse("data.text", "[]", "name text to train on, data.sources, or data.train_file");
  }
  if (!c.train_file.empty() && !c.sources.empty()) {
    refuse("data.sources", "[...]", "give sources to prepare or token files (data.train_file), not both");
  }
  if (c.split_mb < 1) refuse("data.split_mb", n(c.split_mb), "must be >= 1");

  if (c.memory_limit_mb < 0) refuse("memory.limit_mb", n(c.memory_limit_mb), "must be >= 0 (0: no limit)");
  if (c.checkpoint_every < 0) refuse("checkpoint.every", n(c.checkpoint_every), "must be >= 0");
  if (c.checkpoint_keep < 1) refuse("checkpoint.keep", n(c.checkpoint_keep), "must be >= 1");
  if (!(c.checkpoint_preempt_grace_s > 0)) {
    refuse("checkpoint.preempt_grace_s", n(c.checkpoint_preempt_grace_s), "must be > 0");
  }
  const std::string& device = c.device;
  if (device != "cpu" && device != "cuda" && device != "auto" && device.rfind("cuda:", 0) != 0) {
    refuse("run.device", config::quoted(device), "use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"");
  }
  if ((device == "cuda" || device.rfind("cuda:", 0) == 0) && !torch::cuda::is_available()) {
    refuse("run.device", config::quoted(device),
           at::detail::getCUDAHooks().isBuilt()
               ? "no CUDA device is visible to this process; use \"cpu\" or \"auto\""
               : "this meshtrain was built for the CPU only (MESHTRAIN_CUDA=OFF, scripts/build.sh's choice where no "
                 "NVIDIA driver is loaded); rebuild with MESHTRAIN_CUDA=ON bash scripts/build.sh, or use \"cpu\"");
  }
  if (!c.sharding_report.empty() && !c.parallel.annotated()) {
    refuse("run.sharding_report", config::quoted(c.sharding_report),
           "reports what annotations decided: set parallel.tp_impl = \"annotations\"");
  }
  if (c.trace_step < 0) refuse("run.trace_step", n(c.trace_step), "must be >= 0 (0: none)");
  if (c.out.empty()) refuse("run.out", "\"\"", "must name a directory");
  try {
    c.lora.check(c.model);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (c.lora.base_dtype != at::kFloat && (!c.lora.enabled() || !c.bfloat16())) {
    refuse("lora.base_dtype", "\"bfloat16\"", "a bf16 frozen base is for LoRA (lora.rank > 0) under bf16 autocast "
                                              "(training.dtype = \"bfloat16\")");
  }
  if (c.lora.enabled() && c.parallel.annotated()) {
    refuse("lora.rank", n(c.lora.rank), "adapters are not ruled for parallel.tp_impl = \"annotations\"; use tp_impl \"plan\"");
  }
  if (c.model.z_loss > 0 && c.parallel.annotated()) {
    refuse("model.z_loss", n(c.model.z_loss), "the z-loss is not ruled for parallel.tp_impl = \"annotations\" (its "
                                              "logits are sharded by rules without a log-sum-exp); use tp_impl \"plan\"");
  }
  if (c.lora.enabled() && c.parallel.offload_optimizer != offload::Tier::kDevice) {
    refuse("lora.rank", n(c.lora.rank), "offload.optimizer with LoRA is not supported (the adapters' optimizer state "
                                        "is small); leave offload.optimizer = \"none\"");
  }
  if (c.packing == Packing::kPacked && c.parallel.annotated()) {
    refuse("data.packing", "\"packed\"", "its block-diagonal attention is not ruled for parallel.tp_impl = "
                                         "\"annotations\"; use \"concat\" or \"padded\", or tp_impl \"plan\"");
  }
  // Note [Context parallel]: what the sequence split does not carry.
  if (c.parallel.dims.cp > 1 && c.model.dropout > 0) {
    refuse("model.dropout", std::to_string(c.model.dropout), "context parallel attention has no dropout "
                                                             "(parallel.cp = " + n(c.parallel.dims.cp) + "); set it to 0");
  }
}

}  // namespace

void TrainConfig::validate(int world_size) {
  try {
    model.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  check_training(*this);
  check_data_and_run(*this);
  // Every rule of the layout and the techniques' options (Note [Parallel spec]).
  parallel.check(world_size, model, compute());
  const parallel::ParallelSpec::BatchShape shape = parallel.batch_shape(batch, micro_batch);
  micro_batch = shape.micro_batch;
  grad_accum = shape.microbatches;
}

parallel::Compute TrainConfig::compute() const { return {bfloat16(), device == "cpu"}; }

at::Device TrainConfig::torch_device(int local_rank) const {
  if (device == "cpu") return at::Device(at::kCPU);
  if (device == "cuda" || device == "auto") return comm::device_for_local_rank(local_rank);  // auto: cpu without GPUs
  return at::Device(device);
}

std::string TrainConfig::checkpoint_path() const { return checkpoint_dir.empty() ? out + "/checkpoints" : checkpoint_dir; }

std::string TrainConfig::to_toml(bool every_key) const {
  // What the keys are compared with: the defaults, and for [model] the preset's model (from
  // init_from, the model it brings; a shape of no preset, the default preset's, as a reader starts).
  TrainConfig base;
  const auto& presets = model::GptConfig::preset_names();
  const bool named = std::find(presets.begin(), presets.end(), preset) != presets.end();
  if (named) base.model = model::GptConfig::preset(preset);
  if (preset == "init_from") base.model = model;
  base.min_lr = lr / 10;  // what load() gives an unset min_lr beside this lr
  std::vector<std::pair<std::string, std::string>> sections;  // in the order --help lists them
  for (const Field& f : fields()) {
    if (f.name == "preset" ? !named : !every_key && f.show(*this) == f.show(base)) continue;
    auto it = std::find_if(sections.begin(), sections.end(), [&](const auto& s) { return s.first == f.section; });
    if (it == sections.end()) it = sections.insert(sections.end(), {f.section, ""});
    it->second += f.name + " = " + f.show(*this) + "\n";
  }
  std::string out;
  for (const auto& [section, lines] : sections) out += (out.empty() ? "" : "\n") + ("[" + section + "]\n") + lines;
  return out;
}

std::string TrainConfig::describe_keys() {
  const TrainConfig defaults;
  std::ostringstream out;
  std::string section;
  for (const Field& f : fields()) {
    if (f.section != section) {
      section = f.section;
      out << "\n[" << section << "]\n";
    }
    out << config::describe_line(f.name, f.show(defaults), f.help);
    if (f.section == "data" && f.name == "split_mb") {
      out << "  [[data.sources]] path, weight     a mixture (TOML only): each source's files, sampled in proportion to "
             "its weight\n";
    }
  }
  return out.str();
}

}  // namespace meshtrain::train
