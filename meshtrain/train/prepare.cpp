#include "meshtrain/train/prepare.h"

#include "meshtrain/checkpoint/format.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/sources.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace meshtrain::train {

// Note [Prepared data]
// prepare writes, to its output folder:
//   train.bin, val.bin    tokens (token files, data.h), documents one after another,
//                         each with the tokenizer's start token where it adds one and
//                         its end-of-text token after (the byte tokenizer has none);
//   train.idx, val.idx    where each document starts;
//   train.mask, val.mask  chat data only: 1 where predicting the token counts toward the loss;
//   prepare.json          what was read and how, with the plan's fingerprint.
// The work is cut into units (Note [Data units]); rank r of n tokenizes units
// r, r + n, ... into parts/uNNNNNN.{bin,idx,mask}, finished by uNNNNNN.json,
// and rank 0 then joins the parts in unit order. Parts depend only on the
// units, so the output is byte-identical whatever n. A run that stops leaves
// its finished parts; the next run with the same plan (sources by name, size
// and modification time, tokenizer, settings) tokenizes only the rest, and a
// folder whose prepare.json has the same plan is used as it is. Validation
// data is the last val_fraction of the tokens, cut at the nearest document
// start when one is within half that share, else inside a document. Memory is bounded
// by a unit (split_mb), not by the corpus.

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string fingerprint(const std::string& text) {
  return checkpoint::hex(checkpoint::checksum(text.data(), static_cast<int64_t>(text.size())));
}

const char* format_name(DataFormat f) { return f == DataFormat::kChat ? "chat" : "text"; }

// What decides the parts: every input file as found, the tokenizer, the settings.
std::string plan_of(const PrepareOptions& o, const std::vector<Shard>& shards, const text::Tokenizer& tokenizer) {
  json plan = {{"version", 2}, {"format", format_name(o.format)}, {"field", o.field},
               {"loss_on", o.loss_on == LossOn::kAll ? "all" : "assistant"}, {"split_mb", o.split_mb},
               {"tokenizer", fingerprint(text::tokenizer_to_json(tokenizer))}};
  for (const Shard& s : shards) {
    struct stat info {};
    stat(s.path.c_str(), &info);
    plan["shards"].push_back({s.path, s.bytes, static_cast<int64_t>(info.st_mtime)});
  }
  return fingerprint(plan.dump());
}

std::string part_path(const std::string& parts, int64_t unit, const char* suffix) {
  char name[32];
  std::snprintf(name, sizeof name, "u%06lld.%s", static_cast<long long>(unit), suffix);
  return util::join_path(parts, name);
}

struct Part {
  int64_t tokens = 0, documents = 0;
};

Part read_part(const std::string& parts, int64_t unit) {
  const json done = json::parse(util::read_text_file(part_path(parts, unit, "json")));
  return {done.at("tokens").get<int64_t>(), done.at("documents").get<int64_t>()};
}

// One unit into its part files; the .json, written last, says it is whole.
void tokenize_unit(const PrepareOptions& o, const text::Tokenizer& tokenizer, const ChatRenderer* chat,
                   const Shard& shard, const Unit& unit, int64_t index, const std::string& parts) {
  const int64_t vocab = tokenizer.vocab_size();
  TokenWriter tokens(part_path(parts, index, "bin"), vocab);
  std::unique_ptr<TokenWriter> mask;
  if (chat) mask = std::make_unique<TokenWriter>(part_path(parts, index, "mask"), 2);
  std::vector<int64_t> starts;
  const std::vector<std::string> fields =
      o.format == DataFormat::kChat ? std::vector<std::string>{"messages", "prompt", "completion"}
                                    : std::vector<std::string>{o.field};
  read_unit(shard, unit, o.split_mb << 20, fields, [&](json&& record, const std::string& where) {
    std::vector<int64_t> ids;
    try {
      if (chat) {
        MaskedTokens masked = chat->render(record, where);
        ids = std::move(masked.ids);
        mask->append(masked.mask);
      } else {
        const std::string field = shard.format == SourceFormat::kText ? "text" : o.field;
        const auto it = record.find(field);
        if (it == record.end() || !(it->is_string() || it->is_null())) {
          std::string keys;
          for (auto k = record.begin(); k != record.end(); ++k) keys += (keys.empty() ? "" : ", ") + k.key();
          data_error(where, "no string field \"" + field + "\" (the record has: " + keys +
                          "); name the field with data.field or --field");
        }
        if (it->is_null()) return;
        ids = tokenizer.with_special_tokens(tokenizer.encode(it->get<std::string>()));
        if (tokenizer.end_of_text() >= 0 && (ids.empty() || ids.back() != tokenizer.end_of_text())) {
          ids.push_back(tokenizer.end_of_text());
        }
      }
    } catch (const text::TokenizerError& e) {
      data_error(where, e.what());
    }
    if (ids.empty()) return;
    starts.push_back(tokens.count());
    tokens.append(ids);
  });
  TokenWriter index_file(part_path(parts, index, "idx"), tokens.count() + 1);
  starts.push_back(tokens.count());
  index_file.append(starts);
  index_file.finish();
  if (mask) mask->finish();
  const json done = {{"tokens", tokens.count()}, {"documents", static_cast<int64_t>(starts.size()) - 1}};
  tokens.finish();
  util::write_text_file(part_path(parts, index, "json"), done.dump() + "\n");
}

