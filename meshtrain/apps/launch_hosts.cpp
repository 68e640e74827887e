// Hosts and their slots from --hosts or a hostfile, and the probe that finds
// the hosts still up after a failure (Note [Elastic restarts] in launch.cpp).
#include "meshtrain/apps/launch_hosts.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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

pid_t start_probe(const HostSlots& host, const std::string& mpirun, bool root) {
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
    for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) dup2(null, fd);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  if (pid > 0) setpgid(pid, 0);
  return pid;
}

}  // namespace

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

std::vector<bool> probe_hosts(const std::vector<HostSlots>& hosts, const std::string& mpirun, bool root,
                              double seconds) {
  std::vector<pid_t> pids;
  for (const HostSlots& host : hosts) pids.push_back(start_probe(host, mpirun, root));
  std::vector<bool> answered(hosts.size(), false), done(hosts.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (size_t left = hosts.size(); left > 0;) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t ended = pids[i] > 0 ? waitpid(pids[i], &status, WNOHANG) : -1;
      if (ended == 0) continue;
      done[i] = true;
      answered[i] = ended == pids[i] && WIFEXITED(status) && WEXITSTATUS(status) == 0;
      --left;
    }
    if (left == 0 || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (done[i]) continue;
    kill(-pids[i], SIGKILL);
    waitpid(pids[i], nullptr, 0);
  }
  return answered;
}

}  // namespace meshtrain::apps
