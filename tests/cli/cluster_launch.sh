#!/usr/bin/env bash
# meshtrain run on named hosts (here: this one by name, which is what a
# hostfile names): --hosts and --hostfile reach mpirun without
# --oversubscribe, so too few slots fail; MESHTRAIN_* variables are passed on
# with -x; ranks that disagree on them stop at once, naming the variable and
# where each value is seen (Note [Job environment]); train names its placement.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'pkill -KILL -f -- "$run/" 2> /dev/null || true; rm -rf "$run"' EXIT
host=$(hostname)
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)

MESHTRAIN_COMM_TIMEOUT=77 "$meshtrain" run -n 2 --hosts "$host:2" selfcheck --bench-max-size 0 > "$run/hosts.log" 2>&1 ||
  { cat "$run/hosts.log"; exit 1; }
grep -q -- "--host $host:2 " "$run/hosts.log" && grep -q -- "-x MESHTRAIN_COMM_TIMEOUT" "$run/hosts.log" || {
  cat "$run/hosts.log"; exit 1; }
grep -q -- "--oversubscribe" "$run/hosts.log" && { echo "--oversubscribe hides missing slots"; exit 1; }
grep -q "checks: [0-9]* passed, 0 failed on 2 ranks" "$run/hosts.log" || { cat "$run/hosts.log"; exit 1; }

printf '%s slots=2\n' "$host" > "$run/hostfile"
"$meshtrain" run -n 2 --hostfile "$run/hostfile" train --model.preset=tiny --model.layers=1 --training.steps=1 \
  --training.batch=2 --training.micro_batch=1 --training.sample_tokens=0 --run.out="$run/a" > "$run/train.log" 2>&1 ||
  { cat "$run/train.log"; exit 1; }
grep -q "on 2 ranks on 1 host ($host: 0-1)" "$run/train.log" || { cat "$run/train.log"; exit 1; }

status=0  # the suite's environment allows oversubscription; a user's would not
env -u OMPI_MCA_rmaps_base_oversubscribe "$meshtrain" run -n 3 --hostfile "$run/hostfile" selfcheck --bench-max-size 0 > "$run/slots.log" 2>&1 || status=$?
[ "$status" != 0 ] && grep -q "not enough slots" "$run/slots.log" || { echo "status $status"; cat "$run/slots.log"; exit 1; }

status=0
"$meshtrain" run -n 2 --hostfile "$run/missing" selfcheck > "$run/missing.log" 2>&1 || status=$?
[ "$status" != 0 ] && grep -q "run --hostfile $run/missing: No such file" "$run/missing.log" || {
  cat "$run/missing.log"; exit 1; }

# --min-ranks (Note [Elastic restarts]) needs hosts that can be lost, restarts, and the slots of every host.
min_ranks_refused() {  # expected message, then run's options
  local expected=$1 status=0
  shift
  "$meshtrain" run "$@" train --run.out="$run/never" > "$run/min.log" 2>&1 || status=$?
  [ "$status" != 0 ] && grep -qF -- "$expected" "$run/min.log" && [ ! -e "$run/never" ] || {
    echo "status $status"; cat "$run/min.log"; exit 1; }
}
min_ranks_refused "run --min-ranks needs --hosts, --hostfile or a Slurm allocation" -n 2 --max-restarts 1 --min-ranks 1
# The job script `submit` writes for a GPU partition (Note [Submitting a job]); cli.slurm runs a CPU one.
printf '[training]\nsteps = 2\n' > "$run/gpu.toml"
"$meshtrain" submit "$run/gpu.toml" --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu --script-only \
  --run.out="$run/gpu" > "$run/gpu.sbatch"
for line in "#SBATCH --nodes=4" "#SBATCH --ntasks-per-node=8" "#SBATCH --gpus-per-node=8" "#SBATCH --partition=gpu" \
    "#SBATCH --time=24:00:00" "#SBATCH --signal=TERM@120" "#SBATCH --requeue" "#SBATCH --no-kill" \
    "export NCCL_DEBUG=" " run -n \"\${SLURM_NTASKS}\" --max-restarts 3 --restart-on-hang --min-ranks" \
    "train $run/gpu.toml --run.out=$run/gpu --checkpoint.preempt_grace_s=120"; do
  grep -qF -- "$line" "$run/gpu.sbatch" || { echo "no '$line' in:"; cat "$run/gpu.sbatch"; exit 1; }
