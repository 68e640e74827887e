// What each rank did in a pipeline step, as spans: Chrome-trace JSON (open it
// in Perfetto or chrome://tracing) and an SVG picture of all ranks.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <string>
#include <vector>

namespace meshtrain::parallel::pipeline {

enum class SpanKind { kForward, kBackward, kSend, kRecv, kIdle };
const char* span_kind_name(SpanKind kind);  // "forward", "backward", "send", "recv", "idle"

// start/end: seconds on the host's steady clock (shared by the ranks of one host).
struct Span {
  SpanKind kind;
  int stage = -1;       // -1: not about one stage (e.g. idle at the end)
  int microbatch = -1;
  double start = 0, end = 0;
};

// Every rank's spans on `root` (empty elsewhere), by rank. Collective over `comm`.
std::vector<std::vector<Span>> gather_spans(comm::Communicator& comm, const std::vector<Span>& mine, int root = 0);

// Chrome trace events ("X" events, one track per rank, times in microseconds
// from the earliest span).
std::string chrome_trace(const std::vector<std::vector<Span>>& ranks);
// Reads what chrome_trace wrote (throws std::runtime_error on anything else).
std::vector<std::vector<Span>> read_chrome_trace(const std::string& text);

// The classic pipeline picture: one row per rank, time to the right, forwards
// and backwards as boxes labelled with their micro-batch, communication and
// idle time in between; a legend and the measured bubble per rank.
std::string timeline_svg(const std::vector<std::vector<Span>>& ranks, const std::string& title);

// Per rank: 1 - (forward + backward time) / (last end - first start).
std::vector<double> measured_bubble(const std::vector<std::vector<Span>>& ranks);

}  // namespace meshtrain::parallel::pipeline
