// The hosts `meshtrain run` places its ranks on, and a probe of which of them
// still start processes (Note [Elastic restarts] in launch.cpp).
#pragma once

#include <string>
#include <vector>

namespace meshtrain::apps {

struct HostSlots {
  std::string name;
  int slots = 0;  // 0: not given (a hostfile line without slots=; mpirun then counts the host's cores)
};

// The hosts of `--hosts a:2,b` (a host without a count has 1 slot, as for
// mpirun --host) or of an Open MPI hostfile (a line per host, "name slots=N",
// # comments); a host named twice adds up its slots. Throws on a malformed entry.
std::vector<HostSlots> parse_hosts(const std::string& hostfile, const std::string& list);

// "a:2,b:2", for mpirun --host.
std::string host_list(const std::vector<HostSlots>& hosts);

// Whether each host starts a process within `seconds`: `mpirun -np 1 --host
// NAME:1 true` for every host at once; one that fails or does not finish in
// time (a host down, a link cut) does not answer, and `why` says which, with
// the probe's exit status and what it printed. With mpirun "srun", a one-task
// step on each node of the Slurm allocation instead. The host the launcher
// runs on (its name, or an address of one of its interfaces) answers without
// a probe: it cannot be lost while the launcher runs, and a probe of it could
// only fail for being slow on a loaded machine.
struct ProbeAnswer {
  bool answered = false;
  std::string why;  // for a host that did not answer
};
std::vector<ProbeAnswer> probe_hosts(const std::vector<HostSlots>& hosts, const std::string& mpirun, bool root,
                                     double seconds);

// What a probe printed, in one line of at most 200 characters: the first line
// of mpirun's framed message (below a line of dashes), else its last line that
// says something; empty when it printed nothing.
std::string probe_message(const std::string& text);

// Whether `name` is this machine: "localhost", its host name (case aside;
// "node1" also matches "node1.cluster" and the other way round, but two full
// names must be equal), or a numeric address one of its interfaces has.
bool is_this_host(const std::string& name);

}  // namespace meshtrain::apps
