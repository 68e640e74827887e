// Prepared data beyond plain windows: 4-byte token ids, sources cut into
// units, loss masks, padded documents, mixtures, and chat records rendered
// with an assistant-only mask (hand-computed expectations throughout).
#include "meshtrain/train/chat_data.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/prepare.h"
#include "meshtrain/train/sources.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include "meshtrain/util/files.h"

#include <fstream>

namespace meshtrain::train {
namespace {

class PreparedDataTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = util::make_temp_directory("meshtrain-prepared-"); }
  void TearDown() override { util::remove_tree(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::vector<int64_t> values(const at::Tensor& t) const {
    const at::Tensor c = t.contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  std::string dir_;
};

TEST_F(PreparedDataTest, LargeVocabulariesTakeFourBytesPerToken) {
  const std::vector<int64_t> ids = {0, 65535, 65536, 128255, 151935, 7};
  write_token_file(path("q.bin"), ids, 151936);
  EXPECT_EQ(util::file_size(path("q.bin")), 32 + 4 * 6);
  TokenFile file(path("q.bin"));
  EXPECT_EQ(values(file.slice(0, 6)), ids);
  EXPECT_EQ(file.at(4), 151935);
  EXPECT_NE(testing::error_of<DataError>([&] { write_token_file(path("r.bin"), std::vector<int64_t>{151936}, 151936); })
                .find("value 151936 is outside [0, 151936)"),
            std::string::npos);
  EXPECT_FALSE(util::path_exists(path("r.bin.tmp")));  // an unfinished file leaves nothing behind
}

TEST_F(PreparedDataTest, UnitsReadEveryJsonLineOnce) {
  std::ofstream out(path("d.jsonl"));
  for (int i = 0; i < 300; ++i) out << "{\"text\": \"record " << i << "\"}\n" << (i % 7 == 0 ? "\n" : "");
  out.close();
  const std::vector<Shard> shards = find_shards({path("d.jsonl")});
  ASSERT_EQ(shards.size(), 1u);
  EXPECT_EQ(shards[0].format, SourceFormat::kJsonl);
  const std::vector<Unit> units = plan_units(shards, 100);  // 100-byte units cut records in the middle
  EXPECT_GT(units.size(), 50u);
  std::vector<std::string> seen;
  for (const Unit& u : units) {
    read_unit(shards[0], u, 100, {"text"}, [&](nlohmann::ordered_json&& r, const std::string&) {
      seen.push_back(r["text"].get<std::string>());
    });
  }
  ASSERT_EQ(seen.size(), 300u);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(seen[i], "record " + std::to_string(i));
  std::ofstream(path("bad.jsonl")) << "{\"text\": \"a\"}\n{\"text\": oops}\n";
  const Shard bad = find_shards({path("bad.jsonl")})[0];
  EXPECT_EQ(testing::error_of<DataError>([&] { read_unit(bad, {0, 0, bad.bytes}, 1 << 20, {"text"}, [](auto&&, auto&) {}); }),
            "data file " + path("bad.jsonl") + " line 2: not a JSON value");
}

// Tokens 0, 1, 2, ... so a target's value says where it came from.
std::vector<int64_t> counting(int64_t n) {
  std::vector<int64_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = i % 256;
  return t;
}

TEST_F(PreparedDataTest, MaskedTargetsAndPaddedDocumentsCountTowardNoLoss) {
  write_token_file(path("t.bin"), counting(40), 256);
  std::vector<int64_t> mask(40, 0);
  for (int i : {3, 4, 5, 20, 21}) mask[i] = 1;
  write_token_file(path("t.mask"), mask, 2);
  write_token_file(path("t.idx"), std::vector<int64_t>{0, 6, 30, 40}, 41);  // documents of 6, 24 and 10 tokens
  TokenDataset data(path("t.bin"));
  EXPECT_EQ(data.documents(), 3);
  const int64_t I = kIgnoredTarget;
  // concat: window 0 is tokens 0..8; target j is token j + 1, counted where its mask is 1.
  Sampler concat({{&data.tokens(), data.mask(), &data, 1.0}}, 8, 1, /*shuffle=*/false, Packing::kConcat);
  auto [x, y] = concat.rows(0, 1);
  EXPECT_EQ(values(x[0]), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(values(y[0]), (std::vector<int64_t>{I, I, 3, 4, 5, I, I, I}));
  EXPECT_EQ(concat.counted_targets(0, 3), 5);  // windows 0, 1, 2 hold tokens up to 24: 3, 4, 5, 20, 21
  EXPECT_TRUE(concat.ignores_targets());
  // padded: row d is document d, padded with the pad id; padding's targets are ignored.
  Sampler padded({{&data.tokens(), data.mask(), &data, 1.0}}, 8, 1, false, Packing::kPadded, /*pad_id=*/99);
  auto [px, py] = padded.rows(0, 3);
  EXPECT_EQ(values(px[0]), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 99, 99}));
  EXPECT_EQ(values(py[0]), (std::vector<int64_t>{I, I, 3, 4, 5, I, I, I}));
  EXPECT_EQ(values(px[1]), (std::vector<int64_t>{6, 7, 8, 9, 10, 11, 12, 13}));  // cut at context + 1
  EXPECT_EQ(values(py[1]), (std::vector<int64_t>(8, I)));                       // no mask inside: nothing counts
  EXPECT_EQ(values(px[2]), (std::vector<int64_t>{30, 31, 32, 33, 34, 35, 36, 37}));
  EXPECT_EQ(padded.counted_targets(0, 3), 3);
  // packed: windows as concat, positions restart at each document, no target crosses into the next one.
  Sampler packed({{&data.tokens(), nullptr, &data, 1.0}}, 8, 1, false, Packing::kPacked);
  auto [kx, ky] = packed.rows(3, 1);  // tokens 24..32: document 1 ends at 30
  EXPECT_EQ(values(kx[0]), (std::vector<int64_t>{24, 25, 26, 27, 28, 29, 30, 31}));
  EXPECT_EQ(values(ky[0]), (std::vector<int64_t>{25, 26, 27, 28, 29, I, 31, 32}));
  EXPECT_EQ(values(packed.positions(3, 1)[0]), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 0, 1}));
  EXPECT_FALSE(Sampler(data.tokens(), 8, 1).positions(0, 1).defined());
  // Padded rows need the document index.
  write_token_file(path("plain.bin"), counting(40), 256);
  TokenDataset plain(path("plain.bin"));
  EXPECT_EQ(testing::error_of<DataError>([&] { Sampler s({{&plain.tokens(), nullptr, &plain, 1.0}}, 8, 1, false, Packing::kPadded); }),
            "data file " + path("plain.bin") + ": data.packing = \"padded\" needs its document index (" +
                path("plain.idx") + "); prepare the data again, or use packing \"concat\"");
}

