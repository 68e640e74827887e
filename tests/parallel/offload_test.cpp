// ZeRO-Offload and ZeRO-Infinity: the sharded optimizer with its states (and
// at stage 3 the parameter shards) in host memory or an NVMe file trains as
// one process does, frees on each rank what the formula says, and
// checkpoints and resumes in any layout.
#include "meshtrain/offload/tier.h"
#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/util/memory.h"
#include "tests/parallel/training_fixture.h"

#include <cstdio>

namespace meshtrain::train {
namespace {

class OffloadTest : public TrainingTest {};

TEST_F(OffloadTest, EveryStageAndTierEqualsOneProcess) {
  const int n = world()->size();
  std::vector<Overrides> layouts;
  for (const char* stage : {"1", "2", "3"}) {
    for (const char* tier : {"cpu", "nvme"}) {
      layouts.push_back({std::string("parallel.zero_stage=") + stage, std::string("offload.optimizer=") + tier});
    }
  }
  layouts.push_back({"parallel.zero_stage=3", "offload.optimizer=cpu", "offload.params=cpu"});
  layouts.push_back({"parallel.zero_stage=3", "offload.optimizer=nvme", "offload.params=nvme"});
  layouts.push_back({"parallel.zero_stage=1", "offload.optimizer=cpu", "parallel.zero1_reduce=reduce_scatter"});
  if (n % 2 == 0 && n > 2) layouts.push_back({"parallel.zero_stage=3", "parallel.dp=2", "offload.optimizer=nvme"});
  const OneProcessRun single = one_process(config(1, kBatch / n), 4);
  for (const Overrides& layout : layouts) {
    Trainer offloaded(config(n, kBatch / n, "", layout), world());
    expect_same_training(offloaded, single, 4, describe(layout));
  }
}

TEST_F(OffloadTest, WithAccumulationAndBfloat16EqualTheResidentOptimizer) {
  const int n = world()->size();
  const int64_t micro = (kBatch / n) % 2 == 0 ? 2 : 1;
  {
    Trainer offloaded(config(n, micro, "", {"parallel.zero_stage=2", "offload.optimizer=nvme"}), world());
    const OneProcessRun single = one_process(config(1, micro), 4);
    ASSERT_GT(offloaded.config().grad_accum, 1);
    expect_same_training(offloaded, single, 4, "zero 2, nvme, accumulation");
  }
  // bfloat16 compute with fp32 masters: the offloaded step is the resident one's arithmetic.
  const Overrides bf16 = {"parallel.zero_stage=3", "parallel.param_dtype=bfloat16"};
  Overrides offload = bf16;
  offload.push_back("offload.optimizer=cpu");
  offload.push_back("offload.params=cpu");
  Trainer offloaded(config(n, kBatch / n, "", offload), world());
  Trainer resident(config(n, kBatch / n, "", bf16), world());
  for (int s = 0; s < 4; ++s) {
    const double got = offloaded.step().loss, want = resident.step().loss;
    EXPECT_NEAR(got, want, 1e-5 * want) << "bf16 zero 3, step " << s + 1;
  }
}

// Model states counted on each rank between steps, with and without offload:
// the drop is what leaves the device (Ψ parameters over N shards, fp32):
//   stage 1: the moments, 8Ψ/N (the masters are the parameters' own shard);
//   stage 2: + the shard gradients, 12Ψ/N;
//   stage 3: masters, moments and shard gradients, less the parameter shard
//            kept for gathering, 12Ψ/N; with params offloaded too, 16Ψ/N.
// The planner's model-state terms for the same runs drop alike.
TEST_F(OffloadTest, ModelStateMemoryDropsByTheFormula) {
  memory::install();
  const int n = world()->size();
  struct Case {
    int stage;
    Overrides offload;
    double drop;  // x Ψ/N
  };
  for (const Case& c : {Case{1, {"offload.optimizer=cpu"}, 8}, Case{2, {"offload.optimizer=cpu"}, 12},
                        Case{3, {"offload.optimizer=cpu"}, 12}, Case{3, {"offload.optimizer=nvme"}, 12},
                        Case{3, {"offload.optimizer=cpu", "offload.params=cpu"}, 16}}) {
    auto measure = [&](const Overrides& extra, double* host, double* planned) {
      Overrides layout = {"parallel.zero_stage=" + std::to_string(c.stage), "model.width=128"};
      layout.insert(layout.end(), extra.begin(), extra.end());
      TrainConfig cfg = config(n, kBatch / n, "", layout);
      const int64_t before = memory::current_bytes();
      const int64_t host_before = offload::tier_stats(offload::Tier::kHost).current +
                                  offload::tier_stats(offload::Tier::kNvme).current;
      Trainer trainer(cfg, world());
      StepResult result;
      for (int s = 0; s < 2; ++s) result = trainer.step();
      *host = static_cast<double>(offload::tier_stats(offload::Tier::kHost).current +
                                  offload::tier_stats(offload::Tier::kNvme).current - host_before);
      plan::PlannedRun run = plan::planned_run(cfg);
      run.workload.precision = plan::Precision::parse("fp32");
      const plan::RankMemory predicted = plan::estimate_memory(run.model, run.workload, run.layout, run.microbatches)[0];
      *planned = predicted.memory.model_states();
      return std::pair<double, double>{static_cast<double>(result.memory.model_states - before),
                                       static_cast<double>(cfg.model.parameter_count())};
    };
    double host_resident = 0, host_offloaded = 0, planned_resident = 0, planned_offloaded = 0;
    const auto [resident, psi] = measure({}, &host_resident, &planned_resident);
    const auto [offloaded, unused] = measure(c.offload, &host_offloaded, &planned_offloaded);
    const double formula = c.drop * psi / n;
    const double drop = resident - offloaded;
    const std::string what = "stage " + std::to_string(c.stage) + " " + describe(c.offload);
    if (world()->rank() == 0) {
      std::printf("[ offload ] %s, N = %d, Psi = %.0f: device model states %.0f -> %.0f bytes, drop %.0f, formula %.0f "
                  "(ratio %.4f); planner drop %.0f; host/NVMe tier %.0f bytes\n",
                  what.c_str(), n, psi, resident, offloaded, drop, formula, drop / formula,
                  planned_resident - planned_offloaded, host_offloaded);
    }
    EXPECT_LE(std::abs(drop - formula) / formula, 0.05) << what << ": " << drop << " vs " << formula;
    EXPECT_LE(std::abs(planned_resident - planned_offloaded - formula) / formula, 0.01) << what << " (planner)";
    // The tiers hold what left, and the masters' copy at stages 1 and 2.
    EXPECT_GE(host_offloaded, 0.95 * (c.drop + (c.stage < 3 ? 4 : 0)) * psi / n) << what;
  }
}

TEST_F(OffloadTest, ResumesExactlyAndIntoAnotherLayout) {
  const int n = world()->size();
  const Overrides layout = {"parallel.zero_stage=3", "offload.optimizer=nvme", "offload.params=nvme"};
  const std::string checkpoints = util::join_path(dir_, "checkpoints-offload");
  std::vector<double> straight;
  {
    Trainer trainer(config(n, kBatch / n, "", layout), world());
    for (int s = 0; s < 6; ++s) straight.push_back(trainer.step().loss);
  }
  {
    Trainer first_half(config(n, kBatch / n, checkpoints, layout), world());
    for (int s = 0; s < 3; ++s) EXPECT_EQ(first_half.step().loss, straight[s]) << s;
    first_half.save_checkpoint();
  }
  {
    Trainer second_half(config(n, kBatch / n, checkpoints, layout), world());
    ASSERT_TRUE(second_half.resumed());
    for (int s = 3; s < 6; ++s) EXPECT_EQ(second_half.step().loss, straight[s]) << "resumed offloaded, step " << s + 1;
  }
  // The same checkpoint in a resident layout, and in the host tier at stage 1.
  for (const Overrides& other : {Overrides{"parallel.zero_stage=2"}, Overrides{"parallel.zero_stage=1", "offload.optimizer=cpu"}}) {
    Trainer trainer(config(n, kBatch / n, checkpoints, other), world());
    ASSERT_TRUE(trainer.resumed());
    for (int s = 3; s < 6; ++s) {
      EXPECT_NEAR(trainer.step().loss, straight[s], 1e-5 * straight[s]) << describe(other) << ", step " << s + 1;
    }
  }
}

TEST_F(OffloadTest, BadSettingsAreRefusedByName) {
  auto error_of = [&](const Overrides& o) {
    try {
      config(world()->size(), kBatch / world()->size(), "", o);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of({"offload.optimizer=cpu"}).find("parallel.zero_stage >= 1"), std::string::npos);
  EXPECT_NE(error_of({"parallel.zero_stage=2", "offload.optimizer=cpu", "offload.params=cpu"}).find("zero_stage = 3"),
            std::string::npos);
  EXPECT_NE(error_of({"parallel.zero_stage=3", "offload.params=nvme"}).find("offload.optimizer"), std::string::npos);
  EXPECT_NE(error_of({"parallel.zero_stage=1", "offload.optimizer=disk"}).find("offload.optimizer"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::train
