// meshtrain import hf / export hf / logits: models in Hugging Face's format in
// and out, and the logits of a token sequence to compare implementations.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/checkpoint/store.h"
#include "meshtrain/checkpoint/writer.h"
#include "meshtrain/interop/hf_checkpoint.h"
#include "meshtrain/interop/safetensors.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/serve/inference_model.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/train/config.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace meshtrain::apps {

namespace {

// The tokenizer an import keeps: `spec` "auto" reads the model folder's own
// files and refuses a folder without ones it reads; otherwise as
// text::load_tokenizer ("bytes" imports without one).
std::unique_ptr<text::Tokenizer> import_tokenizer(const std::string& dir, const std::string& spec, int64_t vocab) {
  std::unique_ptr<text::Tokenizer> tokenizer;
  try {
    tokenizer = text::load_tokenizer(spec == "auto" ? dir : spec);
  } catch (const text::TokenizerError& e) {
    throw text::TokenizerError(std::string(e.what()) +
                               "\n(name a tokenizer with --tokenizer PATH, or import without one with --tokenizer bytes)");
  }
  if (tokenizer->vocab_size() > vocab) {
    throw text::TokenizerError("the tokenizer's " + std::to_string(tokenizer->vocab_size()) +
                               " tokens exceed the model's vocabulary of " + std::to_string(vocab));
  }
  return tokenizer;
}

// meshtrain's byte tokenizer (id = byte) as a Hugging Face tokenizer.json: a
// BPE with no merges over GPT-2's byte-to-character map (ByteLevel without
// its regex), whose 256 tokens are the bytes in order.
std::string bytes_tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::object();
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int code = printable ? b : 256 + extra++;
    std::string utf8;  // the code point (< 0x800) in UTF-8
    if (code < 0x80) {
      utf8 = std::string(1, static_cast<char>(code));
    } else {
      utf8 = {static_cast<char>(0xC0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3F))};
    }
    vocab[utf8] = b;
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                                     {"use_regex", false}};
  const nlohmann::json j = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr}, {"pre_tokenizer", byte_level}, {"post_processor", nullptr}, {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"ignore_merges", false}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  return j.dump(1);
}

// The tokenizer's files beside an exported model. A tokenizer_config.json
// that came with it is written back as it was; otherwise a minimal one names
// the class transformers should load. The byte tokenizer is written as an
// equivalent tokenizer.json.
void write_tokenizer(const std::string& dir, const text::Tokenizer& tokenizer) {
  const std::string kind = tokenizer.kind();
  const std::map<std::string, std::string> files =
      kind == "bytes" ? std::map<std::string, std::string>{{"tokenizer.json", bytes_tokenizer_json() + "\n"}}
                      : tokenizer.all_files();
  for (const auto& [name, content] : files) {
    std::ofstream out(std::filesystem::path(dir) / name, std::ios::binary | std::ios::trunc);
    out << content;
  }
  if (files.count("tokenizer_config.json")) return;
  const char* cls = kind == "gpt2-bpe" ? "GPT2Tokenizer" : kind == "sentencepiece" ? "LlamaTokenizer" : "PreTrainedTokenizerFast";
  std::ofstream config(std::filesystem::path(dir) / "tokenizer_config.json", std::ios::trunc);
  config << "{\"tokenizer_class\": \"" << cls << "\"}\n";
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("--dtype " + name + ": use float32, bfloat16 or float16");
}

}  // namespace

int run_import_hf(comm::Runtime& runtime, const std::string& dir, const std::string& out_dir,
                  const std::string& tokenizer_spec) {
  if (runtime.size() != 1) throw std::invalid_argument("import runs on one rank");
  const interop::HfModel hf = interop::read_hf_model(dir);
  model::Gpt gpt(hf.config, 0);
  placement::TrainingState state;
  for (auto& item : gpt->named_parameters()) {
    auto it = hf.weights.find(item.key());
    if (it == hf.weights.end()) throw std::logic_error("import: no weight for " + item.key());
    placement::StateTensor t;
    t.name = "model/" + item.key();
    t.spec.shape = item.value().sizes().vec();
    t.spec.axes = {"dp"};
    t.spec.placements = {placement::Placement::replicate()};
    t.local = it->second.reshape({-1}).contiguous();
    state.push_back(std::move(t));
  }
  checkpoint::Metadata meta;
  meta.step = 0;
  meta.model = model::fingerprint(hf.config);
  meta.model_config = model::to_json(hf.config);
  meta.layout = "imported from Hugging Face " + hf.model_type;
  meta.source = std::filesystem::absolute(dir).lexically_normal().string();  // a PEFT export names it as the base
  if (meta.source.size() > 1 && meta.source.back() == '/') meta.source.pop_back();
  meta.world = 1;
  const std::unique_ptr<text::Tokenizer> tokenizer = import_tokenizer(dir, tokenizer_spec, hf.config.vocab_size);
  meta.tokenizer = text::tokenizer_to_json(*tokenizer);
  checkpoint::CheckpointWriter writer(checkpoint::CheckpointStore(out_dir, 1), runtime.world(), /*async=*/false);
  writer.save(meta, state, mesh::MeshLayout({{"dp", 1}}, 1));
  writer.wait();
  std::printf("meshtrain import: %s model from %s (%.1fM parameters, tokenizer %s) -> %s\n", hf.model_type.c_str(),
              dir.c_str(), hf.config.parameter_count() / 1e6,
              tokenizer->describe().c_str(), checkpoint::CheckpointStore::resolve(out_dir).c_str());
  return 0;
}

