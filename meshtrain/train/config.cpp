#include "meshtrain/train/config.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <functional>
#include <map>
#include <sstream>

namespace meshtrain::train {

namespace {

enum class Kind { kInt, kFloat, kBool, kString, kStringList };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kInt: return "an integer";
    case Kind::kFloat: return "a number";
    case Kind::kBool: return "true or false";
    case Kind::kString: return "a string";
    case Kind::kStringList: return "a list of strings";
  }
  return "?";
}

struct Value {
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<std::string> list;
};

struct Field {
  std::string section, key;
  Kind kind;
  std::string help;
  std::function<void(TrainConfig&, const Value&)> set;
  std::function<std::string(const TrainConfig&)> show;
};

template <typename T>
std::string show_number(T v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// The schema: every key a config may hold. Model keys apply on top of the preset.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> f;
    auto integer = [&](std::string s, std::string k, std::string help, int64_t TrainConfig::*m) {
      f.push_back({s, k, Kind::kInt, help, [m](TrainConfig& c, const Value& v) { c.*m = v.i; },
                   [m](const TrainConfig& c) { return show_number(c.*m); }});
    };
    auto number = [&](std::string s, std::string k, std::string help, double TrainConfig::*m) {
      f.push_back({s, k, Kind::kFloat, help, [m](TrainConfig& c, const Value& v) { c.*m = v.f; },
                   [m](const TrainConfig& c) { return show_number(c.*m); }});
    };
    auto text = [&](std::string s, std::string k, std::string help, std::string TrainConfig::*m) {
      f.push_back({s, k, Kind::kString, help, [m](TrainConfig& c, const Value& v) { c.*m = v.s; },
                   [m](const TrainConfig& c) { return "\"" + c.*m + "\""; }});
    };
    auto model_int = [&](std::string k, std::string help, int64_t model::GptConfig::*m) {
      f.push_back({"model", k, Kind::kInt, help, [m](TrainConfig& c, const Value& v) { c.model.*m = v.i; },
                   [m](const TrainConfig& c) { return show_number(c.model.*m); }});
    };
    auto model_text = [&](std::string k, std::string help, std::string model::GptConfig::*m) {
      f.push_back({"model", k, Kind::kString, help, [m](TrainConfig& c, const Value& v) { c.model.*m = v.s; },
                   [m](const TrainConfig& c) { return "\"" + c.model.*m + "\""; }});
    };
    auto model_bool = [&](std::string k, std::string help, bool model::GptConfig::*m) {
      f.push_back({"model", k, Kind::kBool, help, [m](TrainConfig& c, const Value& v) { c.model.*m = v.b; },
                   [m](const TrainConfig& c) { return std::string(c.model.*m ? "true" : "false"); }});
    };
    f.push_back({"model", "preset", Kind::kString,
                 "named shape: tiny, small, llama-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b",
                 [](TrainConfig& c, const Value& v) {
                   c.preset = v.s;
                   c.model = model::GptConfig::preset(v.s);
                 },
                 [](const TrainConfig& c) { return "\"" + c.preset + "\""; }});
    model_int("layers", "transformer blocks", &model::GptConfig::layers);
    model_int("heads", "attention heads (must divide width)", &model::GptConfig::heads);
    model_int("width", "model dimension", &model::GptConfig::width);
    model_int("context", "sequence length in tokens", &model::GptConfig::context);
    model_int("vocab_size", "vocabulary (the byte tokenizer needs 256)", &model::GptConfig::vocab_size);
    f.push_back({"model", "dropout", Kind::kFloat, "dropout probability",
                 [](TrainConfig& c, const Value& v) { c.model.dropout = v.f; },
                 [](const TrainConfig& c) { return show_number(c.model.dropout); }});
    model_text("norm", "\"layernorm\" or \"rmsnorm\"", &model::GptConfig::norm);
    model_text("position", "\"learned\" or \"rope\"", &model::GptConfig::position);
    model_text("mlp", "\"gelu\" or \"swiglu\"", &model::GptConfig::mlp);
    model_bool("tie_embeddings", "LM head shares the token embedding", &model::GptConfig::tie_embeddings);
    model_bool("bias", "biases in linear layers and norms", &model::GptConfig::bias);
    f.push_back({"data", "text", Kind::kStringList, "text files or directories prepared when no token files are given",
                 [](TrainConfig& c, const Value& v) { c.text = v.list; },
                 [](const TrainConfig& c) {
                   std::string s = "[";
                   for (size_t i = 0; i < c.text.size(); ++i) s += (i ? ", \"" : "\"") + c.text[i] + "\"";
                   return s + "]";
                 }});
    text("data", "train_file", "training token file from `meshtrain prepare` (overrides text)", &TrainConfig::train_file);
    text("data", "val_file", "validation token file", &TrainConfig::val_file);
    number("data", "val_fraction", "share of prepared text held out for validation", &TrainConfig::val_fraction);
    integer("training", "steps", "optimizer steps", &TrainConfig::steps);
    integer("training", "batch", "global batch in sequences per step (= micro_batch x dp x accumulation)",
            &TrainConfig::batch);
    integer("training", "micro_batch", "sequences per forward/backward on one rank", &TrainConfig::micro_batch);
    number("training", "lr", "peak learning rate (AdamW)", &TrainConfig::lr);
    number("training", "min_lr", "learning rate at the end of the cosine decay", &TrainConfig::min_lr);
    integer("training", "warmup", "steps of linear warmup", &TrainConfig::warmup);
    number("training", "weight_decay", "AdamW weight decay (matrices and embeddings only)", &TrainConfig::weight_decay);
    number("training", "beta1", "AdamW beta1", &TrainConfig::beta1);
    number("training", "beta2", "AdamW beta2", &TrainConfig::beta2);
    number("training", "grad_clip", "clip gradients to this global norm (0: off)", &TrainConfig::grad_clip);
    f.push_back({"training", "seed", Kind::kInt, "seed of the model init and the data order",
                 [](TrainConfig& c, const Value& v) { c.seed = static_cast<uint64_t>(v.i); },
                 [](const TrainConfig& c) { return show_number(c.seed); }});
    text("training", "dtype", "\"float32\" or \"bfloat16\" (autocast of matmuls)", &TrainConfig::dtype);
    integer("training", "eval_every", "steps between validation losses (0: at the end only)", &TrainConfig::eval_every);
    integer("training", "eval_batches", "validation micro-batches per rank", &TrainConfig::eval_batches);
    integer("training", "log_every", "steps between progress lines", &TrainConfig::log_every);
    integer("training", "sample_tokens", "tokens generated from the model at the end (0: none)",
            &TrainConfig::sample_tokens);
    integer("parallel", "dp", "data-parallel ranks (0: all ranks)", &TrainConfig::dp);
    integer("parallel", "bucket_mb", "gradient all-reduce bucket size in MiB", &TrainConfig::bucket_mb);
    text("checkpoint", "dir", "where checkpoints go (default: <run.out>/checkpoints)", &TrainConfig::checkpoint_dir);
    integer("checkpoint", "every", "steps between checkpoints (0: at the end only)", &TrainConfig::checkpoint_every);
    integer("checkpoint", "keep", "checkpoints kept (the newest; at least 1)", &TrainConfig::checkpoint_keep);
    f.push_back({"checkpoint", "resume", Kind::kBool, "continue from the latest checkpoint if there is one",
                 [](TrainConfig& c, const Value& v) { c.resume = v.b; },
                 [](const TrainConfig& c) { return std::string(c.resume ? "true" : "false"); }});
    text("run", "out", "run directory: metrics.jsonl, prepared data, checkpoints", &TrainConfig::out);
    return f;
  }();
  return table;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : fields()) {
    if (f.section == section && f.key == key) return &f;
  }
  return nullptr;
}