// Where validation data starts: the document start nearest the last
// val_fraction of the tokens, unless that is more than half the validation
// share away (documents few and long): then inside a document, at the share.
int64_t split_point(const std::string& parts, const std::vector<Part>& units, int64_t total, int64_t documents,
                    double val_fraction) {
  const int64_t val = static_cast<int64_t>(std::ceil(static_cast<double>(total) * val_fraction));
  const int64_t target = total - val;
  if (documents < 2) return target;
  int64_t best = -1, offset = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].tokens == 0) continue;
    const TokenFile index(part_path(parts, static_cast<int64_t>(u), "idx"));
    for (int64_t d = 0; d < units[u].documents; ++d) {
      const int64_t start = offset + index.at(d);
      if (start > 0 && (best < 0 || std::llabs(start - target) < std::llabs(best - target))) best = start;
    }
    offset += units[u].tokens;
  }
  return best >= 0 && std::llabs(best - target) <= val / 2 ? best : target;
}

// Joins the parts into train.* and val.*; returns the result's counts.
void join_parts(const std::string& parts, const std::vector<Part>& units, const PrepareOptions& o, int64_t vocab,
                bool masked, PrepareResult& r) {
  int64_t total = 0, documents = 0;
  for (const Part& p : units) total += p.tokens, documents += p.documents;
  if (total == 0) {
    throw DataError("input " + o.inputs.front() + (o.inputs.size() > 1 ? " and the others" : "") +
                    ": empty, no text to train on");
  }
  const int64_t split = split_point(parts, units, total, documents, o.val_fraction);
  if (split < 2 || total - split < 2) {
    throw DataError("input: " + std::to_string(total) + " tokens are too few to split into training and validation data");
  }
  struct Side {
    TokenWriter tokens, index;
    std::unique_ptr<TokenWriter> mask;
  };
  Side train{{r.train_path, vocab}, {companion_path(r.train_path, "idx"), split + 1}, nullptr};
  Side val{{r.val_path, vocab}, {companion_path(r.val_path, "idx"), total - split + 1}, nullptr};
  if (masked) {
    train.mask = std::make_unique<TokenWriter>(companion_path(r.train_path, "mask"), 2);
    val.mask = std::make_unique<TokenWriter>(companion_path(r.val_path, "mask"), 2);
  }
  // Validation data starts a document (a split inside one starts with the rest of it).
  const int64_t zero = 0;
  val.index.append(&zero, 1);
  int64_t offset = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].tokens == 0) continue;
    const int64_t unit = static_cast<int64_t>(u);
    const TokenFile tokens(part_path(parts, unit, "bin")), index(part_path(parts, unit, "idx"));
    std::unique_ptr<TokenFile> mask;
    if (masked) mask = std::make_unique<TokenFile>(part_path(parts, unit, "mask"));
    for (int64_t d = 0; d < units[u].documents; ++d) {
      const int64_t start = offset + index.at(d);
      if (start < split) train.index.append(&start, 1);
      else if (start > split) {
        const int64_t local = start - split;
        val.index.append(&local, 1);
      }
    }
    for (int64_t begin = 0; begin < units[u].tokens; begin += 1 << 20) {
      const int64_t n = std::min<int64_t>(1 << 20, units[u].tokens - begin);
      const at::Tensor chunk = tokens.slice(begin, n);
      const at::Tensor flags = masked ? mask->slice(begin, n) : at::Tensor();
      for (int64_t i = 0; i < n;) {  // the run of this chunk on one side of the split
        const int64_t global = offset + begin + i;
        Side& side = global < split ? train : val;
        const int64_t run = global < split ? std::min(n - i, split - global) : n - i;
        side.tokens.append(chunk.data_ptr<int64_t>() + i, run);
        if (masked) {
          side.mask->append(flags.data_ptr<int64_t>() + i, run);
          if (&side == &train) r.train_counted += flags.narrow(0, i, run).sum().item<int64_t>();
        }
        i += run;
      }
    }
    offset += units[u].tokens;
  }
  const int64_t train_end = split, val_end = total - split;
  r.train_documents = train.index.count();
  r.val_documents = val.index.count();
  train.index.append(&train_end, 1);
  val.index.append(&val_end, 1);
  for (Side* side : {&train, &val}) {
    side->index.finish();
    if (side->mask) side->mask->finish();
    side->tokens.finish();
  }
  r.train_tokens = split;
  r.val_tokens = total - split;
  if (!masked) r.train_counted = split;
}