done
bash -n "$run/gpu.sbatch"
# srun asked for outside an allocation (Note [Launching under Slurm]).
(unset SLURM_JOB_ID; min_ranks_refused "run --launcher srun: not inside a Slurm allocation (SLURM_JOB_ID is unset)" \
  -n 2 --launcher srun)
min_ranks_refused "run --min-ranks needs --max-restarts K" -n 2 --hosts "$host:2" --min-ranks 1
min_ranks_refused "run --min-ranks 3 is more than -n 2" -n 2 --hosts "$host:2" --max-restarts 1 --min-ranks 3
printf '%s\n' "$host" > "$run/noslots"
min_ranks_refused "gives host $host no slots=N" -n 2 --hostfile "$run/noslots" --max-restarts 1 --min-ranks 1
min_ranks_refused "run --hosts $host:x: slots must be a positive count" -n 2 --hosts "$host:x"

# Plain mpirun with a variable on one rank only.
status=0
env -u MESHTRAIN_COMM_TIMEOUT mpirun "${root[@]}" --oversubscribe -np 1 env MESHTRAIN_COMM_TIMEOUT=5 "$meshtrain" selfcheck --bench-max-size 0 : \
  -np 2 "$meshtrain" selfcheck --bench-max-size 0 > "$run/env.log" 2>&1 || status=$?
[ "$status" != 0 ] || { cat "$run/env.log"; exit 1; }
grep -q "the ranks disagree on their settings: MESHTRAIN_COMM_TIMEOUT is unset on ranks 1-2 ($host); '5' on rank 0 ($host)" \
  "$run/env.log" || { cat "$run/env.log"; exit 1; }
[ "$(grep -c "disagree" "$run/env.log")" = 1 ] || { echo "said more than once"; cat "$run/env.log"; exit 1; }

# A rank that hangs (SIGSTOP): the watchdog names this rank's host and the ranks it waits for; the job ends.
MESHTRAIN_COMM_TIMEOUT=5 "$meshtrain" run -n 3 train --model.preset=tiny --model.layers=1 --training.steps=100000 \
  --training.batch=6 --training.micro_batch=2 --training.sample_tokens=0 --run.out="$run/hang" > "$run/hang.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do grep -q '"step":2' "$run/hang/metrics.jsonl" 2> /dev/null && break; sleep 0.2; done
grep -q '"step":2' "$run/hang/metrics.jsonl" || { echo "no step 2 within 120 s"; cat "$run/hang.log"; exit 1; }
stopped=$(pgrep -f -- "--run.out=$run/hang" | tail -1)
kill -STOP "$stopped"
status=0
wait "$launcher" || status=$?
kill -CONT "$stopped" 2> /dev/null || true
[ "$status" = 70 ] || { echo "status $status after a hang"; cat "$run/hang.log"; exit 1; }
grep -q "watchdog: .* did not complete after .*; it runs on $host; it waits for ranks\? [0-9,-]* on $host" "$run/hang.log" || {
  cat "$run/hang.log"; exit 1; }

# An mpirun that never finishes aborting (what a partition leaves): ended a bounded time after the watchdog's line.
cat > "$run/stuck-mpirun" <<'SH'
#!/usr/bin/env bash
echo "meshtrain: rank 2: watchdog: all_reduce(float32[4], sum) on communicator 'world' (sequence #9) did not complete after 3.0 s (timeout 3.0 s); it runs on hostB; it waits for ranks 0-1 on hostA; a peer rank died, hangs, or issued different collectives. Aborting the job." >&2
trap '' TERM
while :; do sleep 0.2; done
SH
chmod +x "$run/stuck-mpirun"
status=0
start=$(date +%s)
MESHTRAIN_MPIRUN="$run/stuck-mpirun" MESHTRAIN_LAUNCHER_ABORT_S=2 timeout -k 5 60 "$meshtrain" run -n 2 selfcheck > "$run/stuck.log" 2>&1 ||
  status=$?
took=$(( $(date +%s) - start ))
[ "$status" = 70 ] && [ "$took" -le 20 ] || { echo "status $status after $took s"; cat "$run/stuck.log"; exit 1; }
grep -q "mpirun has not ended the job 2 s after the watchdog's report" "$run/stuck.log" &&
  grep -q "the job ended on a watchdog timeout: rank 2: watchdog: all_reduce" "$run/stuck.log" || {
  cat "$run/stuck.log"; exit 1; }
echo "ok: hosts and hostfiles reach mpirun, slots are enforced, settings are passed on and checked, a hang names hosts and ends"
