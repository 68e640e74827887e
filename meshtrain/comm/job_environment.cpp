#include "meshtrain/comm/job_environment.h"

#include "meshtrain/comm/agree.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

extern char** environ;

namespace meshtrain::comm {

// Note [Job environment]
// Every rank must run with the same MESHTRAIN_* settings: a communication
// timeout or a desync check on some ranks only makes one host give up while
// the other waits, and the report that follows blames the wrong thing.
// `meshtrain run` passes each one that is set on to every rank (mpirun -x),
// and the ranks check at start-up, before any communicator of meshtrain's
// exists (so with plain MPI on MPI_COMM_WORLD, unaffected by those very
// settings), that they agree; a difference stops the job at once, naming the
// variable, the values, and which ranks on which hosts see each. The same
// exchange gives the placement, which ranks run on which host, for the
// start-up line.

namespace {

Placement current{{"localhost"}};

std::string host_name() {
  char host[256] = "";
  if (gethostname(host, sizeof host - 1) != 0) return "unknown-host";
  return host;
}

// NAME=VALUE lines of this process's MESHTRAIN_* variables, sorted.
std::map<std::string, std::string> meshtrain_variables() {
  std::map<std::string, std::string> found;
  for (char** entry = environ; entry && *entry; ++entry) {
    const char* text = *entry;
    if (std::strncmp(text, "MESHTRAIN_", 10) != 0) continue;
    const char* equals = std::strchr(text, '=');
    if (!equals) continue;
    found[std::string(text, equals)] = equals + 1;
  }
  return found;
}

std::string encode(const std::string& host, const std::map<std::string, std::string>& variables) {
  std::string text = host + '\0';
  for (const auto& [name, value] : variables) text += name + '=' + value + '\0';
  return text;
}

std::vector<std::string> gather_world(const std::string& mine) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int length = static_cast<int>(mine.size());
  std::vector<int> lengths(size), offsets(size);
  MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    offsets[r] = total;
    total += lengths[r];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(all.substr(offsets[r], lengths[r]));
  return out;
}

// Who sees each value of one variable: "60 on ranks 0-1 (hostA), unset on ranks 2-3 (hostB)".
std::string who_sees(const std::string& name, const std::vector<std::map<std::string, std::string>>& variables,
                     const Placement& placement) {
  std::map<std::string, std::vector<int>> by_value;  // "" for unset, else "=value"
  for (size_t r = 0; r < variables.size(); ++r) {
    const auto it = variables[r].find(name);
    by_value[it == variables[r].end() ? "" : "=" + it->second].push_back(static_cast<int>(r));
  }
  // A secret's values are told apart by number, never shown.
  const bool secret = name.find("KEY") != std::string::npos || name.find("TOKEN") != std::string::npos ||
                      name.find("SECRET") != std::string::npos || name.find("PASSWORD") != std::string::npos;
  int values = 0;
  std::string text;
  for (const auto& [value, ranks] : by_value) {
    std::vector<std::string> hosts;
    for (int r : ranks) {
      if (std::find(hosts.begin(), hosts.end(), placement.host_of_rank[r]) == hosts.end()) {
        hosts.push_back(placement.host_of_rank[r]);
      }
    }
    std::string host_list;
    for (const std::string& h : hosts) host_list += (host_list.empty() ? "" : ", ") + h;
    const std::string shown = value.empty() ? "unset"
                              : secret      ? "value " + std::to_string(++values) + " (a secret: not shown)"
                                            : "'" + value.substr(1) + "'";
    text += std::string(text.empty() ? "" : "; ") + shown +
            (ranks.size() == 1 ? " on rank " : " on ranks ") + rank_ranges(ranks) + " (" + host_list + ")";
  }
  return text;
}

}  // namespace

std::string Placement::host_of(int rank) const {
  return checked && rank >= 0 && rank < static_cast<int>(host_of_rank.size()) ? host_of_rank[rank] : "";
}

std::string Placement::describe(std::vector<int> ranks) const {
  std::map<std::string, std::vector<int>> by_host;  // "" when the host is not known
  for (int r : ranks) by_host[host_of(r)].push_back(r);
  std::string text;
  for (auto& [host, mine] : by_host) {
    std::sort(mine.begin(), mine.end());
    text += (text.empty() ? "" : ", ") + std::string(mine.size() == 1 ? "rank " : "ranks ") + rank_ranges(mine) +
            (host.empty() ? "" : " on " + host);
  }
  return text;
}

std::string Placement::summary() const {
  std::vector<std::string> order;  // hosts in the order of their first rank
  std::map<std::string, std::vector<int>> ranks;
  for (size_t r = 0; r < host_of_rank.size(); ++r) {
    if (ranks.find(host_of_rank[r]) == ranks.end()) order.push_back(host_of_rank[r]);
    ranks[host_of_rank[r]].push_back(static_cast<int>(r));
  }
  const size_t n = host_of_rank.size();
  std::string text = std::to_string(n) + (n == 1 ? " rank on " : " ranks on ") + std::to_string(order.size()) +
                     (order.size() == 1 ? " host (" : " hosts (");
  for (size_t i = 0; i < order.size(); ++i) text += (i ? ", " : "") + order[i] + ": " + rank_ranges(ranks[order[i]]);
  return text + ")";
}

std::string rank_ranges(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ",") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return text;
}

Placement check_job_environment() {
  const std::vector<std::string> all = gather_world(encode(host_name(), meshtrain_variables()));
  Placement placement;
  placement.checked = true;
  std::vector<std::map<std::string, std::string>> variables(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    size_t start = 0, end = all[r].find('\0');
    placement.host_of_rank.push_back(all[r].substr(0, end));
    for (start = end + 1; (end = all[r].find('\0', start)) != std::string::npos; start = end + 1) {
      const std::string entry = all[r].substr(start, end - start);
      const size_t equals = entry.find('=');
      variables[r][entry.substr(0, equals)] = entry.substr(equals + 1);
    }
  }
  current = placement;
  std::vector<std::string> names;
  for (const auto& mine : variables) {
    for (const auto& [name, value] : mine) {
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  std::string differences;
  for (const std::string& name : names) {
    const bool same = std::all_of(variables.begin(), variables.end(), [&](const auto& v) {
      const auto a = v.find(name), b = variables[0].find(name);
      return (a == v.end()) == (b == variables[0].end()) && (a == v.end() || a->second == b->second);
    });
    if (!same) differences += (differences.empty() ? "" : "; and ") + name + " is " + who_sees(name, variables, placement);
  }
  if (!differences.empty()) {
    throw AgreedError("the ranks disagree on their settings: " + differences + ". Every rank must see the same "
                      "MESHTRAIN_* variables: `meshtrain run` passes on those set where it starts; with mpirun pass "
                      "them with -x NAME, under Slurm export them in the job script");
  }
  return placement;
}

const Placement& job_placement() { return current; }

}  // namespace meshtrain::comm