TEST_F(PreparedDataTest, MixturesKeepTheirProportionsInEveryPrefix) {
  write_token_file(path("a.bin"), counting(200), 256);
  write_token_file(path("b.bin"), std::vector<int64_t>(200, 255), 256);
  TokenFile a(path("a.bin")), b(path("b.bin"));
  Sampler mix({{&a, nullptr, nullptr, 3.0}, {&b, nullptr, nullptr, 1.0}}, 8, 5, true, Packing::kConcat);
  const std::vector<int> sources = mix.sources_of(0, 400);
  int64_t taken_b = 0;
  for (size_t p = 0; p < sources.size(); ++p) {
    taken_b += sources[p];
    EXPECT_LE(std::abs(static_cast<double>(taken_b) - 0.25 * static_cast<double>(p + 1)), 1.0) << "prefix " << p + 1;
  }
  EXPECT_EQ(taken_b, 100);
  // Rows come from the chosen source, and the choice depends on the position alone.
  Sampler again({{&a, nullptr, nullptr, 3.0}, {&b, nullptr, nullptr, 1.0}}, 8, 5, true, Packing::kConcat);
  auto [x, y] = mix.rows(37, 6);
  EXPECT_TRUE(at::equal(x, again.rows(37, 6).first));
  mix.rows(300, 4);  // forward, then back again
  EXPECT_TRUE(at::equal(mix.rows(37, 6).first, x));
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(x[i][0].item<int64_t>() == 255, sources[37 + i] == 1) << i;
}

// A tokenizer whose ids are bytes, with a chat template, so spans are by hand.
std::unique_ptr<text::Tokenizer> templated_bytes() {
  auto tokenizer = text::bytes_tokenizer();
  const nlohmann::json config = {{"chat_template",
                                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}"
                                  "{% if add_generation_prompt %}<assistant>{% endif %}"}};
  tokenizer->set_companions({{"tokenizer_config.json", config.dump()}});
  return tokenizer;
}

