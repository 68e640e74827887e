# Sourced by tests that need a Slurm cluster on one machine, on the hosts of
# tests/cli/hosts.sh: slurmctld on node1, one slurmd per host under its own
# name, and one munged on this machine for all of them (its socket is a file,
# which every host's namespaces see). Each host has a folder of its own at
# DIR/local (hosts.sh's DISK): Slurm's PMIx plugin makes its per-step
# folders under TmpFS, which would collide on a /tmp the hosts share.
#
#   slurm_can_run            says why not (and returns 1) where the daemons or namespaces are missing
#   slurm_up N DIR [CONF]    hosts node1..nodeN, munged, slurmctld and N slurmd; CONF: more slurm.conf lines;
#                            returns once sinfo shows every node idle (or fails, with the daemons' logs)
#   on_cluster CMD...        runs CMD on node1 (sbatch, squeue, scontrol, ...)
#   job_state JOB            the job's state (PENDING, RUNNING, COMPLETED, ...)
#   wait_job JOB STATE... [-t SECONDS]   waits until the job is in one of the states
#   start_requeued JOB       once JOB is requeued (PENDING), makes it eligible now: Slurm holds a
#                            requeued batch job for 121 s before it may start again
#   slurm_down               ends the daemons and the hosts
#
# Debian's Slurm 22.05 carries the mpi/pmix plugin (PMIx 4): jobs start ranks with `srun --mpi=pmix`.

# shellcheck source=hosts.sh
source "$(dirname "${BASH_SOURCE[0]}")/hosts.sh"

slurm_dir=""
slurm_munged=""

slurm_can_run() {
  local tool
  for tool in slurmctld slurmd srun sbatch munged; do
    command -v "$tool" > /dev/null || { echo "needs $tool (Debian: slurmctld slurmd slurm-client munge; scripts/setup.sh --tests)"; return 1; }
  done
  hosts_can_run
}

slurm_up() {
  local count=$1 dir=$2 extra=${3:-} i
  slurm_dir=$dir
  hosts_up "$count" "$dir" "$dir/local"
  mkdir -p "$dir/slurm/state"
  head -c 1024 /dev/urandom > "$dir/slurm/munge.key"
  chmod 400 "$dir/slurm/munge.key"
  munged -F --force --socket="$dir/slurm/munge.sock" --key-file="$dir/slurm/munge.key" \
    --pid-file="$dir/slurm/munged.pid" --seed-file="$dir/slurm/munged.seed" --log-file="$dir/slurm/munged.log" \
    > /dev/null 2>&1 &
  slurm_munged=$!
  {
    echo "ClusterName=meshtrain-test"
    echo "SlurmctldHost=node1($(host_address 1))"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$dir/slurm/munge.sock"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$dir/slurm/state"
    echo "SlurmdSpoolDir=$dir/local/spool"
    echo "TmpFS=$dir/local"
    echo "SlurmctldPidFile=$dir/slurm/slurmctld.pid"
    echo "SlurmdPidFile=$dir/local/slurmd.pid"
    echo "SlurmctldLogFile=$dir/slurm/slurmctld.log"
    echo "SlurmdLogFile=$dir/slurm/slurmd-%n.log"
    echo "ProctrackType=proctrack/pgid"  # no cgroups needed
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/builtin"
    echo "SlurmdParameters=config_overrides"  # 2 CPUs a host, whatever this machine has
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=10"
    echo "MessageTimeout=5"
    echo "KillWait=30"
    echo "MinJobAge=300"
    for i in $(seq "$count"); do
      echo "NodeName=node$i NodeAddr=$(host_address "$i") CPUs=2 RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2"
    [ -z "$extra" ] || printf '%s\n' "$extra"
  } > "$dir/slurm/slurm.conf"
  echo "PMIxCliTmpDirBase=$dir/local" > "$dir/slurm/mpi.conf"
  export SLURM_CONF="$dir/slurm/slurm.conf"
  for i in $(seq "$count"); do mkdir -p "$dir/disk-node$i/spool"; done
  on_host 1 slurmctld -D -i > "$dir/slurm/slurmctld.out" 2>&1 &
  for i in $(seq "$count"); do on_host "$i" slurmd -D -N "node$i" > "$dir/slurm/slurmd-node$i.out" 2>&1 & done
  for _ in $(seq 100); do
    [ "$(on_cluster sinfo -h -o '%T %D' 2> /dev/null)" = "idle $count" ] && return 0
    sleep 0.2
  done
  echo "the Slurm cluster did not come up within 20 s:"
  on_cluster sinfo 2>&1 || true
  tail -5 "$dir"/slurm/*.log "$dir"/slurm/*.out 2> /dev/null || true
  return 1
}

on_cluster() { on_host 1 "$@"; }

job_state() { on_cluster scontrol show job "$1" 2> /dev/null | sed -nE 's/.*JobState=([A-Z_]+).*/\1/p'; }

wait_job() {
  local job=$1 limit=120 states=() state
  shift
  while [ $# -gt 0 ]; do
    if [ "$1" = -t ]; then limit=$2; shift 2; else states+=("$1"); shift; fi
  done
  for _ in $(seq $((limit * 5))); do
    state=$(job_state "$job")
    for s in "${states[@]}"; do [ "$state" = "$s" ] && return 0; done
    sleep 0.2
  done
  echo "job $job: $state after $limit s, waited for ${states[*]}"
  return 1
}

start_requeued() {
  # slurmd refuses a credential issued in the second it revoked the job's last one
  wait_job "$1" PENDING -t 60 && sleep 2 && on_cluster scontrol update JobId="$1" StartTime=now
}

slurm_down() {
  hosts_down
  [ -z "$slurm_munged" ] || kill "$slurm_munged" 2> /dev/null || true
  slurm_munged=""
  wait 2> /dev/null || true  # the daemons gone before the caller removes their folders
}
