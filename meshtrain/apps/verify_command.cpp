// meshtrain verify CONFIG: the config's layout against one process, step by
// step (Note [Verify]).
#include "meshtrain/apps/commands.h"
#include "meshtrain/train/verify.h"

#include <cstdio>

namespace meshtrain::apps {

namespace {

void print_report(const train::VerifyReport& r, int ranks) {
  std::printf("meshtrain verify: %s on %d rank(s) against one process, %zu step(s)\n", r.layout.c_str(), ranks,
              r.steps.size());
  std::printf("model: %s%s\n", r.model.c_str(), r.scaled.empty() ? "" : (" (scaled down: " + r.scaled + ")").c_str());
  std::printf("%4s  %-33s  %-29s  %-27s  %s\n", "step", "loss: layout / one process (rel)", "grad norm: layout / one (rel)",
              "block outputs: largest, at", "parameters: rel / largest, first block beyond the tolerance");
  for (const train::VerifyStep& s : r.steps) {
    char params[256] = "not compared (the model is too large to keep a copy per step)";
    if (s.parameters_compared) {
      std::snprintf(params, sizeof params, "%.1e / %.1e, %s", s.parameter_relative, s.parameter_largest,
                    s.first_block.empty() ? "none"
                                          : (s.first_block + " (" + s.first_parameter + ")").c_str());
    }
    std::printf("%4lld  %9.6f / %9.6f (%7.1e)  %8.4f / %8.4f (%7.1e)  %7.1e, %-18s  %s\n", static_cast<long long>(s.step),
                s.loss, s.one_loss, s.loss_difference, s.grad_norm, s.one_grad_norm, s.grad_difference, s.output_largest,
                s.output_largest_block.c_str(), params);
  }
  if (r.first_different == 0) {
    std::printf("verdict: the same computation: every step's loss within %.0e, gradient norm within %.0e and "
                "parameters within %.0e of one process\n",
                r.loss_tolerance, r.grad_tolerance, r.parameter_tolerance);
    return;
  }
  const train::VerifyStep& s = r.steps.at(static_cast<size_t>(r.first_different - 1));
  std::printf("verdict: DIFFERENT from step %d: %s", r.first_different, r.difference.c_str());
  if (!s.first_output_block.empty()) {
    std::printf("; the first block whose output differs in it: %s (%.1e)", s.first_output_block.c_str(),
                s.first_output_difference);
  } else {
    std::printf("; every block's output agrees in it (the difference arises after the blocks' forward: the head, the "
                "loss, the backward or the update)");
  }
  if (!s.first_block.empty()) {
    std::printf("; the first block whose parameters differ after it: %s (%s, largest difference %.1e)",
                s.first_block.c_str(), s.first_parameter.c_str(), s.first_parameter_difference);
  }
  std::printf("\n");
}

}  // namespace

CommandPtr add_verify(CLI::App& app) {
  struct Args {
    std::string config;
    train::VerifyOptions o;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "verify",
      "Check that a config's parallel layout computes what one process computes: rank 0 trains the config on one "
      "process while the ranks train it in its layout, on the same data and seed, and each step's loss, gradient "
      "norm, each block's output and the parameters are compared; prints a verdict (exit 1 when they differ), the "
      "first block whose output differs and the first whose parameters differ. Run it on the layout's ranks: meshtrain run -n 4 verify CONFIG --scale-down");
  sub->add_option("config", a->config, "TOML config file, as for train")->check(CLI::ExistingFile);
  sub->add_option("--steps", a->o.steps, "Steps to compare")->check(CLI::Range(1, 1000))->capture_default_str();
  sub->add_flag("--scale-down", a->o.scale_down,
                "Keep the layout, shrink the rest: 16 dims per head, the fewest blocks, the shortest context and the "
                "smallest batch the layout accepts");
  sub->add_option("--tolerance", a->o.tolerance,
                  "Relative tolerance for the loss, gradient norm and parameters (default: 1e-5 loss, 1e-4 the "
                  "others in fp32; 2e-2 with bfloat16)")
      ->check(CLI::PositiveNumber);
  allow_config_overrides(*sub);
  sub->footer("Overrides: --section.key=value, as for train (meshtrain train --help lists the keys).\n"
              "The runs go under the config's run.out, in verify/, removed afterwards.");
  return command(sub, [a, sub](comm::Runtime& runtime) {
    train::TrainConfig config = train::TrainConfig::load(a->config, config_overrides(*sub));
    config.validate(runtime.size());
    const train::VerifyReport report = train::verify(runtime.world(), std::move(config), a->o);
    // Every rank exits with rank 0's verdict.
    at::Tensor verdict = at::full({1}, report.first_different == 0 ? 0 : 1, at::kInt);
    runtime.world()->broadcast(verdict, 0).wait();
    if (runtime.world()->rank() == 0) print_report(report, runtime.size());
    return verdict.item<int>();
  });
}

}  // namespace meshtrain::apps