int run_export_hf(const std::string& checkpoint, const std::string& out_dir, const std::string& dtype,
                  int64_t max_shard_bytes) {
  serve::InferenceModel inference(checkpoint, nullptr);
  std::map<std::string, at::Tensor> weights;
  for (const auto& item : inference.gpt()->named_parameters()) weights[item.key()] = item.value().detach();
  interop::write_hf_model(out_dir, inference.config(), weights, parse_dtype(dtype), max_shard_bytes);
  write_tokenizer(out_dir, inference.tokenizer());
  std::printf("meshtrain export: %s -> %s (config.json, safetensors in %s)\n", checkpoint.c_str(), out_dir.c_str(),
              dtype.c_str());
  return 0;
}

int run_export_peft(const std::string& checkpoint, const std::string& out_dir, const std::string& base_name) {
  const std::string folder = checkpoint::CheckpointStore::resolve(checkpoint);
  checkpoint::CheckpointReader reader(folder);
  const std::optional<model::LoraSection> lora = model::lora_of(reader.metadata().model_config);
  if (!lora) {
    throw std::invalid_argument(folder + " holds a whole model, not LoRA adapters (trained with lora.rank > 0); "
                                "export it with `meshtrain export hf`");
  }
  const std::map<std::string, at::Tensor> adapters = serve::read_adapters(reader);
  const model::GptConfig model = model::config_from_json(reader.metadata().model_config);
  // The base as PEFT's loaders find it: the Hugging Face folder the base checkpoint was imported from.
  std::string base = base_name.empty() ? lora->base : base_name;
  if (base_name.empty() && !lora->base.empty()) {
    try {
      const std::string source =
          checkpoint::CheckpointStore::read_metadata(checkpoint::CheckpointStore::resolve(lora->base)).source;
      if (!source.empty()) base = source;
    } catch (const std::exception&) {  // the base checkpoint moved: its path as recorded
    }
  }
  model::write_peft_adapter(out_dir, model, lora->config, adapters, base);
  std::printf("meshtrain export: %zu LoRA tensors of %s -> %s (adapter_config.json, adapter_model.safetensors; base %s)\n",
              adapters.size(), folder.c_str(), out_dir.c_str(), base.empty() ? "not recorded" : base.c_str());
  return 0;
}

int run_logits(const std::string& checkpoint, const std::string& tokens, const std::string& out) {
  serve::InferenceModel inference(checkpoint, nullptr);
  model::Gpt& gpt = inference.gpt();
  std::vector<int64_t> ids;
  std::istringstream in(tokens);
  for (std::string word; std::getline(in, word, ',');) {
    try {
      ids.push_back(std::stoll(word));
    } catch (const std::exception&) {
      throw std::invalid_argument("--tokens: \"" + word + "\" is not a token id (give ids separated by commas)");
    }
    if (ids.back() < 0 || ids.back() >= gpt->config().vocab_size) {
      throw std::invalid_argument("--tokens: id " + word + " is outside the vocabulary of " +
                                  std::to_string(gpt->config().vocab_size));
    }
  }
  if (ids.empty() || static_cast<int64_t>(ids.size()) > gpt->config().context) {
    throw std::invalid_argument("--tokens: give 1 to " + std::to_string(gpt->config().context) + " token ids");
  }
  torch::NoGradGuard no_grad;
  const at::Tensor logits = gpt->forward(at::tensor(ids, at::kLong).view({1, -1}));
  interop::write_safetensors(out, {{"logits", logits}});
  std::printf("meshtrain logits: [1, %zu, %lld] -> %s\n", ids.size(), static_cast<long long>(logits.size(2)), out.c_str());
  return 0;
}

