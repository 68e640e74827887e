#include "meshtrain/text/tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

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

// tokenizer.json (Hugging Face tokenizers) of a byte-level BPE as vocab.json and merges.txt.
std::unique_ptr<Tokenizer> from_tokenizer_json(const fs::path& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(path.string() + ": not JSON (" + e.what() + ")");
  }
  const nlohmann::json& model = j.value("model", nlohmann::json::object());
  if (model.value("type", "") != "BPE") throw TokenizerError(path.string() + ": only BPE models are read");
  const nlohmann::json& pre = j.value("pre_tokenizer", nlohmann::json());
  if (!pre.is_object() || pre.value("type", "") != "ByteLevel" || !pre.value("use_regex", true)) {
    throw TokenizerError(path.string() + ": its pre-tokenizer (" + pre.dump() +
                         ") is not GPT-2's byte-level one; only that is supported");
  }
  std::string merges = "#version: 0.2\n";
  for (const nlohmann::json& m : model.at("merges")) {
    merges += (m.is_array() ? m[0].get<std::string>() + " " + m[1].get<std::string>() : m.get<std::string>()) + "\n";
  }
  return gpt2_bpe_tokenizer(model.at("vocab").dump(), merges);
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
  if (fs::is_directory(path)) {
    if (fs::exists(path / "vocab.json") && fs::exists(path / "merges.txt")) {
      return gpt2_bpe_tokenizer(read_file(path / "vocab.json"), read_file(path / "merges.txt"));
    }
    if (fs::exists(path / "tokenizer.json")) return from_tokenizer_json(path / "tokenizer.json");
    if (fs::exists(path / "tokenizer.model")) return sentencepiece_tokenizer(read_file(path / "tokenizer.model"));
    throw TokenizerError(spec + ": no vocab.json + merges.txt, tokenizer.json or tokenizer.model in this folder");
  }
  if (!fs::exists(path)) {
    throw TokenizerError("tokenizer " + spec + ": no such file; use \"bytes\", a SentencePiece .model file, a "
                         "tokenizer.json, or a folder with vocab.json + merges.txt");
  }
  if (path.filename() == "tokenizer.json") return from_tokenizer_json(path);
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
  if (kind == "gpt2-bpe") return gpt2_bpe_tokenizer(file("vocab.json"), file("merges.txt"));
  if (kind == "sentencepiece") return sentencepiece_tokenizer(file("tokenizer.model"));
  throw TokenizerError("unknown tokenizer kind \"" + kind + "\"");
}

}  // namespace meshtrain::text
