// tokenizer.json models: BPE (ranked merges, as GPT-2, Llama 3, Qwen2,
// Mistral) and Unigram (Viterbi over scored pieces, as T5 and XLNet).
#include <cstdio>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "meshtrain/text/hf_components.h"
#include "meshtrain/text/unicode.h"

namespace meshtrain::text::hf {

// Named as in tokenizers.models.
namespace models {

std::string byte_token(uint8_t byte) {
  char name[8];
  std::snprintf(name, sizeof name, "<0x%02X>", byte);
  return name;
}

// Ids by token and tokens by id, with room for holes.
class Vocabulary {
 public:
  void add(const std::string& token, int64_t id, const std::string& where) {
    if (id < 0) throw TokenizerError(where + ": \"" + token + "\" has a negative id");
    ids_[token] = id;
    if (static_cast<int64_t>(tokens_.size()) <= id) tokens_.resize(static_cast<size_t>(id) + 1), present_.resize(id + 1);
    tokens_[static_cast<size_t>(id)] = token;
    present_[static_cast<size_t>(id)] = true;
  }
  int64_t id(const std::string& token) const {
    auto it = ids_.find(token);
    return it == ids_.end() ? -1 : it->second;
  }
  const std::string* token(int64_t id) const {
    return id >= 0 && id < size() && present_[static_cast<size_t>(id)] ? &tokens_[static_cast<size_t>(id)] : nullptr;
  }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> tokens_;
  std::vector<bool> present_;
};

// Note [BPE merges]
// A pre-token starts as its characters (each found in the vocabulary, else
// its bytes as <0xXX> tokens under byte_fallback, else the unknown token,
// runs of them fused under fuse_unk, else dropped). Then, repeatedly, the
// adjacent pair whose merge ranks first (leftmost among equals) becomes one
// symbol, until no pair has a merge. A heap of candidate merges, checked
// for staleness when popped, makes this O(n log n), as tokenizers' Word.
class Bpe : public Model {
 public:
  Bpe(const json& j, const std::string& where);
  std::string type() const override { return "BPE"; }
  void encode(const std::string& piece, std::vector<int64_t>& ids) const override;
  int64_t size() const override { return vocab_.size(); }
  const std::string* token(int64_t id) const override { return vocab_.token(id); }
  int64_t id(const std::string& token) const override { return vocab_.id(token); }

 private:
  struct Symbol {
    int64_t id;
    int prev, next;
    bool gone;
  };
  std::vector<int64_t> merge_word(const std::string& piece) const;
  std::vector<Symbol> initial_symbols(const std::string& piece) const;
  static uint64_t key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); }

  Vocabulary vocab_;
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> merges_;  // (a, b) -> (rank, merged id)
  std::string unk_, prefix_, suffix_;
  bool fuse_unk_, byte_fallback_, ignore_merges_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

Bpe::Bpe(const json& j, const std::string& where)
    : fuse_unk_(j.value("fuse_unk", false)),
      byte_fallback_(j.value("byte_fallback", false)),
      ignore_merges_(j.value("ignore_merges", false)) {
  auto text = [&](const char* name) { return j.contains(name) && j[name].is_string() ? j[name].get<std::string>() : ""; };
  unk_ = text("unk_token"), prefix_ = text("continuing_subword_prefix"), suffix_ = text("end_of_word_suffix");
  const json& vocab = field(j, "vocab", where);
  if (!vocab.is_object()) throw TokenizerError(where + ".vocab must map tokens to ids");
  for (auto it = vocab.begin(); it != vocab.end(); ++it) vocab_.add(it.key(), it->get<int64_t>(), where + ".vocab");
  const json& merges = field(j, "merges", where);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string a, b;
    if (m.is_array() && m.size() == 2) {
      a = m[0], b = m[1];
    } else {
      const std::string line = m.is_string() ? m.get<std::string>() : m.dump();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        throw TokenizerError(where + ".merges[" + std::to_string(rank) + "] (" + line + ") is not two tokens");
      }
      a = line.substr(0, space), b = line.substr(space + 1);
    }
    const int64_t ia = vocab_.id(a), ib = vocab_.id(b);
    const int64_t merged = vocab_.id(a + b.substr(std::min(prefix_.size(), b.size())));
    if (ia < 0 || ib < 0 || merged < 0) {
      throw TokenizerError(where + ".merges[" + std::to_string(rank) + "] (\"" + a + "\" + \"" + b +
                           "\") names a token the vocabulary lacks");
    }
    merges_[key(ia, ib)] = {static_cast<int32_t>(rank), merged};
  }
  if (!unk_.empty() && vocab_.id(unk_) < 0) throw TokenizerError(where + ".unk_token " + unk_ + " is not in the vocabulary");
}

