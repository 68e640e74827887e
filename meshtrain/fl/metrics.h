// Federated metrics: one JSON line per round (server_rounds.cpp writes them)
// and the picture people compare configurations by — validation loss against
// cumulative uplink bytes, one line per configuration, as SVG.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace meshtrain::fl {

void append_jsonl(const std::string& path, const nlohmann::json& row);

struct LossSeries {
  std::string label;
  std::vector<double> uplink_bytes, val_loss;  // cumulative bytes (x), loss (y), rounds with a val loss
};
// Reads metrics.jsonl files (throws std::runtime_error naming a bad line).
std::vector<LossSeries> read_series(const std::vector<std::string>& paths);
// Log-scaled x axis (bytes), linear y; a legend with each label.
std::string loss_svg(const std::vector<LossSeries>& series, const std::string& title);
void write_loss_svg(const std::vector<std::string>& metrics_paths, const std::string& out_path);

}  // namespace meshtrain::fl
