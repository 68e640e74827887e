#include "meshtrain/parallel/pipeline/trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace meshtrain::parallel::pipeline {

namespace {

constexpr int kFields = 5;  // kind, stage, micro-batch, start, end

double earliest(const std::vector<std::vector<Span>>& ranks) {
  double t = std::numeric_limits<double>::infinity();
  for (const auto& spans : ranks) {
    for (const Span& s : spans) t = std::min(t, s.start);
  }
  return std::isfinite(t) ? t : 0.0;
}

std::string format(const char* pattern, double a, double b = 0, double c = 0, double d = 0) {
  char text[256];
  std::snprintf(text, sizeof text, pattern, a, b, c, d);
  return text;
}

}  // namespace

const char* span_kind_name(SpanKind kind) {
  static const char* const names[] = {"forward", "backward", "send", "recv", "idle"};
  return names[static_cast<int>(kind)];
}

std::vector<std::vector<Span>> gather_spans(comm::Communicator& comm, const std::vector<Span>& mine, int root) {
  at::Tensor rows = at::empty({static_cast<int64_t>(mine.size()), kFields}, at::kDouble);
  for (size_t i = 0; i < mine.size(); ++i) {
    const Span& s = mine[i];
    const double values[kFields] = {double(int(s.kind)), double(s.stage), double(s.microbatch), s.start, s.end};
    for (int f = 0; f < kFields; ++f) rows[i][f] = values[f];
  }
  at::Tensor counts = at::empty({comm.size()}, at::kLong);
  comm.all_gather(counts, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong)).wait();
  std::vector<int64_t> per_rank(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + comm.size());
  int64_t total = 0;
  for (int64_t n : per_rank) total += n;
  at::Tensor all = at::empty({total, kFields}, at::kDouble);
  comm.all_gather(all, rows, per_rank).wait();
  std::vector<std::vector<Span>> out;
  if (comm.rank() != root) return out;
  out.resize(comm.size());
  const auto* data = all.data_ptr<double>();
  int64_t row = 0;
  for (int r = 0; r < comm.size(); ++r) {
    for (int64_t i = 0; i < per_rank[r]; ++i, ++row) {
      const double* v = data + row * kFields;
      out[r].push_back({SpanKind(int(v[0])), int(v[1]), int(v[2]), v[3], v[4]});
    }
  }
  return out;
}

std::string chrome_trace(const std::vector<std::vector<Span>>& ranks) {
  const double t0 = earliest(ranks);
  nlohmann::json events = nlohmann::json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", "rank " + std::to_string(r)}}}});
    for (const Span& s : ranks[r]) {
      std::string name = span_kind_name(s.kind);
      if (s.microbatch >= 0) name += " mb" + std::to_string(s.microbatch) + " s" + std::to_string(s.stage);
      events.push_back({{"name", name},
                        {"cat", span_kind_name(s.kind)},
                        {"ph", "X"},
                        {"pid", 0},
                        {"tid", r},
                        {"ts", (s.start - t0) * 1e6},
                        {"dur", (s.end - s.start) * 1e6},
                        {"args", {{"stage", s.stage}, {"microbatch", s.microbatch}}}});
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump(1) + "\n";
}

std::vector<std::vector<Span>> read_chrome_trace(const std::string& text) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("not JSON: ") + e.what());
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
    throw std::runtime_error("not a Chrome trace: no \"traceEvents\" array");
  }
  std::vector<std::vector<Span>> ranks;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const int rank = e.value("tid", -1);
    const std::string cat = e.value("cat", "");
    int kind = -1;
    for (int k = 0; k <= int(SpanKind::kIdle); ++k) {
      if (cat == span_kind_name(SpanKind(k))) kind = k;
    }
    if (rank < 0 || kind < 0 || !e.contains("ts") || !e.contains("dur")) {
      throw std::runtime_error("trace event " + e.dump() + " is not a pipeline span (cat forward/backward/send/recv/idle, tid = rank)");
    }
    if (static_cast<int>(ranks.size()) <= rank) ranks.resize(rank + 1);
    const double start = e["ts"].get<double>() * 1e-6;
    const auto args = e.value("args", nlohmann::json::object());
    ranks[rank].push_back({SpanKind(kind), args.value("stage", -1), args.value("microbatch", -1), start,
                           start + e["dur"].get<double>() * 1e-6});
  }
  if (ranks.empty()) throw std::runtime_error("the trace has no pipeline spans");
  return ranks;
}

