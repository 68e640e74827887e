// Hosts and their slots from --hosts or a hostfile, and the probe that finds
// the hosts still up after a failure (Note [Elastic restarts] in launch.cpp).
#include "meshtrain/apps/launch_hosts.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace meshtrain::apps {

namespace {

void add_host(std::vector<HostSlots>& hosts, const std::string& name, int slots) {
  for (HostSlots& host : hosts) {
    if (host.name != name) continue;
    host.slots = host.slots > 0 && slots > 0 ? host.slots + slots : 0;
    return;
  }
  hosts.push_back({name, slots});
}

int parse_slots(const std::string& text, const std::string& where) {
  size_t used = 0;
  int slots = 0;
  try {
    slots = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || slots < 1) throw std::invalid_argument(where + ": slots must be a positive count, got '" + text + "'");
  return slots;
}

std::vector<HostSlots> parse_list(const std::string& list) {
  std::vector<HostSlots> hosts;
  std::stringstream entries(list);
  for (std::string entry; std::getline(entries, entry, ',');) {
    if (entry.empty()) throw std::invalid_argument("run --hosts " + list + ": an empty host name");
    const size_t colon = entry.rfind(':');
    const std::string name = entry.substr(0, colon);
    if (name.empty()) throw std::invalid_argument("run --hosts " + list + ": an empty host name");
    add_host(hosts, name, colon == std::string::npos ? 1 : parse_slots(entry.substr(colon + 1), "run --hosts " + entry));
  }
  return hosts;
}

std::vector<HostSlots> parse_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("run --hostfile " + path + ": cannot be read");
  std::vector<HostSlots> hosts;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    line = line.substr(0, line.find('#'));
    std::stringstream words(line);
    std::string name, word;
    if (!(words >> name)) continue;
    int slots = 0;
    while (words >> word) {
      if (word.rfind("slots=", 0) == 0) slots = parse_slots(word.substr(6), path + " line " + std::to_string(number));
    }
    add_host(hosts, name, slots);
  }
  if (hosts.empty()) throw std::invalid_argument("run --hostfile " + path + ": names no host (a line per host, e.g. `hostA slots=2`)");
  return hosts;
}

// Starts the probe of one host, its output to `output` (an open file); its pid, or -1.
pid_t start_probe(const HostSlots& host, const std::string& mpirun, bool root, int output) {
  std::vector<std::string> command{mpirun, "-np", "1", "--host", host.name + ":1"};
  if (mpirun == "srun") {  // a step of the allocation, beside any other (Note [Launching under Slurm])
    command = {"srun", "--nodes=1", "--ntasks=1", "--overlap", "--quiet", "--nodelist=" + host.name};
  } else if (root) {
    command.push_back("--allow-run-as-root");
  }
  command.push_back("true");
  std::vector<char*> argv;
  for (auto& word : command) argv.push_back(word.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);  // the probe and whatever it starts end together
    const int null = open("/dev/null", O_RDWR);
    dup2(null, STDIN_FILENO);
    dup2(output >= 0 ? output : null, STDOUT_FILENO);
    dup2(output >= 0 ? output : null, STDERR_FILENO);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  if (pid > 0) setpgid(pid, 0);
  return pid;
}

// What a probe wrote to its file; "" without one.
std::string read_all(int output) {
  std::string text;
  if (output < 0) return text;
  char chunk[4096];
  lseek(output, 0, SEEK_SET);
  for (ssize_t got; (got = read(output, chunk, sizeof chunk)) > 0;) text.append(chunk, static_cast<size_t>(got));
  return text;
}

std::string exit_reason(int status, int output) {
  std::string why = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                    : WIFSIGNALED(status) ? "ended by signal " + std::to_string(WTERMSIG(status))
                                          : "ended";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127) why += " (the probe's command could not be run)";
  const std::string said = probe_message(read_all(output));
  return said.empty() ? why : why + ": " + said;
}

