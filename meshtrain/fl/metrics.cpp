#include "meshtrain/fl/metrics.h"

#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

std::string format(const char* f, double a, double b) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) {
    b /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g %s", std::round(b * 10) / 10, units[u]);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

void append_jsonl(const std::string& path, const nlohmann::json& row) {
  std::ofstream out(path, std::ios::app);
  out << row.dump() << "\n";
  if (!out) throw std::runtime_error("cannot append to " + path);
}

std::vector<LossSeries> read_series(const std::vector<std::string>& paths) {
  std::vector<LossSeries> out;
  for (const auto& path : paths) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read metrics file '" + path + "'");
    LossSeries s;
    s.label = path;
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      nlohmann::json row;
      try {
        row = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw std::runtime_error(path + ":" + std::to_string(n) + ": not JSON (" + e.what() + ")");
      }
      if (row.contains("label") && row["label"].is_string()) s.label = row["label"];
      if (!row.contains("val_loss") || !row["val_loss"].is_number()) continue;
      // The start (round 0) has sent nothing: no place on a log axis.
      if (row.value("cumulative_uplink_bytes", 0.0) <= 0) continue;
      s.uplink_bytes.push_back(row.value("cumulative_uplink_bytes", 0.0));
      s.val_loss.push_back(row["val_loss"]);
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string loss_svg(const std::vector<LossSeries>& series, const std::string& title) {
  const double left = 70, top = 40, width = 560, height = 320, legend = 230;
  double x_min = std::numeric_limits<double>::max(), x_max = 0, y_min = x_min, y_max = -x_min;
  for (const auto& s : series) {
    for (size_t i = 0; i < s.val_loss.size(); ++i) {
      const double x = std::max(1.0, s.uplink_bytes[i]);
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, s.val_loss[i]);
      y_max = std::max(y_max, s.val_loss[i]);
    }
  }
  if (x_max == 0) x_min = 1, x_max = 10, y_min = 0, y_max = 1;
  const double lx0 = std::floor(std::log10(x_min)), lx1 = std::max(lx0 + 1, std::ceil(std::log10(x_max)));
  if (y_max - y_min < 1e-9) y_max = y_min + 1;
  auto px = [&](double x) { return left + (std::log10(std::max(1.0, x)) - lx0) / (lx1 - lx0) * width; };
  auto py = [&](double y) { return top + (y_max - y) / (y_max - y_min) * height; };
  const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  std::string svg = format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                           "font-family=\"sans-serif\" font-size=\"11\">\n",
                           left + width + legend, top + height + 50);
  svg += format("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", left + width + legend, top + height + 50);
  svg += "<text x=\"10\" y=\"22\" font-size=\"14\">" + escape(title) + "</text>\n";
  svg += format("<rect x=\"%.0f\" y=\"%.0f\" ", left, top) + format("width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#999\"/>\n", width, height);
  for (double e = lx0; e <= lx1; e += 1) {
    svg += format("<line x1=\"%.1f\" x2=\"%.1f\" ", px(std::pow(10, e)), px(std::pow(10, e))) +
           format("y1=\"%.0f\" y2=\"%.0f\" stroke=\"#eee\"/>\n", top, top + height);
    svg += format("<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">", px(std::pow(10, e)), top + height + 16) +
           human_bytes(std::pow(10, e)) + "</text>\n";
  }
  for (int k = 0; k <= 4; ++k) {
    const double y = y_min + (y_max - y_min) * k / 4;
    svg += format("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">", left - 6, py(y) + 4) + format("%.3f", y, 0.0) + "</text>\n";
  }
  svg += format("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">cumulative uplink bytes (log)</text>\n",
                left + width / 2, top + height + 38);
  svg += format("<text x=\"14\" y=\"%.0f\" transform=\"rotate(-90 14 %.0f)\" text-anchor=\"middle\">validation loss</text>\n",
                top + height / 2, top + height / 2);
  for (size_t s = 0; s < series.size(); ++s) {
    const std::string colour = colours[s % 8];
    std::string points;
    for (size_t i = 0; i < series[s].val_loss.size(); ++i)
      points += format("%.1f,%.1f ", px(series[s].uplink_bytes[i]), py(series[s].val_loss[i]));
    svg += "<polyline fill=\"none\" stroke=\"" + colour + "\" stroke-width=\"2\" points=\"" + points + "\"/>\n";
    const double ly = top + 14 + 18 * static_cast<double>(s);
    svg += format("<line x1=\"%.0f\" x2=\"%.0f\" ", left + width + 14, left + width + 36) +
           format("y1=\"%.0f\" y2=\"%.0f\" stroke=\"", ly, ly) + colour + "\" stroke-width=\"2\"/>\n";
    svg += format("<text x=\"%.0f\" y=\"%.0f\">", left + width + 42, ly + 4) + escape(series[s].label) + "</text>\n";
  }
  return svg + "</svg>\n";
}

void write_loss_svg(const std::vector<std::string>& metrics_paths, const std::string& out_path) {
  util::write_text_file(out_path, loss_svg(read_series(metrics_paths), "Validation loss against uplink bytes"));
}

}  // namespace meshtrain::fl