CommandPtr add_import(CLI::App& app) {
  struct Args {
    std::string dir, out, tokenizer = "auto";
  };
  auto a = std::make_shared<Args>();
  CLI::App* import = app.add_subcommand("import", "Bring a model trained elsewhere in as a meshtrain checkpoint");
  import->require_subcommand(1);
  CLI::App* hf = import->add_subcommand(
      "hf",
      "A Hugging Face transformers folder (config.json + model.safetensors, or shards with "
      "model.safetensors.index.json) of GPT-2 or an open family: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, "
      "Gemma 2, Phi-3, OLMo 2 (docs/models.md); what a model uses that meshtrain does not implement is refused by name");
  hf->add_option("dir", a->dir, "The Hugging Face model folder")
      ->required()
      ->check(CLI::ExistingDirectory);
  hf->add_option("--out", a->out, "Checkpoint directory to write (step 0, with a latest pointer)")
      ->required();
  hf->add_option("--tokenizer", a->tokenizer,
                 "auto: the folder's tokenizer.json (with tokenizer_config.json), vocab.json + merges.txt or "
                 "tokenizer.model, refusing a folder without one; or a tokenizer path; or bytes for none")
      ->capture_default_str();
  return command(hf, [a](comm::Runtime& runtime) { return run_import_hf(runtime, a->dir, a->out, a->tokenizer); });
}

CommandPtr add_export(CLI::App& app) {
  struct Args {
    std::string checkpoint, out, dtype = "float32", shard = "5G";
  };
  auto a = std::make_shared<Args>();
  CLI::App* export_ = app.add_subcommand("export", "Hand a meshtrain checkpoint to other tools");
  export_->require_subcommand(1);
  CLI::App* hf = export_->add_subcommand(
      "hf",
      "As a Hugging Face transformers folder of the model's family (GPT2LMHeadModel, LlamaForCausalLM, "
      "MistralForCausalLM, Qwen2/Qwen3/Qwen3Moe, Mixtral, Gemma2, Phi3, Olmo2): config.json and safetensors, "
      "sharded with an index when larger than --max-shard-size");
  hf->add_option("checkpoint", a->checkpoint, "Checkpoint folder, or a checkpoint directory (its latest)")
      ->required();
  hf->add_option("--out", a->out, "Folder to write")->required();
  hf->add_option("--dtype", a->dtype, "float32, bfloat16 or float16")->capture_default_str();
  hf->add_option("--max-shard-size", a->shard, "Largest safetensors file (e.g. 500M, 5G)")
      ->capture_default_str();
  return plain_command(hf, [a] { return run_export_hf(a->checkpoint, a->out, a->dtype, parse_size(a->shard)); });
}

CommandPtr add_export_peft(CLI::App& app) {
  struct Args {
    std::string checkpoint, out, base;
  };
  auto a = std::make_shared<Args>();
  CLI::App* peft = app.get_subcommand("export")->add_subcommand(
      "peft",
      "LoRA adapters (a checkpoint of a run with lora.rank > 0) as a PEFT adapter folder: adapter_config.json and "
      "adapter_model.safetensors, loaded by peft.PeftModel.from_pretrained on the base model and served with "
      "`meshtrain serve --lora`. `export hf` of the same checkpoint writes the base with the adapters merged");
  peft->add_option("checkpoint", a->checkpoint, "Checkpoint folder, or a checkpoint directory (its latest)")->required();
  peft->add_option("--out", a->out, "Folder to write")->required();
  peft->add_option("--base", a->base,
                   "base_model_name_or_path to write (default: the Hugging Face folder the base checkpoint was "
                   "imported from, which AutoPeftModelForCausalLM loads; a Hub name such as "
                   "meta-llama/Llama-3.2-1B-Instruct works too)");
  return plain_command(peft, [a] { return run_export_peft(a->checkpoint, a->out, a->base); });
}

CommandPtr add_logits(CLI::App& app) {
  struct Args {
    std::string checkpoint, tokens, out;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub =
      app.add_subcommand("logits",
                         "Write the logits [1, T, vocab] of a token sequence to a safetensors file (to compare with "
                         "another implementation)");
  sub->add_option("--checkpoint", a->checkpoint, "Checkpoint folder or directory")->required();
  // --prompt-ids as in generate, where --tokens is a count of tokens to generate.
  sub->add_option("--prompt-ids", a->tokens, "Token ids separated by commas, e.g. 1,2,3 (as generate's --prompt-ids)")
      ->required();
  sub->add_option("--out", a->out, "The safetensors file to write (tensor \"logits\")")->required();
  return plain_command(sub, [a] { return run_logits(a->checkpoint, a->tokens, a->out); });
}

}  // namespace meshtrain::apps
