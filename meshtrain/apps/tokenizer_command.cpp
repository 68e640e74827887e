// meshtrain tokenizer train / encode / decode.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/text/chat_template.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/util/files.h"

#include <chrono>
#include <cstdio>

namespace meshtrain::apps {

int run_tokenizer_train(const std::vector<std::string>& inputs, int64_t vocab, const std::string& type,
                        const std::string& prefix) {
  text::train_sentencepiece(inputs, vocab, type, prefix);
  const auto tokenizer = text::load_tokenizer(prefix + ".model");
  std::printf("meshtrain tokenizer: %s -> %s.model (%s); train with --data.tokenizer=%s.model "
              "--model.vocab_size=%lld\n",
              type.c_str(), prefix.c_str(), tokenizer->describe().c_str(), prefix.c_str(),
              static_cast<long long>(tokenizer->vocab_size()));
  return 0;
}

int run_tokenizer_encode(const std::string& spec, const std::string& text, const std::vector<std::string>& files,
                         bool special, bool timing) {
  const auto tokenizer = text::load_tokenizer(spec);
  std::vector<std::string> texts;
  for (const std::string& file : files) texts.push_back(util::read_text_file(file));
  if (files.empty()) texts.push_back(text);
  for (const std::string& t : texts) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<int64_t> ids = tokenizer->encode(t);
    if (special) ids = tokenizer->with_special_tokens(std::move(ids));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timing) {
      std::fprintf(stderr, "meshtrain tokenizer: %zu bytes -> %zu tokens in %.4f s (%.2f MB/s)\n", t.size(), ids.size(),
                   seconds, static_cast<double>(t.size()) / 1e6 / seconds);
    }
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %lld" : "%lld", static_cast<long long>(ids[i]));
    std::printf("\n");
  }
  return 0;
}

int run_tokenizer_decode(const std::string& spec, const std::vector<int64_t>& ids) {
  std::printf("%s\n", text::load_tokenizer(spec)->decode(ids).c_str());
  return 0;
}

