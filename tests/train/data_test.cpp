// Token files, prepare, and the sampler; every bad file gets a message naming it.
#include "meshtrain/train/data.h"
#include "meshtrain/train/prepare.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include "meshtrain/util/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

namespace meshtrain::train {
namespace {

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = util::make_temp_directory("meshtrain-data-");
  }
  void TearDown() override { util::remove_tree(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(DataTest, TokenizerRoundTripsBytes) {
  const std::string text = "Hello, \xff\x01 world\n";
  const auto tokens = ByteTokenizer::encode(text);
  EXPECT_EQ(tokens[7], 255);
  EXPECT_EQ(ByteTokenizer::decode(at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()))), text);
}

TEST_F(DataTest, TokenFileRoundTripsAndSlices) {
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 256);
  write_token_file(path("a.bin"), tokens, 256);
  TokenFile file(path("a.bin"));
  EXPECT_EQ(file.size(), 1000);
  EXPECT_EQ(file.vocab_size(), 256);
  EXPECT_TRUE(at::equal(file.slice(250, 10), at::arange(250, 260, at::kLong) % 256));
  EXPECT_EQ(util::file_size(path("a.bin")), 32 + 1000);  // one byte per token
}

TEST_F(DataTest, BadFilesAreRefusedNamingTheFile) {
  EXPECT_EQ(testing::error_of<DataError>([&] { TokenFile f(path("missing.bin")); }),
            "data file " + path("missing.bin") + ": does not exist; create it with `meshtrain prepare TEXT_FILES... --out DIR`");
  std::ofstream(path("empty.bin")).close();
  EXPECT_EQ(testing::error_of<DataError>([&] { TokenFile f(path("empty.bin")); }),
            "data file " + path("empty.bin") + ": is empty; create it with `meshtrain prepare`");
  std::ofstream(path("text.txt")) << "this is plain text, not a token file at all";
  EXPECT_NE(testing::error_of<DataError>([&] { TokenFile f(path("text.txt")); }).find(path("text.txt") + ": is not a meshtrain token file"),
            std::string::npos);
  write_token_file(path("cut.bin"), std::vector<uint16_t>(100, 7), 256);
  ASSERT_EQ(truncate(path("cut.bin").c_str(), 32 + 60), 0);
  EXPECT_NE(testing::error_of<DataError>([&] { TokenFile f(path("cut.bin")); }).find("is truncated or padded: the header promises 100 tokens"),
            std::string::npos);
  write_token_file(path("short.bin"), std::vector<uint16_t>(50, 7), 256);
  TokenFile short_file(path("short.bin"));
  EXPECT_EQ(testing::error_of<DataError>([&] { Sampler s(short_file, 64, 1); }),
            "data file " + path("short.bin") +
                ": has 50 tokens, fewer than one sequence needs (model.context + 1 = 65); use more text or a shorter context");
}

TEST_F(DataTest, PrepareReadsDirectoriesOnceAndSplits) {
  util::make_directories(path("corpus"));
  std::ofstream(path("corpus/b.txt")) << std::string(900, 'b');
  std::ofstream(path("corpus/a.txt")) << std::string(100, 'a');
  ASSERT_EQ(symlink(path("corpus/a.txt").c_str(), path("corpus/c.txt").c_str()), 0);  // the same file twice
  const PrepareResult r = prepare({path("corpus")}, path("out"), 0.1);
  EXPECT_EQ(r.sources.size(), 2u);
  EXPECT_EQ(r.train_tokens, 900);
  EXPECT_EQ(r.val_tokens, 100);
  TokenFile train(r.train_path);
  EXPECT_EQ(ByteTokenizer::decode(train.slice(0, 3)), "aaa");  // sorted: a.txt first
  EXPECT_EQ(testing::error_of<DataError>([&] { prepare({path("nothing")}, path("out2"), 0.1); }), "input " + path("nothing") + ": does not exist");
  std::ofstream(path("blank.txt")).close();
  EXPECT_NE(testing::error_of<DataError>([&] { prepare({path("blank.txt")}, path("out3"), 0.1); }).find("empty, no text to train on"),
            std::string::npos);
}

TEST_F(DataTest, SamplerRanksReadDisjointRowsThatMakeTheGlobalBatch) {
  std::vector<uint16_t> tokens(4001);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i / 16 + i % 3) % 256);  // window w starts with w
  write_token_file(path("s.bin"), tokens, 256);
  TokenFile file(path("s.bin"));
  Sampler one(file, 16, 42), again(file, 16, 42), other_seed(file, 16, 43);
  EXPECT_EQ(one.windows(), 250);
  // Global batch of 12 rows at cursor 240 (crossing into epoch 2): 3 ranks x 2 micro-steps x 2 rows.
  auto [all_x, all_y] = one.rows(240, 12);
  EXPECT_TRUE(at::equal(all_x.narrow(1, 1, 15), all_y.narrow(1, 0, 15)));  // targets are inputs shifted by one
  for (int64_t a = 0; a < 2; ++a) {
    for (int64_t r = 0; r < 3; ++r) {
      auto [x, y] = again.rows(240 + (a * 3 + r) * 2, 2);
      EXPECT_TRUE(at::equal(x, all_x.narrow(0, (a * 3 + r) * 2, 2)));
    }
  }
  EXPECT_FALSE(at::equal(one.rows(0, 4).first, other_seed.rows(0, 4).first));
  // One epoch visits every window exactly once (window w's first token is w).
  auto [epoch, unused] = one.rows(0, 250);
  EXPECT_EQ(std::get<0>(at::_unique(epoch.select(1, 0))).numel(), 250);
}

}  // namespace
}  // namespace meshtrain::train
