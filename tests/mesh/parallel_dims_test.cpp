// ParallelDims: derivation of unset axes, the layout rules with their
// formulas, and one set of rules for config validation and the planner.
#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/train/config.h"
#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

namespace meshtrain::mesh {
namespace {

using testing::error_of;

ParallelDims dims(int64_t pp, int64_t dp, int64_t fsdp, int64_t tp, int zero = 0) {
  ParallelDims d;
  d.pp = pp;
  d.dp = dp;
  d.fsdp = fsdp;
  d.tp = tp;
  d.zero_stage = zero;
  return d;
}

TEST(ParallelDims, UnsetAxesTakeTheRanksTheOthersLeave) {
  ParallelDims d = dims(2, 0, 0, 2, 2);
  d.resolve(48);  // a world size no test could start: the arithmetic needs no processes
  EXPECT_EQ(d.dp, 1);
  EXPECT_EQ(d.fsdp, 12);
  EXPECT_EQ(d.world(), 48);
  d = dims(1, 3, 0, 4, 1);
  d.resolve(48);
  EXPECT_EQ(d.fsdp, 4);
  d = dims(1, 0, 0, 1, 0);
  d.resolve(6);
  EXPECT_EQ(d.dp, 6);
  EXPECT_EQ(d.fsdp, 1);
  EXPECT_EQ(d.mesh_layout().describe(), "pp(1) * dp(6) * fsdp(1) * ep(1) * cp(1) * tp(1)");
  EXPECT_EQ(d.str(), "pp=1 dp=6 fsdp=1 tp=1 zero=0");
}

TEST(ParallelDims, BrokenRulesPrintTheirFormula) {
  auto resolved = [](ParallelDims d, int64_t world) { return error_of([&] { d.resolve(world); }); };
  EXPECT_EQ(resolved(dims(2, 2, 2, 2, 1), 8), "dp = 2: dp(2) * fsdp(2) = 4 != the 2 data ranks (world size 8 / "
                                              "(pp(2) * ep(1) * tp(2)))");
  EXPECT_EQ(resolved(dims(1, 0, 0, 3), 8), "tp = 3: pp(1) * ep(1) * tp(3) = 3 does not divide the world size 8");
  ParallelDims d = dims(1, 1, 1, 1);
  d.schedule = PipelineSchedule::kInterleaved;
  d.pp = 2;
  EXPECT_EQ(error_of([&] { d.check(); }),
            "virtual_stages = 1: pp_schedule = \"interleaved\" needs virtual_stages >= 2 (with one stage per rank it is "
            "1f1b)");
  d.virtual_stages = 3;
  ModelDims model;
  model.layers = 4;
  model.heads = model.kv_heads = 8;
  model.ffn = model.vocab = model.context = 64;
  EXPECT_EQ(error_of([&] { d.check_model(model); }),
            "virtual_stages = 3: pp(2) * virtual_stages(3) = 6 stages > 4 layers; every stage needs a block");
  EXPECT_EQ(error_of([&] { d.check_microbatches(3); }),
            "microbatches = 3: the interleaved schedule needs micro-batches per step divisible by pp(2)");
  d = dims(1, 1, 1, 1);
  d.ep = 2;
  d.pp = d.virtual_stages = 1;
  d.schedule = PipelineSchedule::kOneFOneB;
  EXPECT_EQ(error_of([&] { d.check_model(model); }),
            "ep = 2: expert parallel needs a mixture-of-experts model (model.moe_experts > 0)");
  model.experts = 6;
  d.ep = 4;
  EXPECT_EQ(error_of([&] { d.check_model(model); }),
            "ep = 4: ep(4) does not divide model.moe_experts (6); every rank holds moe_experts / ep experts");
  d.zero_stage = 3;  // ZeRO-3 gathers experts with their blocks
  EXPECT_EQ(error_of([&] { d.check(); }), "no error");
}

// Many layouts of a small model, each asked of config validation and of the
// planner: they accept the same ones, and refuse the same ones for the same
// reason.
TEST(ParallelDims, ConfigAndPlannerAgreeOnEveryLayout) {
  const model::GptConfig model = [] {
    model::GptConfig c = model::GptConfig::preset("tiny");
    c.layers = 4;
    c.heads = 4;  // tp 3 and 8 do not divide it
    c.context = 24;
    return c;
  }();
  int accepted = 0, refused = 0;
  for (int64_t world : {1, 2, 3, 4, 6, 8}) {
    for (int64_t pp : {1, 2, 3, 4, 8}) {
      for (int64_t tp : {1, 2, 3, 4, 8}) {
        if (world % (pp * tp) != 0) continue;  // the planner is asked for whole layouts only
        const int64_t data = world / (pp * tp);
        for (int zero = 0; zero <= 3; ++zero) {
          for (int64_t fsdp = 1; fsdp <= data; ++fsdp) {
            if (data % fsdp != 0) continue;
            for (bool sp : {false, true}) {
              for (const std::string schedule : {"gpipe", "1f1b", "interleaved"}) {
                for (int64_t v : {1, 2, 3}) {
                  for (int64_t m : {1, 2, 3, 4}) {
                    const std::vector<std::string> overrides = {
                        "parallel.pp=" + std::to_string(pp), "parallel.dp=" + std::to_string(data / fsdp),
                        "parallel.fsdp=" + std::to_string(fsdp), "parallel.tp=" + std::to_string(tp),
                        "parallel.zero_stage=" + std::to_string(zero),
                        std::string("parallel.sequence_parallel=") + (sp ? "true" : "false"),
                        "parallel.pp_schedule=" + schedule, "parallel.virtual_stages=" + std::to_string(v),
                        "parallel.microbatches=" + std::to_string(m), "training.batch=" + std::to_string(m * data),
                        "model.layers=4", "model.heads=4", "model.context=24", "model.preset=tiny"};
                    std::string config_error;
                    try {
                      train::TrainConfig c = train::TrainConfig::load("", overrides);
                      c.validate(static_cast<int>(world));
                    } catch (const train::ConfigError& e) {
                      config_error = e.what();
                    }
                    plan::Layout layout;
                    layout.dims.pp = pp, layout.dims.dp = data / fsdp, layout.dims.fsdp = fsdp, layout.dims.tp = tp;
                    layout.dims.zero_stage = zero, layout.dims.sequence_parallel = sp;
                    layout.dims.schedule = config::parse_name(pipeline_schedule_names(), "schedule", schedule);
                    layout.dims.virtual_stages = v;
                    std::string plan_error;
                    try {
                      plan::check_layout(model, layout, m);
                    } catch (const std::invalid_argument& e) {
                      plan_error = e.what();
                    }
                    const std::string what = "world " + std::to_string(world) + ": " + layout.str() + " v=" +
                                             std::to_string(v) + " m=" + std::to_string(m);
                    ASSERT_EQ(config_error.empty(), plan_error.empty())
                        << what << "\n  config: " << config_error << "\n  planner: " << plan_error;
                    if (!config_error.empty()) {
                      // The same rule: the planner's message ends with the config's after "parallel.".
                      const std::string rule = config_error.substr(config_error.find('.') + 1);
                      EXPECT_NE(plan_error.find(rule), std::string::npos) << what << "\n  config: " << config_error
                                                                          << "\n  planner: " << plan_error;
                    }
                    (config_error.empty() ? accepted : refused) += 1;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 1000);
  std::printf("[ layouts ] %d accepted and %d refused alike by config validation and the planner\n", accepted, refused);
}

}  // namespace
}  // namespace meshtrain::mesh
