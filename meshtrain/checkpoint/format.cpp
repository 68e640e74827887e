#include "meshtrain/checkpoint/format.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>

namespace meshtrain::checkpoint {

using nlohmann::json;

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

uint64_t checksum(const void* data, int64_t bytes) {
  // Four independent FNV-1a lanes over 8-byte words (so the multiplies
  // pipeline), folded together with the tail and the length.
  constexpr uint64_t kPrime = 1099511628211ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {1469598103934665603ULL, 1469598103934665603ULL ^ 1, 1469598103934665603ULL ^ 2,
                      1469598103934665603ULL ^ 3};
  int64_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int k = 0; k < 4; ++k) lane[k] = (lane[k] ^ w[k]) * kPrime;
  }
  uint64_t hash = lane[0];
  for (int k = 1; k < 4; ++k) hash = (hash ^ lane[k]) * kPrime;
  for (; i < bytes; ++i) hash = (hash ^ p[i]) * kPrime;
  return hash ^ static_cast<uint64_t>(bytes);
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string Metadata::to_json() const {
  json tensors_json = json::object();
  for (const auto& [name, t] : tensors) {
    json chunks = json::array();
    for (const ChunkEntry& c : t.chunks) {
      json sums = json::array();
      for (uint64_t s : c.checksums) sums.push_back(hex(s));
      chunks.push_back({{"offsets", c.offsets}, {"sizes", c.sizes}, {"begin", c.begin}, {"end", c.end},
                        {"file", c.file}, {"offset", c.offset}, {"bytes", c.bytes}, {"block_bytes", c.block_bytes},
                        {"checksums", sums}});
    }
    tensors_json[name] = {{"shape", t.shape}, {"dtype", t.dtype}, {"chunks", chunks}};
  }
  json j = {{"format", format},
            {"step", step},
            {"cursor", cursor},
            {"model", model},
            {"model_config", model_config.empty() ? json::object() : json::parse(model_config)},
            {"layout", layout},
            {"world", world},
            {"tensors", tensors_json}};
  if (!tokenizer.empty()) j["tokenizer"] = json::parse(tokenizer);
  if (!hosts.empty()) j["hosts"] = hosts;
  if (!source.empty()) j["source"] = source;
  return j.dump(1) + "\n";
}

Metadata Metadata::from_json(const std::string& text, const std::string& where) {
  Metadata m;
  try {
    const json j = json::parse(text);
    m.format = j.at("format").get<int>();
    if (m.format != kFormat) {
      throw CheckpointError(where + " has format " + std::to_string(m.format) + "; this meshtrain reads format " +
                            std::to_string(kFormat));
    }
    m.step = j.at("step").get<int64_t>();
    m.cursor = j.at("cursor").get<int64_t>();
    m.model = j.at("model").get<std::string>();
    m.model_config = j.at("model_config").dump();
    m.layout = j.at("layout").get<std::string>();
    m.world = j.at("world").get<int64_t>();
    if (j.contains("tokenizer")) m.tokenizer = j.at("tokenizer").dump();
    if (j.contains("hosts")) m.hosts = j.at("hosts").get<std::map<std::string, std::string>>();
    if (j.contains("source")) m.source = j.at("source").get<std::string>();
    for (const auto& [name, t] : j.at("tensors").items()) {
      TensorEntry entry;
      entry.shape = t.at("shape").get<std::vector<int64_t>>();
      entry.dtype = t.at("dtype").get<std::string>();
      for (const json& c : t.at("chunks")) {
        ChunkEntry chunk;
        chunk.offsets = c.at("offsets").get<std::vector<int64_t>>();
        chunk.sizes = c.at("sizes").get<std::vector<int64_t>>();
        chunk.begin = c.at("begin").get<int64_t>();
        chunk.end = c.at("end").get<int64_t>();
        chunk.file = c.at("file").get<std::string>();
        chunk.offset = c.at("offset").get<int64_t>();
        chunk.bytes = c.at("bytes").get<int64_t>();
        chunk.block_bytes = c.at("block_bytes").get<int64_t>();
        for (const json& s : c.at("checksums")) chunk.checksums.push_back(std::stoull(s.get<std::string>(), nullptr, 16));
        if (chunk.offsets.size() != entry.shape.size() || chunk.sizes.size() != entry.shape.size() ||
            chunk.begin < 0 || chunk.end < chunk.begin || chunk.block_bytes < 1 || chunk.file.find('/') != std::string::npos) {
          throw CheckpointError(where + ": tensor " + name + " has a malformed chunk");
        }
        entry.chunks.push_back(std::move(chunk));
      }
      m.tensors[name] = std::move(entry);
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(where + " is corrupt: " + e.what());
  }
  return m;
}

}  // namespace meshtrain::checkpoint