// Whether `manifest` records a preparation of `plan`; its counts into `r`.
bool read_manifest(const std::string& manifest, const std::string& plan, PrepareResult& r) {
  if (!util::path_exists(manifest) || !util::path_exists(r.train_path)) return false;
  const json done = json::parse(util::read_text_file(manifest), nullptr, false);
  if (!done.is_object() || done.value("plan", "") != plan) return false;
  r.train_tokens = done.value("train_tokens", int64_t{0});
  r.val_tokens = done.value("val_tokens", int64_t{0});
  r.train_documents = done.value("train_documents", int64_t{0});
  r.val_documents = done.value("val_documents", int64_t{0});
  r.train_counted = done.value("train_counted", int64_t{0});
  return true;
}

// Rank 0's counts (and whether it found the folder prepared) on every rank,
// with the units every rank found finished summed.
void share_counts(comm::Communicator* world, PrepareResult& r, int64_t resumed) {
  std::vector<double> v = {double(r.reused), double(r.train_tokens), double(r.val_tokens), double(r.train_documents),
                           double(r.val_documents), double(r.train_counted), double(resumed)};
  if (world) {
    if (world->rank() != 0) std::fill(v.begin(), v.end() - 1, 0.0);
    v = comm::agree_values(*world, v, comm::ReduceOp::kSum);
  }
  r.reused = v[0] > 0;
  r.train_tokens = static_cast<int64_t>(v[1]);
  r.val_tokens = static_cast<int64_t>(v[2]);
  r.train_documents = static_cast<int64_t>(v[3]);
  r.val_documents = static_cast<int64_t>(v[4]);
  r.train_counted = static_cast<int64_t>(v[5]);
  r.resumed_units = static_cast<int64_t>(v[6]);
}

}  // namespace

