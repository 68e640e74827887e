#include "meshtrain/text/tokenizer.h"
#include "meshtrain/text/tokenizer_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "meshtrain/text/hf_components.h"

namespace meshtrain::text {

namespace fs = std::filesystem;

namespace {

class Bytes : public Tokenizer {
 public:
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (int64_t id : ids) {
      if (id < 0 || id > 255) throw TokenizerError("token id " + std::to_string(id) + " is not a byte");
      text += static_cast<char>(id);
    }
    return text;
  }
  int64_t vocab_size() const override { return 256; }
  std::string kind() const override { return "bytes"; }
  std::map<std::string, std::string> files() const override { return {}; }
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError(path.string() + ": cannot read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::unique_ptr<Tokenizer> from_tokenizer_json(const fs::path& path) { return hf_tokenizer(read_file(path), path.string()); }

// A folder's tokenizer: tokenizer.json, else vocab.json + merges.txt, else
// tokenizer.model; a tokenizer.json this reader cannot take (a component it
// does not implement, or a file that is no tokenizer.json) falls back to the
// folder's other files in that order, saying so.
std::unique_ptr<Tokenizer> tokenizer_in_folder(const fs::path& path) {
  const bool has_model = fs::exists(path / "tokenizer.model");
  if (fs::exists(path / "tokenizer.json")) {
    try {
      return from_tokenizer_json(path / "tokenizer.json");
    } catch (const TokenizerError& e) {
      const bool has_bpe = fs::exists(path / "vocab.json") && fs::exists(path / "merges.txt");
      if (!has_model && !has_bpe) throw;
      const fs::path other = has_bpe ? path / "vocab.json" : path / "tokenizer.model";
      std::fprintf(stderr, "meshtrain: %s; reading %s instead\n", e.what(), other.c_str());
    }
  }
  if (fs::exists(path / "vocab.json") && fs::exists(path / "merges.txt")) {
    return gpt2_bpe_tokenizer(read_file(path / "vocab.json"), read_file(path / "merges.txt"));
  }
  if (has_model) return sentencepiece_tokenizer(read_file(path / "tokenizer.model"));
  throw TokenizerError(path.string() + ": no tokenizer.json, vocab.json + merges.txt or tokenizer.model in this folder");
}

std::unique_ptr<Tokenizer> from_folder(const fs::path& path) {
  std::unique_ptr<Tokenizer> tokenizer = tokenizer_in_folder(path);
  std::map<std::string, std::string> companions;
  for (const std::string& name : companion_names()) {
    if (fs::exists(path / name)) companions[name] = read_file(path / name);
  }
  tokenizer->set_companions(std::move(companions));
  return tokenizer;
}

const std::string kBase64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& in) {
  std::string out;
  int value = 0, bits = -6;
  for (unsigned char c : in) {
    value = (value << 8) + c, bits += 8;
    while (bits >= 0) out += kBase64[(value >> bits) & 0x3F], bits -= 6;
  }
  if (bits > -6) out += kBase64[((value << 8) >> (bits + 8)) & 0x3F];
  while (out.size() % 4) out += '=';
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  int value = 0, bits = -8;
  for (unsigned char c : in) {
    const size_t d = kBase64.find(static_cast<char>(c));
    if (d == std::string::npos) break;
    value = (value << 6) + static_cast<int>(d), bits += 6;
    if (bits >= 0) out += static_cast<char>((value >> bits) & 0xFF), bits -= 8;
  }
  return out;
}

}  // namespace

std::string token_text(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return "";
}

nlohmann::json companion_json(const Tokenizer& tokenizer, const std::string& name) {
  auto it = tokenizer.companions().find(name);
  if (it == tokenizer.companions().end()) return nullptr;
  return nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
}

std::unique_ptr<Tokenizer> bytes_tokenizer() { return std::make_unique<Bytes>(); }

const std::vector<std::string>& companion_names() {
  static const std::vector<std::string> names = {"tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                                                 "generation_config.json"};
  return names;
}

std::map<std::string, std::string> Tokenizer::all_files() const {
  std::map<std::string, std::string> all = files();
  all.insert(companions_.begin(), companions_.end());
  return all;
}

std::vector<int64_t> Tokenizer::stop_ids() const {
  std::vector<int64_t> ids;
  auto add = [&](int64_t id) {
    if (id >= 0 && can_decode(id) && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  add(end_of_text());
  const nlohmann::json config = companion_json(*this, "tokenizer_config.json");
  if (config.is_object() && config.contains("eos_token")) {
    const std::string eos = token_text(config["eos_token"]);
    if (!eos.empty()) add(token_id(eos));
  }
  const nlohmann::json generation = companion_json(*this, "generation_config.json");
  if (generation.is_object() && generation.contains("eos_token_id")) {
    const nlohmann::json& eos = generation["eos_token_id"];
    for (const nlohmann::json& id : eos.is_array() ? eos : nlohmann::json::array({eos})) {
      if (id.is_number_integer()) add(id.get<int64_t>());
    }
  }
  return ids;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec.empty() || spec == "bytes") return bytes_tokenizer();
  const fs::path path(spec);
  if (fs::is_directory(path)) return from_folder(path);
  if (!fs::exists(path)) {
    throw TokenizerError("tokenizer " + spec + ": no such file; use \"bytes\", a SentencePiece .model file, a "
                         "tokenizer.json, or a folder with vocab.json + merges.txt");
  }
  if (path.extension() == ".json") return from_tokenizer_json(path);
  return sentencepiece_tokenizer(read_file(path));
}

std::string tokenizer_to_json(const Tokenizer& tokenizer) {
  nlohmann::json j = {{"kind", tokenizer.kind()}, {"files", nlohmann::json::object()}};
  for (const auto& [name, content] : tokenizer.all_files()) j["files"][name] = base64(content);
  return j.dump();
}

std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& text) {
  if (text.empty()) return bytes_tokenizer();
  const nlohmann::json j = nlohmann::json::parse(text);
  const std::string kind = j.at("kind");
  std::map<std::string, std::string> files;
  for (auto it = j.at("files").begin(); it != j.at("files").end(); ++it) files[it.key()] = unbase64(it->get<std::string>());
  auto take = [&](const char* name) {
    auto it = files.find(name);
    if (it == files.end()) throw TokenizerError(std::string("the checkpoint's tokenizer has no ") + name);
    std::string content = std::move(it->second);
    files.erase(it);
    return content;
  };
  std::unique_ptr<Tokenizer> tokenizer;
  if (kind == "bytes") {
    tokenizer = bytes_tokenizer();
  } else if (kind == "hf") {
    tokenizer = hf_tokenizer(take("tokenizer.json"), "the checkpoint's tokenizer.json");
  } else if (kind == "gpt2-bpe") {
    const std::string vocab = take("vocab.json");
    tokenizer = gpt2_bpe_tokenizer(vocab, take("merges.txt"));
  } else if (kind == "sentencepiece") {
    tokenizer = sentencepiece_tokenizer(take("tokenizer.model"));
  } else {
    throw TokenizerError("unknown tokenizer kind \"" + kind + "\"");
  }
  tokenizer->set_companions(std::move(files));
  return tokenizer;
}

}  // namespace meshtrain::text