void Bpe::encode(const std::string& piece, std::vector<int64_t>& ids) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    const int64_t whole = vocab_.id(piece);
    if (whole >= 0) {
      ids.push_back(whole);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(piece);
    if (it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int64_t> merged = merge_word(piece);
  ids.insert(ids.end(), merged.begin(), merged.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (piece.size() < 256 && cache_.size() < 50000) cache_.emplace(piece, std::move(merged));
}

std::vector<Bpe::Symbol> Bpe::initial_symbols(const std::string& piece) const {
  std::vector<Symbol> symbols;
  int64_t unk = -1;  // a pending unknown token (fused ones become one)
  auto add = [&](int64_t id) { symbols.push_back({id, static_cast<int>(symbols.size()) - 1, 0, false}); };
  const auto chars = unicode::code_points(piece);
  for (size_t i = 0; i < chars.size(); ++i) {
    const size_t at = chars[i].first, end = i + 1 < chars.size() ? chars[i + 1].first : piece.size();
    std::string s = piece.substr(at, end - at);
    if (i > 0) s = prefix_ + s;
    if (i + 1 == chars.size()) s += suffix_;
    const int64_t id = vocab_.id(s);
    if (id >= 0) {
      if (unk >= 0) add(unk), unk = -1;
      add(id);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int64_t> bytes;
      for (unsigned char b : s) {
        const int64_t bid = vocab_.id(byte_token(b));
        if (bid < 0) break;
        bytes.push_back(bid);
      }
      if (bytes.size() == s.size()) {
        for (int64_t b : bytes) add(b);
        continue;
      }
    }
    if (unk_.empty()) continue;  // no unknown token: the character is dropped
    if (unk >= 0 && !fuse_unk_) add(unk);
    unk = vocab_.id(unk_);
  }
  if (unk >= 0) add(unk);
  for (size_t i = 0; i < symbols.size(); ++i) symbols[i].next = i + 1 < symbols.size() ? static_cast<int>(i) + 1 : -1;
  return symbols;
}

std::vector<int64_t> Bpe::merge_word(const std::string& piece) const {
  std::vector<Symbol> symbols = initial_symbols(piece);
  struct Candidate {
    int32_t rank;
    int pos;
    int64_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto offer = [&](int pos) {
    const int next = symbols[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    auto it = merges_.find(key(symbols[static_cast<size_t>(pos)].id, symbols[static_cast<size_t>(next)].id));
    if (it != merges_.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) offer(static_cast<int>(i));
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = symbols[static_cast<size_t>(top.pos)];
    if (left.gone || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    auto it = merges_.find(key(left.id, right.id));
    if (it == merges_.end() || it->second.second != top.merged) continue;  // stale
    left.id = top.merged;
    right.gone = true;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0) offer(left.prev);
    offer(top.pos);
  }
  std::vector<int64_t> ids;
  for (const Symbol& s : symbols) {
    if (!s.gone) ids.push_back(s.id);
  }
  return ids;
}

// Note [Unigram]
// Every segmentation of a pre-token into vocabulary pieces scores the sum of
// its pieces' log-probabilities; the best one wins (Viterbi over a byte
// trie). A character no piece starts with costs the lowest score minus 10
// as the unknown token; adjacent unknowns fuse into one, which byte_fallback
// then spells as <0xXX> tokens. As tokenizers' encode_optimized.
class Unigram : public Model {
 public:
  Unigram(const json& j, const std::string& where);
  std::string type() const override { return "Unigram"; }
  void encode(const std::string& piece, std::vector<int64_t>& ids) const override;
  int64_t size() const override { return vocab_.size(); }
  const std::string* token(int64_t id) const override { return vocab_.token(id); }
  int64_t id(const std::string& token) const override { return vocab_.id(token); }

 private:
  int child(int node, unsigned char byte) const {
    auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
    return it == edges_.end() ? -1 : it->second;
  }

  Vocabulary vocab_;
  std::vector<double> scores_;
  double min_score_ = 0;
  int64_t unk_id_ = -1;
  bool byte_fallback_;
  std::unordered_map<uint64_t, int> edges_;  // (node, byte) -> node
  std::vector<int64_t> node_token_;          // the token a trie node spells, or -1
};

Unigram::Unigram(const json& j, const std::string& where) : byte_fallback_(j.value("byte_fallback", false)) {
  const json& vocab = field(j, "vocab", where);
  node_token_.push_back(-1);
  min_score_ = vocab.empty() ? 0.0 : 1e300;
  for (size_t id = 0; id < vocab.size(); ++id) {
    const json& entry = vocab[id];
    if (!entry.is_array() || entry.size() != 2) throw TokenizerError(where + ".vocab[" + std::to_string(id) + "] is not [piece, score]");
    const std::string piece = entry[0];
    vocab_.add(piece, static_cast<int64_t>(id), where + ".vocab");
    scores_.push_back(entry[1].get<double>());
    min_score_ = std::min(min_score_, scores_.back());
    int node = 0;
    for (unsigned char b : piece) {
      int next = child(node, b);
      if (next < 0) {
        next = static_cast<int>(node_token_.size());
        node_token_.push_back(-1);
        edges_[(static_cast<uint64_t>(node) << 8) | b] = next;
      }
      node = next;
    }
    node_token_[static_cast<size_t>(node)] = static_cast<int64_t>(id);
  }
  if (j.contains("unk_id") && j["unk_id"].is_number_integer()) unk_id_ = j["unk_id"];
}

void Unigram::encode(const std::string& piece, std::vector<int64_t>& ids) const {
  struct Best {
    int64_t id = -1;
    double score = 0;
    int64_t from = -1;
  };
  const size_t n = piece.size();
  std::vector<Best> best(n + 1);
  const double unk_score = min_score_ - 10.0;
  for (size_t start = 0; start < n; start += unicode::char_length(static_cast<unsigned char>(piece[start]))) {
    const double base = best[start].score;
    const size_t width = unicode::char_length(static_cast<unsigned char>(piece[start]));
    bool single = false;
    for (int node = 0, at = static_cast<int>(start); at < static_cast<int>(n);) {
      node = child(node, static_cast<unsigned char>(piece[static_cast<size_t>(at++)]));
      if (node < 0) break;
      const int64_t id = node_token_[static_cast<size_t>(node)];
      if (id < 0) continue;
      Best& target = best[static_cast<size_t>(at)];
      const double score = base + scores_[static_cast<size_t>(id)];
      if (target.from < 0 || score > target.score) target = {id, score, static_cast<int64_t>(start)};
      single = single || static_cast<size_t>(at) - start == width;
    }
    if (!single) {
      if (unk_id_ < 0) throw TokenizerError("the Unigram model has no piece for \"" + piece.substr(start, width) + "\" and no unknown token");
      Best& target = best[start + width];
      if (target.from < 0 || base + unk_score > target.score) target = {unk_id_, base + unk_score, static_cast<int64_t>(start)};
    }
  }
  // Walk back, fusing runs of unknowns into one piece.
  std::vector<std::pair<int64_t, std::string>> pieces;
  for (size_t end = n; end > 0;) {
    const Best& node = best[end];
    const size_t from = static_cast<size_t>(node.from);
    std::string text = piece.substr(from, end - from);
    if (node.id == unk_id_ && !pieces.empty() && pieces.back().first == unk_id_) {
      pieces.back().second = text + pieces.back().second;
    } else {
      pieces.emplace_back(node.id, std::move(text));
    }
    end = from;
  }
  for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
    const int64_t id = vocab_.id(it->second);
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    std::vector<int64_t> bytes;
    for (unsigned char b : it->second) {
      const int64_t bid = byte_fallback_ ? vocab_.id(byte_token(b)) : -1;
      if (bid < 0) break;
      bytes.push_back(bid);
    }
    if (bytes.size() == it->second.size()) {
      ids.insert(ids.end(), bytes.begin(), bytes.end());
    } else {
      ids.push_back(it->first);
    }
  }
}

}  // namespace models

std::unique_ptr<Model> make_model(const json& j, const std::string& where) {
  using namespace models;
  const std::string type = j.is_object() && j.contains("type") ? j["type"].get<std::string>() : "";
  if (type == "BPE" || (type.empty() && j.is_object() && j.contains("merges"))) return std::make_unique<Bpe>(j, where);
  if (type == "Unigram") return std::make_unique<Unigram>(j, where);
  throw Unsupported(where + " is " + (type.empty() ? std::string("untyped") : type) +
                    ", a model meshtrain does not read (it reads BPE and Unigram)");
}

}  // namespace meshtrain::text::hf
