// mpirun's stderr, filtered (launch_output.h).
#include "meshtrain/apps/launch_output.h"

#include <cstdio>

namespace meshtrain::apps {

namespace {

// Note [Launcher output]
// meshtrain says what went wrong itself: an error every rank agreed on once
// (exit status 1 on every rank), an error of one rank naming it (then
// MPI_Abort). Open MPI adds banners about non-zero exit codes and MPI_Abort
// that only repeat it, so the launcher drops those dash-framed blocks (and
// their "more processes have sent help message" echoes) from mpirun's
// stderr and passes everything else — "mpirun noticed that process rank 1
// ... exited on signal 9 (Killed)" included — and mpirun's exit status.
bool repeats_meshtrain(const std::string& block) {
  for (const char* marker : {"non-zero exit code", "non-zero status", "MPI_ABORT was invoked"}) {
    if (block.find(marker) != std::string::npos) return true;
  }
  return false;
}

bool is_frame(const std::string& line) { return line.size() > 20 && line.find_first_not_of('-') == std::string::npos; }

}  // namespace

void StderrFilter::feed(const char* data, size_t n) {
  pending_.append(data, n);
  for (size_t end; (end = pending_.find('\n')) != std::string::npos; pending_.erase(0, end + 1)) {
    line(pending_.substr(0, end));
  }
}

void StderrFilter::finish() {
  if (!pending_.empty()) line(pending_);
  pending_.clear();
  if (framed_) std::fprintf(stderr, "%s", block_.c_str());
  framed_ = false;
}

void StderrFilter::line(const std::string& text) {
  if (watchdog_.empty() && text.rfind("meshtrain: rank ", 0) == 0 && text.find(": watchdog: ") != std::string::npos) {
    watchdog_ = text.substr(11);
  }
  if (death_.empty() && text.find("noticed that process rank") != std::string::npos) death_ = text;
  // A host lost: mpirun's daemon there stopped answering, or the process that
  // started it (ssh, the rsh agent) ended; the banner may name the node a few lines on.
  for (const char* lost : {"lost communication with a remote daemon", "unable to reliably start one or more daemons"}) {
    if (death_.empty() && text.find(lost) != std::string::npos) death_ = "mpirun lost a host's daemon: " + text;
  }
  if (lost_daemon_.empty() && text.find("Remote daemon:") != std::string::npos) {
    lost_daemon_ = text.substr(text.find("on node") == std::string::npos ? text.size() : text.find("on node"));
  }
  if (is_frame(text)) {
    if (framed_ && !repeats_meshtrain(block_)) std::fprintf(stderr, "%s\n%s%s\n", text.c_str(), block_.c_str(), text.c_str());
    framed_ = !framed_;
    block_.clear();
    return;
  }
  if (framed_) {
    block_ += text + "\n";
    return;
  }
  if (text.find("sent help message") != std::string::npos || text.find("orte_base_help_aggregate") != std::string::npos) {
    return;
  }
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace meshtrain::apps
