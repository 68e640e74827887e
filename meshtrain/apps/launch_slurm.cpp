// Slurm: `meshtrain run` inside an allocation starts its ranks with srun
// (Note [Launching under Slurm]); `meshtrain submit CONFIG` writes the job
// script and submits it (Note [Submitting a job]).
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/launch_slurm.h"
#include "meshtrain/train/config.h"
#include "meshtrain/util/files.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::apps {

namespace {

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    const size_t end = dirs.find(':', start);
    const std::string dir = dirs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return false;
}

// A word for a shell script, quoted when it needs to be.
std::string shell_word(const std::string& word) {
  if (!word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,/=:@%+") ==
                           std::string::npos) {
    return word;
  }
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// What `command` prints (through /bin/sh), "" when it cannot run; its exit status to `status`.
std::string command_output(const std::string& command, int* status = nullptr) {
  FILE* pipe = popen(command.c_str(), "r");
  if (status) *status = -1;
  if (!pipe) return "";
  std::string text;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) text.append(buffer, n);
  const int ended = pclose(pipe);
  if (status) *status = ended;
  return text;
}

}  // namespace

// Note [Launching under Slurm]
// Inside an allocation (SLURM_JOB_ID set: sbatch, salloc) `meshtrain run`
// starts the ranks with `srun --mpi=pmix` rather than mpirun: Slurm then
// places, signals and accounts for them, and each rank reads its rank, its
// node's ranks and its host from PMIx as under mpirun. --launcher mpirun
// keeps mpirun (e.g. for --hosts), --launcher srun insists. SLURM_MPI_TYPE,
// when set, chooses the plugin instead of pmix.
bool use_srun(const std::string& launcher, const Hosts& hosts, int ranks) {
  const bool allocation = std::getenv("SLURM_JOB_ID") != nullptr;
  if (launcher == "mpirun") return false;
  const char* tasks = std::getenv("SLURM_NTASKS");
  if (launcher == "srun") {
    if (!allocation) {
      throw std::invalid_argument("run --launcher srun: not inside a Slurm allocation (SLURM_JOB_ID is unset); run it "
                                  "from a job script (sbatch) or salloc, or submit with `meshtrain submit CONFIG`");
    }
    if (!hosts.empty()) throw std::invalid_argument("run --launcher srun places ranks on the allocation's nodes: drop "
                                                    "--hosts/--hostfile");
    if (!on_path("srun")) throw std::invalid_argument("run --launcher srun: srun is not on PATH");
    return true;
  }
  if (!allocation || !hosts.empty()) return false;
  // An allocation of fewer tasks than ranks (a one-task job with many CPUs, say) keeps mpirun.
  if (!tasks || std::atoi(tasks) < ranks) {
    std::fprintf(stderr, "meshtrain: in Slurm job %s with %s task(s) for %d rank(s): launching with mpirun "
                 "(--launcher srun to insist)\n", std::getenv("SLURM_JOB_ID"), tasks ? tasks : "no", ranks);
    return false;
  }
  if (!on_path("srun")) {
    std::fprintf(stderr, "meshtrain: in Slurm job %s but srun is not on PATH: launching with mpirun\n",
                 std::getenv("SLURM_JOB_ID"));
    return false;
  }
  return true;
}