TEST_F(PreparedDataTest, ChatRecordsCountOnlyTheAssistant) {
  const auto tokenizer = templated_bytes();
  const ChatRenderer chat(*tokenizer, LossOn::kAssistant);
  const nlohmann::ordered_json record = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"},
                       {"role": "assistant", "content": "ok!"}]})");
  const MaskedTokens t = chat.render(record, "x.jsonl line 1");
  const std::string text = "<system>S</><user>hi</><assistant>yo</><user>?</><assistant>ok!</>";
  ASSERT_EQ(t.ids.size(), text.size());
  std::string counted;
  for (size_t i = 0; i < text.size(); ++i) counted += t.mask[i] ? text[i] : '.';
  EXPECT_EQ(counted, std::string(34, '.') + "yo</>" + std::string(21, '.') + "ok!</>");
  // Prompt and completion: the same template, a user turn and an assistant one.
  const MaskedTokens pc = chat.render({{"prompt", "2+2?"}, {"completion", "4"}}, "x");
  EXPECT_EQ(std::count(pc.mask.begin(), pc.mask.end(), 1), 4);  // "4</>"
  EXPECT_EQ(ChatRenderer(*tokenizer, LossOn::kAll).render(record, "x").mask, std::vector<int64_t>(text.size(), 1));
  // Refused by name.
  EXPECT_EQ(testing::error_of<DataError>([&] { chat.render({{"messages", {{{"role", "user"}, {"content", "a"}}}}}, "x.jsonl line 3"); }),
            "data file x.jsonl line 3: the conversation has no assistant message, so nothing would count toward the loss");
  EXPECT_EQ(testing::error_of<DataError>([&] { chat.render({{"text", "a"}}, "x.jsonl line 4"); }),
            "data file x.jsonl line 4: a chat record needs \"messages\" or \"prompt\" and \"completion\"");
  // Without a template, prompt and completion are joined and the completion counts.
  const auto plain = text::bytes_tokenizer();
  const MaskedTokens joined = ChatRenderer(*plain, LossOn::kAssistant).render({{"prompt", "Q: "}, {"completion", "A"}}, "x");
  EXPECT_EQ(joined.ids, (std::vector<int64_t>{'Q', ':', ' ', 'A'}));
  EXPECT_EQ(joined.mask, (std::vector<int64_t>{0, 0, 0, 1}));
}

TEST_F(PreparedDataTest, PrepareWritesDocumentsIndexAndMask) {
  std::ofstream out(path("chat.jsonl"));
  for (int i = 0; i < 40; ++i) {
    out << R"({"messages": [{"role": "user", "content": "q)" << i << R"("}, {"role": "assistant", "content": "a)" << i
        << R"("}]})" << "\n";
  }
  out.close();
  PrepareOptions o;
  o.inputs = {path("chat.jsonl")};
  o.out_dir = path("out");
  o.format = DataFormat::kChat;
  o.tokenizer = "bytes";
  EXPECT_NE(testing::error_of<DataError>([&] { prepare(o); }).find("line 1: a \"messages\" record needs a chat template"), std::string::npos);
  o.format = DataFormat::kText;
  o.field = "messages";
  EXPECT_NE(testing::error_of<DataError>([&] { prepare(o); }).find("line 1: no string field \"messages\""), std::string::npos);
  o.field = "text";
  std::ofstream(path("docs.jsonl")) << "{\"text\": \"abc\"}\n{\"text\": \"defgh\"}\n{\"text\": null}\n{\"text\": \"ij\"}\n";
  o.inputs = {path("docs.jsonl")};
  o.val_fraction = 0.2;
  const PrepareResult r = prepare(o);
  EXPECT_EQ(r.train_tokens, 8);  // "abcdefgh": the split falls on the document start nearest 8 of 10
  EXPECT_EQ(r.val_tokens, 2);
  EXPECT_EQ(r.train_documents, 2);
  TokenDataset train(r.train_path);
  EXPECT_EQ(train.document(1), (std::pair<int64_t, int64_t>{3, 8}));
  EXPECT_EQ(train.mask(), nullptr);
  EXPECT_TRUE(prepare(o).reused);  // the same plan again: nothing to do
  // Documents of 500, 470 and 30 tokens: the start nearest the last tenth (970) is too far from 900, so
  // validation starts inside the second document; its index starts at 0.
  std::ofstream(path("long.jsonl")) << "{\"text\": \"" << std::string(500, 'a') << "\"}\n{\"text\": \""
                                    << std::string(470, 'b') << "\"}\n{\"text\": \"" << std::string(30, 'c') << "\"}\n";
  o.inputs = {path("long.jsonl")};
  o.out_dir = path("long");
  o.val_fraction = 0.1;
  const PrepareResult cut = prepare(o);
  EXPECT_EQ(cut.train_tokens, 900);
  EXPECT_EQ(cut.val_documents, 2);
  TokenDataset val(cut.val_path);
  EXPECT_EQ(val.document(0), (std::pair<int64_t, int64_t>{0, 70}));
  EXPECT_EQ(val.document(1), (std::pair<int64_t, int64_t>{70, 100}));
  TokenDataset cut_train(cut.train_path);
  EXPECT_EQ(cut_train.documents(), 2);
  EXPECT_EQ(cut_train.document(1), (std::pair<int64_t, int64_t>{500, 900}));
}

}  // namespace
}  // namespace meshtrain::train
