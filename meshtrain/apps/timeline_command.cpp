// meshtrain timeline TRACE [-o OUT.svg]: a pipeline trace drawn as an SVG picture.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/parallel/pipeline/trace.h"
#include "meshtrain/util/files.h"

#include <cstdio>
#include <stdexcept>

namespace meshtrain::apps {

namespace {

namespace pipe = parallel::pipeline;

int run_timeline(const std::string& trace_path, std::string out_path, const std::string& title) {
  if (out_path.empty()) {
    const size_t dot = trace_path.rfind('.');
    out_path = (dot == std::string::npos ? trace_path : trace_path.substr(0, dot)) + ".svg";
  }
  const std::string text = util::read_text_file(trace_path);
  std::vector<std::vector<pipe::Span>> ranks;
  try {
    ranks = pipe::read_chrome_trace(text);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(trace_path + ": " + e.what() + " (expected the trace.json that train writes with --run.trace_step=N)");
  }
  util::write_text_file(out_path, pipe::timeline_svg(ranks, title));
  const std::vector<double> bubble = pipe::measured_bubble(ranks);
  std::printf("meshtrain: %zu ranks drawn to %s; bubble per rank:", ranks.size(), out_path.c_str());
  for (double b : bubble) std::printf(" %.1f%%", 100 * b);
  std::printf("\n");
  return 0;
}

}  // namespace

CommandPtr add_timeline(CLI::App& app) {
  struct Args {
    std::string trace, out, title = "pipeline timeline";
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "timeline", "Draw a pipeline trace (trace.json written by train with --run.trace_step=N) as an SVG picture: one "
                  "row per rank, forwards blue, backwards green, waits to receive red, with each rank's bubble");
  sub->add_option("trace", a->trace, "Chrome-trace JSON file")->required()->check(CLI::ExistingFile);
  sub->add_option("-o,--out", a->out, "SVG file to write (default: the trace's name with .svg)");
  sub->add_option("--title", a->title, "Title above the picture")->capture_default_str();
  return plain_command(sub, [a] { return run_timeline(a->trace, a->out, a->title); });
}

}  // namespace meshtrain::apps