std::vector<double> measured_bubble(const std::vector<std::vector<Span>>& ranks) {
  std::vector<double> out;
  for (const auto& spans : ranks) {
    double first = std::numeric_limits<double>::infinity(), last = -first, busy = 0;
    for (const Span& s : spans) {
      first = std::min(first, s.start);
      last = std::max(last, s.end);
      if (s.kind == SpanKind::kForward || s.kind == SpanKind::kBackward) busy += s.end - s.start;
    }
    out.push_back(last > first ? 1.0 - busy / (last - first) : 0.0);
  }
  return out;
}

std::string timeline_svg(const std::vector<std::vector<Span>>& ranks, const std::string& title) {
  const double t0 = earliest(ranks);
  double t1 = t0;
  for (const auto& spans : ranks) {
    for (const Span& s : spans) t1 = std::max(t1, s.end);
  }
  const double span = std::max(t1 - t0, 1e-9);
  const double left = 90, top = 50, row = 34, box = 26, width = 1100;
  const double height = top + row * ranks.size() + 70;
  const std::vector<double> bubble = measured_bubble(ranks);
  auto x = [&](double t) { return left + (t - t0) / span * width; };
  std::string svg = format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" font-size=\"11\">\n",
      left + width + 110, height);
  svg += format("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", left + width + 110, height);
  svg += "<text x=\"10\" y=\"22\" font-size=\"15\">" + title + "</text>\n";
  // Colours: forward blue, backward green, receive waits red, sends grey.
  auto fill = [](SpanKind k) {
    switch (k) {
      case SpanKind::kForward: return "#4e79a7";
      case SpanKind::kBackward: return "#59a14f";
      case SpanKind::kRecv: return "#e15759";
      case SpanKind::kSend: return "#9c9c9c";
      case SpanKind::kIdle: return "#f1ce63";
    }
    return "#000000";
  };
  for (size_t r = 0; r < ranks.size(); ++r) {
    const double y = top + row * r;
    svg += format("<text x=\"10\" y=\"%.1f\">rank %.0f</text>\n", y + box * 0.65, double(r));
    svg += format("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#f4f4f4\"/>\n", left, y, width, box);
    for (const Span& s : ranks[r]) {
      const double w = std::max(x(s.end) - x(s.start), 0.5);
      svg += format("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" ", x(s.start), y, w, box);
      svg += std::string("fill=\"") + fill(s.kind) + "\"><title>" + span_kind_name(s.kind) +
             (s.microbatch >= 0 ? " micro-batch " + std::to_string(s.microbatch) + " stage " + std::to_string(s.stage) : "") +
             format(" %.2f ms</title></rect>\n", (s.end - s.start) * 1e3);
      if ((s.kind == SpanKind::kForward || s.kind == SpanKind::kBackward) && w > 12) {
        svg += format("<text x=\"%.2f\" y=\"%.1f\" fill=\"white\" text-anchor=\"middle\">", x(s.start) + w / 2, y + box * 0.65) +
               std::to_string(s.microbatch) + "</text>\n";
      }
    }
    svg += format("<text x=\"%.1f\" y=\"%.1f\">bubble %.1f%%</text>\n", left + width + 8, y + box * 0.65, 100 * bubble[r]);
  }
  const double axis = top + row * ranks.size() + 14;
  svg += format("<text x=\"%.1f\" y=\"%.1f\">0</text>", left, axis);
  svg += format("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.1f ms</text>\n", left + width, axis, span * 1e3);
  double lx = left;
  for (SpanKind k : {SpanKind::kForward, SpanKind::kBackward, SpanKind::kRecv, SpanKind::kSend, SpanKind::kIdle}) {
    const char* label = k == SpanKind::kRecv ? "waiting to receive" : k == SpanKind::kIdle ? "waiting for sends" : span_kind_name(k);
    svg += format("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" ", lx, axis + 16) + "fill=\"" + fill(k) + "\"/>";
    svg += format("<text x=\"%.1f\" y=\"%.1f\">", lx + 16, axis + 26) + label + "</text>\n";
    lx += 150;
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace meshtrain::parallel::pipeline