std::vector<std::string> srun_command(int ranks, const std::vector<HostSlots>& nodes, const std::vector<std::string>& args,
                                      const std::string& self) {
  std::vector<std::string> command{"srun", "--ntasks=" + std::to_string(ranks), "--kill-on-bad-exit=1"};
  if (!std::getenv("SLURM_MPI_TYPE")) command.push_back("--mpi=pmix");
  if (!nodes.empty()) {  // the allocation's nodes (--min-ranks), or after a loss those left (Note [Elastic restarts])
    std::string list;
    for (const HostSlots& node : nodes) list += (list.empty() ? "" : ",") + node.name;
    // --overlap: the lost step may hold its CPUs until Slurm marks the node down.
    command.insert(command.end(), {"--nodes=" + std::to_string(nodes.size()), "--nodelist=" + list, "--overlap"});
    const bool even = std::all_of(nodes.begin(), nodes.end(), [&](const HostSlots& n) { return n.slots == nodes[0].slots; });
    if (even && nodes.front().slots > 0) command.push_back("--ntasks-per-node=" + std::to_string(nodes.front().slots));
  }
  command.push_back(self);
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

// Under --min-ranks, `meshtrain run` keeps the allocation's nodes with their
// ranks (SLURM_NTASKS_PER_NODE, else an even share) to probe them after a
// rank's death and relaunch on those that answer (Note [Elastic restarts]);
// the job must be submitted with --no-kill, or Slurm ends it when it marks
// the node down.
std::vector<HostSlots> slurm_allocation(int ranks) {
  const char* list = std::getenv("SLURM_JOB_NODELIST");
  if (!list) throw std::invalid_argument("run --min-ranks under Slurm: SLURM_JOB_NODELIST is unset");
  std::vector<HostSlots> nodes;
  std::istringstream names(command_output("scontrol show hostnames " + shell_word(list)));
  for (std::string name; names >> name;) nodes.push_back(HostSlots{name, 0});
  if (nodes.empty()) throw std::runtime_error(std::string("cannot expand SLURM_JOB_NODELIST=") + list);
  // SLURM_TASKS_PER_NODE: "2(x3),1" is 2 tasks on each of the first three nodes, 1 on the fourth.
  const char* per_node = std::getenv("SLURM_TASKS_PER_NODE");
  std::istringstream counts(per_node ? per_node : "");
  size_t next = 0;
  for (std::string item; std::getline(counts, item, ',') && next < nodes.size();) {
    const int tasks = std::atoi(item.c_str());
    const size_t repeat = item.find("(x") != std::string::npos ? std::stoul(item.substr(item.find("(x") + 2)) : 1;
    for (size_t i = 0; i < repeat && next < nodes.size(); ++i) nodes[next++].slots = tasks;
  }
  for (; next < nodes.size(); ++next) nodes[next].slots = (ranks + int(nodes.size()) - 1) / int(nodes.size());
  return nodes;
}

// A job that ends by itself within a preemption's grace (the ranks saved and
// exited 0) counts as completed: queue it again, to resume (Note [Preemption]).
bool requeue_if_preempted() {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !std::getenv("SLURM_JOB_NODELIST")) return false;
  const std::string state = command_output("scontrol show job " + shell_word(job));
  if (state.find("PreemptTime=") == std::string::npos || state.find("PreemptTime=None") != std::string::npos) return false;
  std::fprintf(stderr, "meshtrain: Slurm job %s was preempted and stopped after a checkpoint; requeued to resume\n", job);
  std::fflush(stderr);
  if (std::system(("scontrol requeue " + shell_word(job)).c_str()) != 0) {
    std::fprintf(stderr, "meshtrain: scontrol requeue %s failed: resubmit the job to resume\n", job);
  }
  return true;
}

// Note [Submitting a job]
// `meshtrain submit CONFIG` writes RUN_OUT/job.sbatch and gives it to sbatch.
// The script runs `meshtrain run ... train` in the allocation, which starts
// one rank per task (per GPU on a GPU partition) with srun and PMIx, and
// supervises them: a lost node (--no-kill keeps the allocation) is left
// behind and training relaunched on the nodes that answer, resharded, down
// to half the ranks (Note [Elastic restarts]); a preempted job, its ranks
// saved on Slurm's SIGTERM (Note [Preemption]), is queued again (--requeue)
// and resumes. With --time, SIGTERM comes `grace` seconds before the limit,
// so that the last steps are saved. examples/slurm/train.sbatch is the same
// script written by hand.
struct SubmitOptions {
  std::string config;
  int nodes = 1;
  int ranks_per_node = 1;
  int gpus_per_node = 0;
  std::string time;  // Slurm's --time, e.g. 2:00:00
  std::string partition;
  std::string account;
  int grace_s = 120;
  bool script_only = false;
};

int ranks_per_node(const SubmitOptions& o) { return o.gpus_per_node > 0 ? o.gpus_per_node : o.ranks_per_node; }

std::string job_script(const SubmitOptions& o, const std::vector<std::string>& overrides, const std::string& out,
                       const std::string& self) {
  const int per_node = ranks_per_node(o);
  std::string s = "#!/usr/bin/env bash\n# Written by `meshtrain submit` (Note [Submitting a job]); sbatch this file to run it again.\n";
  s += "#SBATCH --job-name=meshtrain\n#SBATCH --nodes=" + std::to_string(o.nodes) + "\n";
  s += "#SBATCH --ntasks-per-node=" + std::to_string(per_node) + "\n";
  if (o.gpus_per_node > 0) s += "#SBATCH --gpus-per-node=" + std::to_string(o.gpus_per_node) + "\n";
  if (!o.partition.empty()) s += "#SBATCH --partition=" + o.partition + "\n";
  if (!o.account.empty()) s += "#SBATCH --account=" + o.account + "\n";
  if (!o.time.empty()) {
    s += "#SBATCH --time=" + o.time + "\n#SBATCH --signal=TERM@" + std::to_string(o.grace_s) + "\n";
  }
  s += "#SBATCH --requeue\n#SBATCH --no-kill\n#SBATCH --open-mode=append\n#SBATCH --output=" + out + "/slurm-%j.out\n";
  s += "#SBATCH --chdir=" + std::filesystem::current_path().string() + "\n";  // relative paths in the overrides
  s += "set -euo pipefail\n";
  if (o.gpus_per_node > 0) {
    s += "# One rank per GPU. NCCL picks its network itself; name it when it picks wrong:\n"
         "# export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5\n"
         "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}\n";
  }
  s += "echo \"meshtrain job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${SLURM_NTASKS} ranks on "
       "${SLURM_JOB_NODELIST}\"\n"
       "# srun starts the ranks; a lost node: relaunched on the nodes left; preempted: requeued (Note [Submitting a job])\n"
       "exec " + shell_word(self) + " run -n \"${SLURM_NTASKS}\" --max-restarts 3 --restart-on-hang --min-ranks "
       "$(( (SLURM_NTASKS + 1) / 2 )) train " + shell_word(o.config);
  bool grace_given = false;
  for (const std::string& word : overrides) {
    s += " " + shell_word("--" + word);
    grace_given = grace_given || word.rfind("checkpoint.preempt_grace_s=", 0) == 0;
  }
  if (!grace_given) s += " --checkpoint.preempt_grace_s=" + std::to_string(o.grace_s);
  s += "\n";
  return s;
}