[[noreturn]] void unknown_key(const std::string& section, const std::string& key, const std::string& where) {
  std::string known;
  for (const Field& f : fields()) {
    if (f.section == section) known += (known.empty() ? "" : ", ") + f.key;
  }
  if (known.empty()) {
    std::string sections;
    for (const Field& f : fields()) {
      if (sections.find("[" + f.section + "]") == std::string::npos) sections += (sections.empty() ? "" : ", ") + ("[" + f.section + "]");
    }
    throw ConfigError(where + ": unknown section [" + section + "]; sections are " + sections);
  }
  throw ConfigError(where + ": unknown key " + section + "." + key + "; keys of [" + section + "] are " + known);
}

std::string node_text(const toml::node& node) {
  std::ostringstream out;
  node.visit([&](auto&& v) { out << v; });
  return out.str();
}

Value convert(const Field& field, const toml::node& node, const std::string& where) {
  Value value;
  const std::string name = field.section + "." + field.key;
  auto wrong = [&]() -> ConfigError {
    return ConfigError(where + ": " + name + " = " + node_text(node) + " must be " + kind_name(field.kind));
  };
  switch (field.kind) {
    case Kind::kInt:
      if (!node.is_integer()) throw wrong();
      value.i = node.value<int64_t>().value();
      break;
    case Kind::kFloat:
      if (!node.is_number()) throw wrong();
      value.f = node.value<double>().value();
      break;
    case Kind::kBool:
      if (!node.is_boolean()) throw wrong();
      value.b = node.value<bool>().value();
      break;
    case Kind::kString:
      if (!node.is_string()) throw wrong();
      value.s = node.value<std::string>().value();
      break;
    case Kind::kStringList:
      if (node.is_string()) {
        value.list = {node.value<std::string>().value()};
        break;
      }
      if (!node.is_array()) throw wrong();
      for (const auto& item : *node.as_array()) {
        if (!item.is_string()) throw wrong();
        value.list.push_back(item.value<std::string>().value());
      }
      break;
  }
  return value;
}

