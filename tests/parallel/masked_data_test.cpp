// Loss masks, padded rows and packed rows (documents side by side, attention
// and positions inside each) in every layout under mpirun: the loss of a
// step is the mean over the counted targets of the whole global batch
// (Note [Packing]), whatever the micro-batches, so data parallel, ZeRO-3, tensor parallel (its
// vocabulary-parallel cross-entropy ignores the masked targets), sequence
// parallel, context parallel (ring, all-to-all, hybrid) and the pipeline equal one process, loss and gradient norm every
// step and the parameters after, though ranks count different numbers of
// targets and some micro-batches count none.
#include "tests/parallel/training_fixture.h"

namespace meshtrain::train {
namespace {

class MaskedDataTest : public TrainingTest {
 protected:
  // A mask over train.bin and val.bin (runs of counted and ignored tokens,
  // including whole windows of neither) and a document index of uneven lengths.
  void write_companions() {
    if (world()->rank() == 0) {
      for (const char* name : {"train", "val"}) {
        const TokenFile tokens(util::join_path(dir_, std::string(name) + ".bin"));
        at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
        std::vector<int64_t> mask(tokens.size()), starts = {0};
        for (int64_t i = 0; i < tokens.size(); ++i) mask[i] = (i / 7) % 3 == 1 && (i / 200) % 4 != 3;
        for (int64_t at = 0;;) {
          at += 3 + at::randint(0, 30, {1}, g, at::kLong).item<int64_t>();
          if (at >= tokens.size()) break;
          starts.push_back(at);
        }
        starts.push_back(tokens.size());
        write_token_file(util::join_path(dir_, std::string(name) + ".mask"), mask, 2);
        write_token_file(util::join_path(dir_, std::string(name) + ".idx"), starts, tokens.size() + 1);
      }
    }
    world()->barrier().wait();
  }
};

// `unpacked`: also tensor parallel by sharding annotations (packed rows are refused there).
// Under cp each rank counts a different share of a row's targets, and packed rows' documents
// straddle the ranks' chunks (a query finds its document's keys on other ranks).
std::vector<Overrides> layouts(int ranks, bool unpacked) {
  std::vector<Overrides> out = {{}, {"parallel.zero_stage=3"}};
  if (ranks % 2 == 0) {
    out.push_back({"parallel.tp=2"});
    if (unpacked) out.push_back({"parallel.tp=2", "parallel.tp_impl=annotations"});
    out.push_back({"parallel.cp=2"});
    out.push_back({"parallel.cp=2", "parallel.cp_impl=all_to_all", "parallel.zero_stage=2"});
    if (ranks == 4 && !unpacked) out.push_back({"parallel.cp=4", "parallel.cp_impl=hybrid"});
    out.push_back({"parallel.tp=2", "parallel.sequence_parallel=true"});
    out.push_back({"parallel.pp=2", "parallel.microbatches=4"});
  }
  return out;
}

TEST_F(MaskedDataTest, MaskedPaddedAndPackedTargetsInEveryLayoutEqualOneProcess) {
  const int n = world()->size();
  if (n < 2 || n > 4) GTEST_SKIP() << "run at 2, 3 and 4 ranks";
  write_companions();
  const Overrides llama = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                           "model.tie_embeddings=false"};
  // Packed rows also with GPT-2's learned positions, there with activation checkpointing in the layout
  // (not in the one process): its recompute must keep the documents.
  struct Case {
    std::string packing;
    Overrides style, layout;
  };
  const std::vector<Case> cases = {{"concat", llama, {}}, {"padded", llama, {}}, {"packed", llama, {}},
                                   {"packed", {}, {"parallel.activation_checkpoint=full"}}};
  for (const Case& c : cases) {
    const std::string& packing = c.packing;
    for (Overrides layout : layouts(n, packing != "packed")) {
      const int64_t micro = !layout.empty() && layout.front().rfind("parallel.pp", 0) == 0 ? 1 : 2;
      Overrides model = c.style;
      model.push_back("data.packing=" + packing);
      layout.insert(layout.end(), c.layout.begin(), c.layout.end());
      layout.insert(layout.end(), model.begin(), model.end());
      const TrainConfig split = config(n, micro, "", layout);
      Trainer parallel(split, world());
      // One process reads, per micro-batch, what every data rank reads at that accumulation step together:
      // a mean per micro-batch (not over the global batch) would differ.
      const OneProcessRun& single = one_process_of(split.micro_batch * split.data_ranks(), model, 3, true);
      expect_same_training(parallel, single, 3,
                           std::string(packing) + " with " + describe(layout) + " on " + std::to_string(n) + " ranks");
      EXPECT_NEAR(parallel.evaluate(), single.val_loss, 1e-5 * single.val_loss) << packing << " " << describe(layout);
    }
  }
}

}  // namespace
}  // namespace meshtrain::train