// An #SBATCH value and the output folder must stay one word on one line.
void check_sbatch_word(const std::string& what, const std::string& value) {
  if (value.find_first_of(" \t\n\r%'\"\\") != std::string::npos) {
    throw std::invalid_argument("submit: " + what + " '" + value + "' may not hold spaces, quotes, '%' or new lines");
  }
}

int submit(const SubmitOptions& o, const std::vector<std::string>& overrides) {
  const train::TrainConfig config = train::TrainConfig::load(o.config, overrides);  // refuses a bad config here
  const std::string out = std::filesystem::absolute(config.out).lexically_normal().string();
  for (const auto& [what, value] : {std::pair<std::string, std::string>{"--time", o.time}, {"--partition", o.partition},
                                    {"--account", o.account}, {"run.out", out}}) {
    check_sbatch_word(what, value);
  }
  SubmitOptions absolute = o;
  absolute.config = std::filesystem::absolute(o.config).lexically_normal().string();
  const std::string script = job_script(absolute, overrides, out, self_executable());
  if (o.script_only) {
    std::fputs(script.c_str(), stdout);
    return 0;
  }
  if (!on_path("sbatch")) {
    throw std::invalid_argument("submit: sbatch is not on PATH (this is not a Slurm login node?); --script-only "
                                "prints the job script instead");
  }
  std::filesystem::create_directories(out);
  const std::string path = out + "/job.sbatch";
  util::write_text_file(path, script);
  int status = 0;
  const std::string printed = command_output("sbatch --parsable " + shell_word(path), &status);
  const std::string job = printed.substr(0, printed.find_first_of(";\n"));  // "ID" or "ID;cluster"
  if (status != 0 || job.empty()) {
    std::fprintf(stderr, "meshtrain: submit: sbatch refused %s (its message is above)\n", path.c_str());
    return 1;
  }
  const int per_node = ranks_per_node(o);
  std::printf("submitted Slurm job %s: %d node(s) x %d rank(s), script %s\n"
              "  follow:  tail -f %s/slurm-%s.out   (squeue -j %s; metrics: %s/metrics.jsonl)\n"
              "  stop with a checkpoint:  scancel --signal=TERM %s   (resume: sbatch %s)\n",
              job.c_str(), o.nodes, per_node, path.c_str(), out.c_str(), job.c_str(), job.c_str(), out.c_str(),
              job.c_str(), path.c_str());
  return 0;
}

CommandPtr add_submit(CLI::App& app) {
  auto o = std::make_shared<SubmitOptions>();
  CLI::App* sub = app.add_subcommand(
      "submit",
      "Submit a training run to Slurm: writes the job script (srun with PMIx, one rank per task or GPU, the ranks "
      "saving on Slurm's SIGTERM, requeued after a preemption, relaunched on the nodes left after a node failure) to "
      "the config's run.out/job.sbatch, runs sbatch, and prints how to follow and stop the job");
  sub->add_option("config", o->config, "TOML config file, as for train")->required()->check(CLI::ExistingFile);
  sub->add_option("--nodes", o->nodes, "Nodes")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--ranks-per-node", o->ranks_per_node, "Ranks per node on a CPU partition")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--gpus-per-node", o->gpus_per_node, "GPUs per node: one rank each (a GPU partition)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--time", o->time, "Time limit, as Slurm writes it (e.g. 2:00:00); SIGTERM comes --grace seconds "
                                     "before it, so the last steps are saved");
  sub->add_option("--partition", o->partition, "Partition");
  sub->add_option("--account", o->account, "Account");
  sub->add_option("--grace", o->grace_s,
                  "Seconds between Slurm's SIGTERM and its SIGKILL (the cluster's KillWait or GraceTime): "
                  "checkpoint.preempt_grace_s, unless an override sets it")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_flag("--script-only", o->script_only, "Print the job script instead of submitting it");
  allow_config_overrides(*sub);
  sub->footer("Overrides: --section.key=value, as for train; they go into the job script.\n"
              "Example:\n  meshtrain submit my_model.toml --nodes 4 --gpus-per-node 8 --time 24:00:00 "
              "--run.out=/shared/runs/a");
  return plain_command(sub, [o, sub] { return submit(*o, config_overrides(*sub)); });
}

}  // namespace meshtrain::apps
