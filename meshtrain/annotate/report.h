// The sharding report: for the operators run while it records, each one's
// input and output placements, and every collective completion inserted
// (a redistribution of an input, or one inside a kernel), with bytes.
#pragma once

#include "meshtrain/placement/placement.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::annotate {

struct ReportedCollective {
  std::string op;    // the operator it was for ("mm", "embedding")
  std::string kind;  // "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
  std::string axes;  // "tp", "dp,tp"
  std::string tensor;  // the input's spec before ("[64, 32] tp:P"), or what a kernel reduces
  int64_t bytes = 0;   // of the tensor each rank sends or receives (the larger), as the comm layer counts
};

struct ReportedOperator {
  std::string op;
  std::vector<std::string> inputs, outputs;  // specs ("[8, 64] tp:S(1) dp:R")
};

struct ShardingReport {
  std::vector<ReportedOperator> operators;
  std::vector<ReportedCollective> collectives;

  int64_t bytes(const std::string& kind = "") const;  // of every collective (of that kind)
  // JSON lines: one {"op":...} per operator, one {"collective":...} per collective, then a summary.
  std::string jsonl() const;
  // A table a person reads: the collectives grouped by operator and kind.
  std::string summary() const;
};

// Records while alive (one at a time); report() is what was recorded so far.
class ReportScope {
 public:
  ReportScope();
  ~ReportScope();
  ReportScope(const ReportScope&) = delete;
  ReportScope& operator=(const ReportScope&) = delete;
  const ShardingReport& report() const;
};

bool reporting();
void note_operator(ReportedOperator op);
void note_collective(const std::string& op, const std::string& kind, const std::vector<std::string>& axes,
                     int64_t bytes, const std::string& tensor = "");

}  // namespace meshtrain::annotate