void apply(TrainConfig& config, const Field& field, const toml::node& node, const std::string& where) {
  const Value value = convert(field, node, where);
  try {
    field.set(config, value);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(where + ": " + field.section + "." + field.key + ": " + e.what());
  }
}

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& allowed) {
  throw ConfigError(key + " = " + value + ": " + allowed);
}

}  // namespace

TrainConfig TrainConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  TrainConfig config;
  if (!path.empty()) {
    toml::table table;
    try {
      table = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      std::ostringstream where;
      where << path << ":" << e.source().begin.line << ":" << e.source().begin.column;
      throw ConfigError("config " + where.str() + ": " + std::string(e.description()));
    }
    // The preset first, so that model keys in the same file override it.
    if (auto* model = table["model"].as_table()) {
      if (auto* preset = model->get("preset")) apply(config, *find_field("model", "preset"), *preset, "config " + path);
    }
    for (const auto& [section, node] : table) {
      const std::string section_name(section.str());
      const toml::table* keys = node.as_table();
      if (!keys) throw ConfigError("config " + path + ": '" + section_name + "' must be a [section] table");
      for (const auto& [key, value] : *keys) {
        const std::string key_name(key.str());
        if (section_name == "model" && key_name == "preset") continue;
        const Field* field = find_field(section_name, key_name);
        if (!field) unknown_key(section_name, key_name, "config " + path);
        apply(config, *field, value, "config " + path);
      }
    }
  }
  // Overrides: presets first, for the same reason.
  std::vector<std::string> ordered;
  for (const auto& o : overrides) if (o.rfind("model.preset=", 0) == 0) ordered.push_back(o);
  for (const auto& o : overrides) if (o.rfind("model.preset=", 0) != 0) ordered.push_back(o);
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
    toml::table parsed;
    if (field->kind == Kind::kString) {
      parsed.insert("v", raw);  // strings need no quotes on the command line
    } else {
      try {
        parsed = toml::parse("v = " + raw);
      } catch (const toml::parse_error&) {
        if (field->kind == Kind::kStringList) parsed.insert("v", raw);
        else throw ConfigError(where + ": " + section + "." + key + " = " + raw + " must be " + kind_name(field->kind));
      }
    }
    apply(config, *field, *parsed.get("v"), where);
  }
  return config;
}

