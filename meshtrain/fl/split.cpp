#include "meshtrain/fl/split.h"

#include "meshtrain/train/data.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

std::string directory_name(const std::string& speaker) {
  std::string out;
  for (char c : speaker) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out.empty() ? "unnamed" : out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("fl split: cannot read '" + path + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::vector<Speech> parse_speeches(const std::string& script) {
  std::vector<Speech> speeches;
  std::istringstream in(script);
  std::string line, block;
  auto flush = [&] {
    const size_t end = block.find('\n');
    const std::string first = block.substr(0, end);
    if (!first.empty() && first.back() == ':' && end != std::string::npos)
      speeches.push_back(Speech{first.substr(0, first.size() - 1), block + "\n"});
    block.clear();
  };
  while (std::getline(in, line)) {
    if (line.empty()) {
      if (!block.empty()) flush();
      continue;
    }
    block += line + "\n";
  }
  if (!block.empty()) flush();
  return speeches;
}

std::vector<ClientText> split_by_speaker(const std::vector<Speech>& speeches) {
  std::map<std::string, ClientText> by_name;
  for (const auto& s : speeches) {
    ClientText& c = by_name[s.speaker];
    c.name = s.speaker;
    c.speeches.push_back(&s);
  }
  std::vector<ClientText> out;
  for (auto& [name, c] : by_name) out.push_back(std::move(c));
  return out;
}

std::vector<ClientText> split_iid(const std::vector<Speech>& speeches, int clients, uint64_t seed) {
  std::vector<const Speech*> order;
  for (const auto& s : speeches) order.push_back(&s);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<ClientText> out(static_cast<size_t>(clients));
  for (int i = 0; i < clients; ++i) out[i].name = "client" + std::to_string(i);
  for (size_t i = 0; i < order.size(); ++i) out[i % clients].speeches.push_back(order[i]);
  return out;
}

std::vector<ClientText> split_dirichlet(const std::vector<Speech>& speeches, int clients, double alpha, uint64_t seed) {
  if (!(alpha > 0)) throw std::invalid_argument("fl split: --alpha must be positive");
  std::mt19937_64 rng(seed);
  std::vector<ClientText> out(static_cast<size_t>(clients));
  for (int i = 0; i < clients; ++i) out[i].name = "client" + std::to_string(i);
  // Each speaker (the label) spreads its speeches over the clients with
  // proportions p ~ Dir(α): small α, each client sees few speakers.
  for (const ClientText& speaker : split_by_speaker(speeches)) {
    std::gamma_distribution<double> gamma(alpha, 1.0);
    std::vector<double> p(static_cast<size_t>(clients));
    for (auto& x : p) x = gamma(rng);
    std::discrete_distribution<int> pick(p.begin(), p.end());
    for (const Speech* s : speaker.speeches) out[pick(rng)].speeches.push_back(s);
  }
  return out;
}

SplitSummary write_split(const std::string& text_path, const std::string& out_dir, const SplitOptions& options) {
  const std::string text = read_text(text_path);
  const std::vector<Speech> speeches = parse_speeches(text);
  if (speeches.empty())
    throw std::runtime_error("fl split: no speeches in '" + text_path + "' (expected blocks separated by blank lines "
                             "whose first line is 'NAME:', as in a play script)");
  if ((options.by == "iid" || options.by == "dirichlet") && options.clients < 1)
    throw std::invalid_argument("fl split: --clients must be at least 1");
  std::vector<ClientText> clients;
  if (options.by == "speaker") clients = split_by_speaker(speeches);
  else if (options.by == "iid") clients = split_iid(speeches, options.clients, options.seed);
  else if (options.by == "dirichlet") clients = split_dirichlet(speeches, options.clients, options.alpha, options.seed);
  else throw std::invalid_argument("fl split: --by " + options.by + ": use speaker, iid or dirichlet");

  std::filesystem::create_directories(out_dir);
  SplitSummary summary;
  std::string val_text;
  nlohmann::json listing = nlohmann::json::array();
  std::set<std::string> used;
  for (const ClientText& c : clients) {
    const size_t n = c.speeches.size();
    // The last speeches, whose share of the client's text is nearest val_fraction (data.val_fraction's meaning:
    // a share of the tokens, cut at a document start), keeping at least one speech to train on.
    size_t total = 0, held_bytes = 0, held_out = 0;
    for (const Speech* speech : c.speeches) total += speech->text.size();
    const double target = options.val_fraction * static_cast<double>(total);
    while (held_out + 1 < n) {
      const size_t next = c.speeches[n - 1 - held_out]->text.size();
      if (static_cast<double>(held_bytes) + 0.5 * static_cast<double>(next) > target) break;
      held_bytes += next;
      ++held_out;
    }
    std::string train_text;
    for (size_t i = 0; i < n - held_out; ++i) train_text += c.speeches[i]->text;
    if (static_cast<int64_t>(train_text.size()) < options.min_bytes) {
      ++summary.dropped;
      continue;
    }
    for (size_t i = n - held_out; i < n; ++i) val_text += c.speeches[i]->text;
    std::string dir = directory_name(c.name);
    while (used.count(dir)) dir += "_";
    used.insert(dir);
    std::filesystem::create_directories(out_dir + "/" + dir);
    train::write_token_file(out_dir + "/" + dir + "/train.bin", train::ByteTokenizer::encode(train_text),
                            train::ByteTokenizer::kVocabSize);
    listing.push_back({{"name", c.name}, {"dir", dir}, {"train_bytes", train_text.size()}, {"speeches", n - held_out}});
    ++summary.clients;
    summary.train_bytes += static_cast<int64_t>(train_text.size());
  }
  if (summary.clients == 0)
    throw std::runtime_error("fl split: every client has less than --min-bytes " + std::to_string(options.min_bytes) +
                             " of training text; lower --min-bytes or use fewer clients");
  if (val_text.empty()) throw std::runtime_error("fl split: no validation text; raise --data.val_fraction");
  train::write_token_file(out_dir + "/val.bin", train::ByteTokenizer::encode(val_text), train::ByteTokenizer::kVocabSize);
  summary.val_bytes = static_cast<int64_t>(val_text.size());
  std::ofstream(out_dir + "/clients.json") << listing.dump(1) << "\n";
  return summary;
}

}  // namespace meshtrain::fl
