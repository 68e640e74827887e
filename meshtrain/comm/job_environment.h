// What the ranks of one job must share, checked when they start: the hosts
// they run on, and the MESHTRAIN_* variables (Note [Job environment]).
#pragma once

#include <string>
#include <vector>

namespace meshtrain::comm {

struct Placement {
  std::vector<std::string> host_of_rank;  // index: world rank
  bool checked = false;                   // from check_job_environment(), not the default
  // "4 ranks on 2 hosts (hostA: 0-1, hostB: 2-3)"
  std::string summary() const;
  // The host of a world rank, or "" when not known (not checked).
  std::string host_of(int rank) const;
  // Some world ranks with their hosts, when checked: "rank 0 on hostA, ranks 2-3 on hostB".
  std::string describe(std::vector<int> ranks) const;
};

// Collective over MPI_COMM_WORLD in plain MPI (MPI must be initialised):
// gathers every rank's host name and MESHTRAIN_* variables. Throws
// AgreedError, the same on every rank, naming each variable that differs,
// its values and the ranks and hosts that see them.
Placement check_job_environment();

// The placement of the last check in this process; one rank on this host before any.
const Placement& job_placement();

// "0-1,4,6-7" for sorted ranks.
std::string rank_ranges(const std::vector<int>& ranks);

}  // namespace meshtrain::comm