void TrainConfig::validate(int world_size) {
  try {
    model.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (model.vocab_size != 256) {
    bad("model.vocab_size", std::to_string(model.vocab_size), "the byte tokenizer has 256 tokens; use 256");
  }
  if (steps < 1) bad("training.steps", std::to_string(steps), "must be >= 1");
  if (micro_batch < 1) bad("training.micro_batch", std::to_string(micro_batch), "must be >= 1");
  if (batch < 1) bad("training.batch", std::to_string(batch), "must be >= 1");
  if (dp < 0) bad("parallel.dp", std::to_string(dp), "must be >= 0 (0: all ranks)");
  const int64_t ranks = dp == 0 ? world_size : dp;
  if (ranks != world_size) {
    bad("parallel.dp", std::to_string(dp),
        "dp(" + std::to_string(dp) + ") = " + std::to_string(dp) + " != world size " + std::to_string(world_size) +
            "; data parallel is the only layout so far, so dp must equal the number of ranks (or 0)");
  }
  dp = ranks;
  if (batch % (micro_batch * dp) != 0) {
    bad("training.batch", std::to_string(batch),
        "must be divisible by training.micro_batch (" + std::to_string(micro_batch) + ") x dp (" + std::to_string(dp) +
            ") = " + std::to_string(micro_batch * dp));
  }
  grad_accum = batch / (micro_batch * dp);
  if (!(lr > 0)) bad("training.lr", std::to_string(lr), "must be > 0");
  if (min_lr < 0 || min_lr > lr) bad("training.min_lr", std::to_string(min_lr), "must be in [0, training.lr]");
  if (warmup < 0) bad("training.warmup", std::to_string(warmup), "must be >= 0");
  if (weight_decay < 0) bad("training.weight_decay", std::to_string(weight_decay), "must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1)) bad("training.beta1", std::to_string(beta1), "must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) bad("training.beta2", std::to_string(beta2), "must be in [0, 1)");
  if (grad_clip < 0) bad("training.grad_clip", std::to_string(grad_clip), "must be >= 0 (0: off)");
  if (dtype != "float32" && dtype != "bfloat16") bad("training.dtype", "\"" + dtype + "\"", "use \"float32\" or \"bfloat16\"");
  if (eval_every < 0) bad("training.eval_every", std::to_string(eval_every), "must be >= 0");
  if (eval_batches < 1) bad("training.eval_batches", std::to_string(eval_batches), "must be >= 1");
  if (log_every < 1) bad("training.log_every", std::to_string(log_every), "must be >= 1");
  if (sample_tokens < 0) bad("training.sample_tokens", std::to_string(sample_tokens), "must be >= 0");
  if (bucket_mb < 1) bad("parallel.bucket_mb", std::to_string(bucket_mb), "must be >= 1");
  if (checkpoint_every < 0) bad("checkpoint.every", std::to_string(checkpoint_every), "must be >= 0");
  if (checkpoint_keep < 1) bad("checkpoint.keep", std::to_string(checkpoint_keep), "must be >= 1");
  if (!(val_fraction > 0 && val_fraction < 1)) bad("data.val_fraction", std::to_string(val_fraction), "must be in (0, 1)");
  if (train_file.empty() != val_file.empty()) {
    bad(train_file.empty() ? "data.val_file" : "data.train_file", "\"" + (train_file.empty() ? val_file : train_file) + "\"",
        "give both data.train_file and data.val_file, or neither (then data.text is prepared)");
  }
  if (train_file.empty() && text.empty()) bad("data.text", "[]", "name text to train on, or data.train_file");
  if (out.empty()) bad("run.out", "\"\"", "must name a directory");
}

std::string TrainConfig::checkpoint_path() const { return checkpoint_dir.empty() ? out + "/checkpoints" : checkpoint_dir; }

std::string TrainConfig::describe_keys() {
  const TrainConfig defaults;
  std::ostringstream out;
  std::string section;
  for (const Field& f : fields()) {
    if (f.section != section) {
      section = f.section;
      out << "\n[" << section << "]\n";
    }
    std::string line = "  " + f.key + " = " + f.show(defaults);
    if (line.size() < 36) line.resize(36, ' ');
    out << line << "  " << f.help << "\n";
  }
  return out.str();
}

std::string model_config_to_json(const model::GptConfig& c) {
  return nlohmann::json{{"vocab_size", c.vocab_size}, {"context", c.context}, {"layers", c.layers},
                        {"heads", c.heads},           {"width", c.width},     {"dropout", c.dropout},
                        {"norm", c.norm},             {"position", c.position}, {"mlp", c.mlp},
                        {"tie_embeddings", c.tie_embeddings}, {"bias", c.bias}}
      .dump();
}

model::GptConfig model_config_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  model::GptConfig c;
  c.vocab_size = j.at("vocab_size");
  c.context = j.at("context");
  c.layers = j.at("layers");
  c.heads = j.at("heads");
  c.width = j.at("width");
  c.dropout = j.at("dropout");
  c.norm = j.at("norm");
  c.position = j.at("position");
  c.mlp = j.at("mlp");
  c.tie_embeddings = j.at("tie_embeddings");
  c.bias = j.at("bias");
  c.validate();
  return c;
}

}  // namespace meshtrain::train