// A file of conversations, one JSON line each: a list of messages, or
// {"messages": [...], "tools": [...], "add_generation_prompt": bool} (the
// flags give what a line leaves out). Prints one JSON line each: {"text"}
// (and "ids" with --ids), or {"error"} where the template refused, as
// transformers' apply_chat_template renders a batch of conversations.
int render_conversations(const text::Tokenizer& tokenizer, const text::ChatTemplate& chat, const std::string& file,
                         bool generation_prompt, const nlohmann::ordered_json& tools, bool ids) {
  const std::string content = util::read_text_file(file);
  int64_t number = 0;
  for (size_t start = 0; start < content.size();) {
    size_t end = content.find('\n', start);
    if (end == std::string::npos) end = content.size();
    const std::string line = content.substr(start, end - start);
    start = end + 1;
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto record = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !(record.is_array() || (record.is_object() && record.contains("messages")))) {
      throw std::invalid_argument(file + " line " + std::to_string(number) +
                                  ": not a conversation (a JSON list of messages, or an object with \"messages\")");
    }
    const nlohmann::ordered_json& messages = record.is_array() ? record : record["messages"];
    const bool prompt = record.is_object() ? record.value("add_generation_prompt", generation_prompt) : generation_prompt;
    const nlohmann::ordered_json& line_tools = record.is_object() && record.contains("tools") ? record["tools"] : tools;
    nlohmann::ordered_json out;
    try {
      out["text"] = chat.render(messages, prompt, line_tools);
      if (ids) out["ids"] = tokenizer.encode(out["text"].get<std::string>());
    } catch (const std::exception& e) {
      out = nlohmann::ordered_json{{"error", e.what()}};
    }
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

int run_tokenizer_chat(const std::string& spec, const std::string& messages_file, const std::string& tools_file,
                       bool generation_prompt, bool ids) {
  const auto tokenizer = text::load_tokenizer(spec);
  const auto chat = text::ChatTemplate::of(*tokenizer);
  if (!chat) throw text::TokenizerError(spec + ": the tokenizer has no chat template (tokenizer_config.json's chat_template)");
  auto read_json = [](const std::string& file) {
    try {
      return nlohmann::ordered_json::parse(util::read_text_file(file));
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(file + ": not JSON (" + e.what() + ")");
    }
  };
  const nlohmann::ordered_json tools = tools_file.empty() ? nlohmann::ordered_json() : read_json(tools_file);
  if (messages_file.size() > 6 && messages_file.compare(messages_file.size() - 6, 6, ".jsonl") == 0) {
    return render_conversations(*tokenizer, *chat, messages_file, generation_prompt, tools, ids);
  }
  const nlohmann::ordered_json messages = read_json(messages_file);
  const std::string text = chat->render(messages, generation_prompt, tools);
  if (!ids) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  const std::vector<int64_t> tokens = tokenizer->encode(text);
  for (size_t i = 0; i < tokens.size(); ++i) std::printf(i ? " %lld" : "%lld", static_cast<long long>(tokens[i]));
  std::printf("\n");
  return 0;
}

CommandPtr add_tokenizer(CLI::App& app) {
  struct Args {
    std::vector<std::string> inputs;
    int64_t vocab = 8000;
    std::string type = "unigram", out, spec = "bytes", text;
    std::vector<std::string> files;
    std::vector<int64_t> ids;
    bool special = false, generation_prompt = false, print_ids = false, timing = false;
    std::string messages, tools;
  };
  auto a = std::make_shared<Args>();
  CLI::App* tokenizer = app.add_subcommand("tokenizer", "Train and try tokenizers");
  tokenizer->require_subcommand(1);
  CLI::App* train = tokenizer->add_subcommand(
      "train",
      "Train a SentencePiece model on text files (byte fallback on: any text encodes); writes OUT.model "
      "and OUT.vocab. Use it with [data] tokenizer = \"OUT.model\" and model.vocab_size = --vocab.");
  train->add_option("inputs", a->inputs, "Text files")->required()->check(CLI::ExistingFile);
  train->add_option("--vocab", a->vocab, "Vocabulary size")->check(CLI::Range(64, 65536))->capture_default_str();
  train->add_option("--type", a->type, "unigram or bpe")->capture_default_str();
  train->add_option("--out", a->out, "Output prefix")->required();
  CLI::App* encode = tokenizer->add_subcommand("encode", "Print the token ids of a text");
  encode->add_option("--tokenizer", a->spec, "As [data] tokenizer")->capture_default_str();
  encode->add_option("--text", a->text, "The text");
  encode->add_option("--file", a->files, "Or a file's text; repeated, one line of ids per file")
      ->check(CLI::ExistingFile);
  encode->add_flag("--special", a->special,
                   "Add the special tokens the tokenizer's template puts around a text (Llama's <s>), as "
                   "transformers' encode() does by default");
  encode->add_flag("--timing", a->timing, "Print each text's bytes, tokens and encoding speed to stderr");
  CLI::App* decode = tokenizer->add_subcommand("decode", "Print the text of token ids");
  decode->add_option("--tokenizer", a->spec, "As [data] tokenizer")->capture_default_str();
  decode->add_option("ids", a->ids, "Token ids")->required();
  CLI::App* chat = tokenizer->add_subcommand(
      "chat", "Print a conversation as the tokenizer's chat template writes it (transformers' apply_chat_template)");
  chat->add_option("--tokenizer", a->spec, "A model or tokenizer folder with a chat template")->required();
  chat->add_option("--messages", a->messages,
                   "A JSON file: [{\"role\": \"user\", \"content\": \"...\"}, ...]; or a .jsonl file of conversations, "
                   "one per line (a list, or {\"messages\", \"tools\", \"add_generation_prompt\"}), printed as JSON lines "
                   "{\"text\", \"ids\"} or {\"error\"}")
      ->required()
      ->check(CLI::ExistingFile);
  chat->add_option("--tools", a->tools, "A JSON file: a list of tool schemas")->check(CLI::ExistingFile);
  chat->add_flag("--generation-prompt", a->generation_prompt, "End with the assistant's turn opening");
  chat->add_flag("--ids", a->print_ids, "Print the token ids instead of the text");
  return plain_command(tokenizer, [a, train, encode, chat] {
    if (train->parsed()) return run_tokenizer_train(a->inputs, a->vocab, a->type, a->out);
    if (encode->parsed()) return run_tokenizer_encode(a->spec, a->text, a->files, a->special, a->timing);
    if (chat->parsed()) return run_tokenizer_chat(a->spec, a->messages, a->tools, a->generation_prompt, a->print_ids);
    return run_tokenizer_decode(a->spec, a->ids);
  });
}

}  // namespace meshtrain::apps
