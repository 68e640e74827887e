#include "meshtrain/annotate/report.h"

#include <nlohmann/json.hpp>

#include <iomanip>
#include <map>
#include <sstream>
#include <stdexcept>

namespace meshtrain::annotate {

namespace {

ShardingReport* active = nullptr;

}  // namespace

ReportScope::ReportScope() {
  if (active) throw std::logic_error("sharding report: one is recording already");
  active = new ShardingReport();
}

ReportScope::~ReportScope() {
  delete active;
  active = nullptr;
}

const ShardingReport& ReportScope::report() const { return *active; }

bool reporting() { return active != nullptr; }

void note_operator(ReportedOperator op) {
  if (active) active->operators.push_back(std::move(op));
}

void note_collective(const std::string& op, const std::string& kind, const std::vector<std::string>& axes,
                     int64_t bytes, const std::string& tensor) {
  if (!active) return;
  std::string names;
  for (const std::string& a : axes) names += (names.empty() ? "" : ",") + a;
  active->collectives.push_back({op, kind, names, tensor, bytes});
}

int64_t ShardingReport::bytes(const std::string& kind) const {
  int64_t total = 0;
  for (const ReportedCollective& c : collectives) total += kind.empty() || c.kind == kind ? c.bytes : 0;
  return total;
}

std::string ShardingReport::jsonl() const {
  std::ostringstream out;
  for (const ReportedOperator& op : operators) {
    out << nlohmann::json{{"op", op.op}, {"inputs", op.inputs}, {"outputs", op.outputs}}.dump() << "\n";
  }
  for (const ReportedCollective& c : collectives) {
    out << nlohmann::json{{"collective", c.kind}, {"for", c.op}, {"axes", c.axes}, {"tensor", c.tensor}, {"bytes", c.bytes}}
               .dump()
        << "\n";
  }
  out << nlohmann::json{{"summary", {{"operators", operators.size()}, {"collectives", collectives.size()}, {"bytes", bytes()}}}}
             .dump()
      << "\n";
  return out.str();
}

std::string ShardingReport::summary() const {
  struct Row {
    int64_t count = 0, bytes = 0;
  };
  std::map<std::pair<std::string, std::string>, Row> rows;
  for (const ReportedCollective& c : collectives) {
    Row& r = rows[{c.op, c.kind + " over " + c.axes}];
    ++r.count, r.bytes += c.bytes;
  }
  std::ostringstream out;
  out << operators.size() << " operators, " << collectives.size() << " collectives, " << bytes() << " bytes sent per rank\n";
  out << std::left << std::setw(40) << "operator" << std::setw(32) << "collective" << std::right << std::setw(8)
      << "count" << std::setw(14) << "bytes" << "\n";
  for (const auto& [key, r] : rows) {
    out << std::left << std::setw(40) << key.first << std::setw(32) << key.second << std::right << std::setw(8)
        << r.count << std::setw(14) << r.bytes << "\n";
  }
  return out.str();
}

}  // namespace meshtrain::annotate
