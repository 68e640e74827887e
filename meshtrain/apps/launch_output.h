// What `meshtrain run` passes on of mpirun's (or srun's) stderr, and what it
// keeps of it: the line that says what ended the job (Note [Launcher output]).
#pragma once

#include <cstddef>
#include <string>

namespace meshtrain::apps {

// Open MPI's stderr, a line at a time: passed on without the banners that
// repeat meshtrain's own errors; what ended the job is kept.
class StderrFilter {
 public:
  void feed(const char* data, size_t n);
  void finish();  // the last line without a newline, and an unclosed block, passed on
  const std::string& watchdog_line() const { return watchdog_; }
  const std::string& rank_death() const { return death_; }
  const std::string& lost_daemon() const { return lost_daemon_; }  // "on node NAME", or empty

 private:
  void line(const std::string& text);

  std::string pending_, block_, watchdog_, death_, lost_daemon_;
  bool framed_ = false;
};

}  // namespace meshtrain::apps
