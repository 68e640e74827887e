// verify's block outputs (Note [Block outputs]) against the one-process run:
// a layout that splits rows (data parallel) or replicates them (tensor
// parallel without sequence parallel) agrees per element, and a block made
// to compute something else is the one that differs, its predecessor not.
#include "meshtrain/train/block_outputs.h"
#include "tests/parallel/training_fixture.h"

namespace meshtrain::train {
namespace {

// Adds `shift` to one block's output: a wrong forward, put in on purpose.
class ShiftBlock : public model::ForwardHooks {
 public:
  ShiftBlock(std::string block, double shift) : block_(std::move(block)), shift_(shift) {}
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    const at::Tensor y = forward(input);
    return module == block_ ? y + shift_ : y;
  }
  bool wraps_head() const override { return false; }

 private:
  std::string block_;
  double shift_;
};

TEST_F(TrainingTest, BlockOutputsEqualOneProcessAndNameTheBlockThatDiffers) {
  const int n = world()->size();
  const Overrides layout = n % 2 == 0 ? Overrides{"parallel.tp=2"} : Overrides{};
  OneProcessOptions options;
  options.steps = 1;
  options.block_outputs = true;
  const OneProcessRun one = train::one_process(world(), config(1, 1, "", {}), options);
  for (const bool shifted : {false, true}) {
    Trainer trainer(config(n, 1, "", layout), world());
    if (shifted) trainer.model()->add_forward_hooks(std::make_shared<ShiftBlock>("blocks.1", 0.01));
    const std::shared_ptr<BlockOutputs> outputs = record_block_outputs(trainer.model());
    trainer.step();
    const std::vector<BlockOutput> got = outputs->totals(world());
    if (world()->rank() != 0) continue;
    const std::vector<BlockOutput>& want = one.block_outputs.at(0);
    ASSERT_EQ(got.size(), 2u);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].count, want[i].count * (layout.empty() ? 1 : 2)) << "tensor parallel replicates rows";
      const double d = block_output_difference(got[i], want[i]);
      if (shifted && i == 1) {
        EXPECT_GT(d, 1e-3) << describe(layout);
      } else {
        EXPECT_LT(d, 1e-5) << "block " << i << " " << describe(layout) << (shifted ? " shifted" : "");
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain::train