PrepareResult prepare(const PrepareOptions& o, comm::Communicator* world) {
  const auto start = Clock::now();
  const int rank = world ? world->rank() : 0, ranks = world ? world->size() : 1;
  auto everywhere = [&](const std::function<void()>& work) { world ? comm::on_all_or_all_fail(*world, work) : work(); };
  auto on_root = [&](const std::function<void()>& work) { world ? comm::on_root_or_all_fail(*world, 0, work) : work(); };
  if (!(o.val_fraction > 0.0 && o.val_fraction < 1.0)) {
    throw DataError("prepare: the validation fraction must be in (0, 1), got " + std::to_string(o.val_fraction));
  }
  if (o.split_mb < 1) throw DataError("prepare: split_mb must be >= 1, got " + std::to_string(o.split_mb));
  PrepareResult r;
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::unique_ptr<ChatRenderer> chat;
  std::vector<Shard> shards;
  std::vector<Unit> units;
  std::string plan;
  const std::string parts = util::join_path(o.out_dir, "parts"), manifest = util::join_path(o.out_dir, "prepare.json");
  r.train_path = util::join_path(o.out_dir, "train.bin");
  r.val_path = util::join_path(o.out_dir, "val.bin");
  everywhere([&] {
    try {
      tokenizer = load_training_tokenizer(o.tokenizer);
    } catch (const text::TokenizerError& e) {
      throw DataError(std::string("tokenizer: ") + e.what());
    }
    if (o.format == DataFormat::kChat) chat = std::make_unique<ChatRenderer>(*tokenizer, o.loss_on);
    shards = find_shards(o.inputs);
    units = plan_units(shards, o.split_mb << 20);
    plan = plan_of(o, shards, *tokenizer);
  });
  for (const Shard& s : shards) r.sources.push_back(s.path);
  r.units = static_cast<int64_t>(units.size());
  r.token_bytes = token_bytes_for(tokenizer->vocab_size());
  // The output depends on the parts and on the validation share; the parts on the rest.
  const std::string output_plan = fingerprint(plan + " " + std::to_string(o.val_fraction));
  on_root([&] { r.reused = read_manifest(manifest, output_plan, r); });  // rank 0 decides for everyone
  share_counts(world, r, 0);
  if (r.reused) return r;
  // Parts of another plan are stale; a part of this one is kept (resume).
  const bool out_existed = util::path_exists(o.out_dir);
  on_root([&] {
    const std::string plan_file = util::join_path(parts, "plan");
    if (util::path_exists(plan_file) && util::read_text_file(plan_file) != plan) util::remove_tree(parts);
    util::make_directories(parts);
    util::write_text_file(plan_file, plan);
  });
  const auto tokenize_start = Clock::now();
  int64_t resumed = 0;
  try {
    everywhere([&] {
      for (int64_t u = rank; u < r.units; u += ranks) {
        if (util::path_exists(part_path(parts, u, "json"))) {
          ++resumed;
          continue;
        }
        tokenize_unit(o, *tokenizer, chat.get(), shards[units[u].shard], units[u], u, parts);
      }
    });
  } catch (const std::exception&) {
    // An input that cannot be read or tokenized: the parts of this plan are of no use once it is fixed (the
    // plan changes), so none is left behind, nor a folder this run made. A run that is killed keeps them (resume).
    if (rank == 0) {
      util::remove_tree(parts);
      std::error_code error;
      if (!out_existed) std::filesystem::remove(o.out_dir, error);  // only if empty
    }
    throw;
  }
  const double tokenize_seconds = seconds_since(tokenize_start);
  on_root([&] {
    std::vector<Part> done;
    for (int64_t u = 0; u < r.units; ++u) done.push_back(read_part(parts, u));
    join_parts(parts, done, o, tokenizer->vocab_size(), chat != nullptr, r);
    const json m = {{"plan", output_plan}, {"format", format_name(o.format)}, {"tokenizer", tokenizer->describe()},
                    {"token_bytes", r.token_bytes}, {"sources", r.sources}, {"units", r.units},
                    {"train_tokens", r.train_tokens}, {"val_tokens", r.val_tokens},
                    {"train_documents", r.train_documents}, {"val_documents", r.val_documents},
                    {"train_counted", r.train_counted}, {"masked", chat != nullptr}};
    util::write_text_file(manifest, m.dump(2) + "\n");
    util::remove_tree(parts);
  });
  share_counts(world, r, resumed);
  std::vector<double> most = {tokenize_seconds, peak_rss_mib()};
  if (world) most = comm::agree_values(*world, most, comm::ReduceOp::kMax);
  r.tokenize_seconds = most[0];
  r.peak_rss_mb = most[1];
  r.seconds = seconds_since(start);
  return r;
}

PrepareResult prepare(const std::vector<std::string>& inputs, const std::string& out_dir, double val_fraction,
                      const std::string& tokenizer) {
  PrepareOptions options;
  options.inputs = inputs;
  options.out_dir = out_dir;
  options.val_fraction = val_fraction;
  options.tokenizer = tokenizer;
  return prepare(options, nullptr);
}

}  // namespace meshtrain::train