// A numeric address (v4 or v6) in a form memcmp can compare; empty when `name` is not one.
std::string numeric_address(const std::string& name) {
  unsigned char bytes[sizeof(in6_addr)] = {};
  if (inet_pton(AF_INET, name.c_str(), bytes) == 1) return std::string(reinterpret_cast<char*>(bytes), 4);
  if (inet_pton(AF_INET6, name.c_str(), bytes) == 1) return std::string(reinterpret_cast<char*>(bytes), 16);
  return "";
}

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// Host names name one machine when equal (case aside), or when one is the
// other's first label ("node1" and "node1.cluster"); two full names that
// differ past it are two machines.
bool same_host_name(const std::string& a, const std::string& b) {
  const std::string x = lower(a), y = lower(b);
  if (x == y) return true;
  const bool x_short = x.find('.') == std::string::npos, y_short = y.find('.') == std::string::npos;
  return (x_short && y.substr(0, y.find('.')) == x) || (y_short && x.substr(0, x.find('.')) == y);
}

}  // namespace

std::string probe_message(const std::string& text) {
  std::stringstream lines(text);
  std::string line, said;
  bool framed = false;
  while (std::getline(lines, line)) {
    const bool dashes = line.size() > 10 && line.find_first_not_of('-') == std::string::npos;
    if (dashes) {
      framed = true;
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    said = line;
    if (framed) break;
  }
  return said.size() > 200 ? said.substr(0, 200) + "..." : said;
}

bool is_this_host(const std::string& name) {
  if (name == "localhost") return true;
  const std::string address = numeric_address(name);
  if (address.empty()) {  // a name: this host's, in full or up to its first dot (no lookup, which could hang)
    char own[HOST_NAME_MAX + 1] = {};
    if (gethostname(own, sizeof own - 1) != 0) return false;
    return same_host_name(name, own);
  }
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return false;
  bool mine = false;
  for (const ifaddrs* entry = interfaces; entry && !mine; entry = entry->ifa_next) {
    if (!entry->ifa_addr) continue;
    if (entry->ifa_addr->sa_family == AF_INET && address.size() == 4) {
      mine = std::memcmp(&reinterpret_cast<const sockaddr_in*>(entry->ifa_addr)->sin_addr, address.data(), 4) == 0;
    } else if (entry->ifa_addr->sa_family == AF_INET6 && address.size() == 16) {
      mine = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(entry->ifa_addr)->sin6_addr, address.data(), 16) == 0;
    }
  }
  freeifaddrs(interfaces);
  return mine;
}

std::vector<HostSlots> parse_hosts(const std::string& hostfile, const std::string& list) {
  return hostfile.empty() ? parse_list(list) : parse_hostfile(hostfile);
}

std::string host_list(const std::vector<HostSlots>& hosts) {
  std::string list;
  for (const HostSlots& host : hosts) {
    list += (list.empty() ? "" : ",") + host.name + (host.slots > 0 ? ":" + std::to_string(host.slots) : "");
  }
  return list;
}

std::vector<ProbeAnswer> probe_hosts(const std::vector<HostSlots>& hosts, const std::string& mpirun, bool root,
                                     double seconds) {
  std::vector<ProbeAnswer> answers(hosts.size());
  std::vector<pid_t> pids(hosts.size(), -1);
  std::vector<int> outputs(hosts.size(), -1);
  std::vector<bool> done(hosts.size(), true);
  size_t left = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (is_this_host(hosts[i].name)) {
      answers[i].answered = true;
      continue;
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string name = std::string(tmp && *tmp ? tmp : "/tmp") + "/meshtrain-probe-XXXXXX";
    outputs[i] = mkostemp(name.data(), O_CLOEXEC);  // the next probes do not inherit it
    if (outputs[i] >= 0) unlink(name.c_str());
    pids[i] = start_probe(hosts[i], mpirun, root, outputs[i]);
    done[i] = false;
    ++left;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t ended = pids[i] > 0 ? waitpid(pids[i], &status, WNOHANG) : -1;
      if (ended == 0) continue;
      done[i] = true;
      --left;
      if (ended != pids[i]) {
        answers[i].why = pids[i] > 0 ? "its probe could not be waited for" : "its probe could not be started (fork failed)";
      } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        answers[i].answered = true;
      } else {
        answers[i].why = exit_reason(status, outputs[i]);
      }
    }
    if (left == 0 || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (!done[i]) {
      kill(-pids[i], SIGKILL);
      waitpid(pids[i], nullptr, 0);
      char limit[32];
      std::snprintf(limit, sizeof limit, "%.0f", seconds);
      const std::string said = probe_message(read_all(outputs[i]));
      answers[i].why = "no answer within " + std::string(limit) + " s" + (said.empty() ? "" : " (last said: " + said + ")");
    }
    if (outputs[i] >= 0) close(outputs[i]);
  }
  return answers;
}

}  // namespace meshtrain::apps
