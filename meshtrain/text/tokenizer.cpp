#include "meshtrain/text/tokenizer.h"

#include <nlohmann/json.hpp>

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

// tokenizer.json with the tokenizer_config.json beside it, if there is one.
std::unique_ptr<Tokenizer> from_tokenizer_json(const fs::path& path) {
  std::map<std::string, std::string> files{{"tokenizer.json", read_file(path)}};
  const fs::path config = path.parent_path() / "tokenizer_config.json";
  if (fs::exists(config)) files["tokenizer_config.json"] = read_file(config);
  return hf_tokenizer(std::move(files), path.string());
}

// A folder's tokenizer: tokenizer.json, else vocab.json + merges.txt, else
// tokenizer.model; a tokenizer.json this reader cannot take falls back to a
// tokenizer.model beside it.
std::unique_ptr<Tokenizer> from_folder(const fs::path& path) {
  const bool has_model = fs::exists(path / "tokenizer.model");
  if (fs::exists(path / "tokenizer.json")) {
    try {
      return from_tokenizer_json(path / "tokenizer.json");
    } catch (const hf::Unsupported& e) {
      if (!has_model) throw;
      std::fprintf(stderr, "meshtrain: %s; reading %s instead\n", e.what(), (path / "tokenizer.model").c_str());
    }
  }
  if (fs::exists(path / "vocab.json") && fs::exists(path / "merges.txt")) {
    return gpt2_bpe_tokenizer(read_file(path / "vocab.json"), read_file(path / "merges.txt"));
  }
  if (has_model) return sentencepiece_tokenizer(read_file(path / "tokenizer.model"));
  throw TokenizerError(path.string() + ": no tokenizer.json, vocab.json + merges.txt or tokenizer.model in this folder");
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

std::unique_ptr<Tokenizer> bytes_tokenizer() { return std::make_unique<Bytes>(); }

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
  for (const auto& [name, content] : tokenizer.files()) j["files"][name] = base64(content);
  return j.dump();
}

std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& text) {
  if (text.empty()) return bytes_tokenizer();
  const nlohmann::json j = nlohmann::json::parse(text);
  const std::string kind = j.at("kind");
  auto file = [&](const char* name) { return unbase64(j.at("files").at(name).get<std::string>()); };
  if (kind == "bytes") return bytes_tokenizer();
  if (kind == "hf") {
    std::map<std::string, std::string> files;
    for (auto it = j.at("files").begin(); it != j.at("files").end(); ++it) files[it.key()] = unbase64(it->get<std::string>());
    return hf_tokenizer(std::move(files), "the checkpoint's tokenizer.json");
  }
  if (kind == "gpt2-bpe") return gpt2_bpe_tokenizer(file("vocab.json"), file("merges.txt"));
  if (kind == "sentencepiece") return sentencepiece_tokenizer(file("tokenizer.model"));
  throw TokenizerError("unknown tokenizer kind \"" + kind + "\"");
}

}  // namespace meshtrain::text
